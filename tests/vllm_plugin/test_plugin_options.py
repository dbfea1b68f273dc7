"""``options``: the ``--model-loader-extra-config`` of the ``marlin_prepacked`` load format (four keys, pydantic).

How the bundle reaches the GPU is no option any more (``marlin_pack.gpu.plan``): the keys of earlier releases
are refused as removed, a misspelt key with the nearest one.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from marlin_pack.vllm_plugin.options import OPTION_KEYS, REMOVED_KEYS, LoaderOptions, parse_extra_config


def test_defaults() -> None:
    o = parse_extra_config({})
    assert o == LoaderOptions()
    assert (o.bundle, o.fallback, o.verify, o.preload, o.full_hash) == (None, False, "auto", True, None)


def test_option_keys_are_the_four_options() -> None:
    assert OPTION_KEYS == ("bundle", "fallback", "verify", "preload") == tuple(LoaderOptions.model_fields)
    assert not REMOVED_KEYS & set(OPTION_KEYS)


@pytest.mark.parametrize(
    ("extra", "field", "value"),
    [
        ({"bundle": "~/b"}, "bundle", Path("~/b").expanduser()),
        ({"bundle": "/srv/m/marlin-pack"}, "bundle", Path("/srv/m/marlin-pack")),
        ({"bundle": Path("rel/b")}, "bundle", Path("rel/b")),  # a path object as well as a string
        ({"bundle": None}, "bundle", None),  # JSON null: the default
        ({"fallback": True}, "fallback", True),
        ({"fallback": False}, "fallback", False),
        ({"verify": "auto"}, "full_hash", None),
        ({"verify": "full"}, "full_hash", True),
        ({"verify": "size"}, "full_hash", False),
        ({"preload": False}, "preload", False),
        ({"preload": True}, "preload", True),
    ],
)
def test_each_accepted_value(extra: dict, field: str, value: object) -> None:
    assert getattr(parse_extra_config(extra), field) == value


def test_every_key_at_once_and_options_are_frozen() -> None:
    o = parse_extra_config({"bundle": "/b", "fallback": True, "verify": "full", "preload": False})
    assert (o.bundle, o.fallback, o.verify, o.preload, o.full_hash) == (Path("/b"), True, "full", False, True)
    with pytest.raises(pydantic.ValidationError):
        o.fallback = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("x", r"^model_loader_extra_config must be a dict for load format marlin_prepacked, got str$"),
        (None, r"must be a dict for load format marlin_prepacked, got NoneType"),
        ({"bundle": ""}, (r"^model_loader_extra_config\['bundle'\] must be a directory path, s3://BUCKET/PREFIX or "
                          r"gs://BUCKET/PREFIX, got ''")),
        ({"bundle": 3}, r"\['bundle'\] must be a directory path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, got 3"),
        ({"bundle": ["/b"]}, r"\['bundle'\] must be a directory path"),
        ({"bundle": "~nosuchuser-marlin-pack/b"}, (r"\['bundle'\] must be a directory path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX, "
         r"got '~nosuchuser-marlin-pack/b'")),
        ({"fallback": "yes"}, r"^model_loader_extra_config\['fallback'\] must be true or false, got 'yes'"),
        ({"fallback": 1}, r"\['fallback'\] must be true or false, got 1"),  # strict: not 0/1
        ({"fallback": None}, r"\['fallback'\] must be true or false, got None"),
        ({"preload": "false"}, r"\['preload'\] must be true or false, got 'false'"),
        ({"preload": 0}, r"\['preload'\] must be true or false, got 0"),
        ({"verify": "some"}, r"\['verify'\] must be one of 'auto', 'full', 'size', got 'some'"),
        ({"verify": True}, r"\['verify'\] must be one of 'auto', 'full', 'size', got True"),
    ],
)
def test_each_refused_value_has_a_one_line_message(extra: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        parse_extra_config(extra)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "near"),
    [
        ("bundel", "bundle"),
        ("fallbak", "fallback"),
        ("fall_back", "fallback"),
        ("verfiy", "verify"),
        ("pre_load", "preload"),
        ("engine_preload", "preload"),  # renamed keys of earlier releases
        ("daemon_preload", "preload"),
        ("no_such_option", None),
    ],
)
def test_an_unknown_key_is_refused_with_the_nearest_known_one(key: str, near: str | None) -> None:
    with pytest.raises(ValueError) as e:
        parse_extra_config({key: True})
    text = str(e.value)
    assert text.startswith(f"model_loader_extra_config has an unknown key {key!r} for load format marlin_prepacked; ")
    assert text.endswith("expected some of bundle, fallback, verify, preload (docs/options.md)")
    assert ("did you mean" in text) is (near is not None)
    if near is not None:
        assert f"did you mean {near!r}? " in text
    assert "removed" not in text and "\n" not in text


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_a_removed_key_is_refused_as_removed(key: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_extra_config({key: 1, "fallback": True})  # refused whatever its value, beside valid keys
    text = str(e.value)
    assert f"unknown key {key!r}" in text
    assert "it was removed: how the bundle reaches the GPU is decided from the machine; drop it. " in text
    assert "did you mean" not in text and "\n" not in text


def test_the_removed_keys_are_those_of_earlier_releases() -> None:
    assert {"io_mode", "io_threads", "chunk_mb", "io_processes", "copy_during_build", "common_during_build", "common_io",
            "io_own_share", "io_staged", "io_stage_mib", "io_defer_unregister", "io_common_by_helpers", "io_helper_nice",
            "io_helper_service"} <= REMOVED_KEYS


def test_messages_name_the_load_format() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'x' for load format other_format; "):
        parse_extra_config({"x": 1}, "other_format")
    with pytest.raises(ValueError, match=r"must be a dict for load format other_format, got list"):
        parse_extra_config([], "other_format")
    with pytest.raises(ValueError, match=r"unknown key '1' for load format marlin_prepacked"):
        parse_extra_config({1: 2})  # not a string: named as one
