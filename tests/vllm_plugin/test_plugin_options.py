"""``options``: the ``--model-loader-extra-config`` of the ``marlin_prepacked`` load format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from marlin_pack.vllm_plugin.options import OPTION_KEYS, LoaderOptions, parse_extra_config


def test_parse_extra_config_defaults_and_values() -> None:
    assert parse_extra_config({}) == LoaderOptions()
    o = parse_extra_config({"bundle": "~/b", "fallback": True, "verify": "full", "io_threads": 3, "chunk_mb": 16,
                            "io_mode": "hybrid"})
    assert o.bundle == Path("~/b").expanduser() and o.fallback and o.full_hash is True
    assert (o.io_threads, o.chunk_mb, o.io_mode) == (3, 16, "hybrid")
    assert parse_extra_config({"verify": "size"}).full_hash is False
    assert parse_extra_config({}).full_hash is None
    assert parse_extra_config({}).copy_during_build is True
    assert parse_extra_config({"copy_during_build": False}).copy_during_build is False
    assert parse_extra_config({"io_own_share": "during_build"}).io_own_share == "during_build"
    assert (parse_extra_config({}).io_staged, parse_extra_config({}).io_defer_unregister) == (0, None)  # None: by role
    o = parse_extra_config({"io_staged": 2, "io_defer_unregister": True, "io_common_by_helpers": True})
    assert (o.io_staged, o.io_defer_unregister, o.io_common_by_helpers) == (2, True, True)
    assert (parse_extra_config({}).io_stage_mib, parse_extra_config({"io_stage_mib": 16}).io_stage_mib) == (64, 16)
    assert parse_extra_config({}).io_common_by_helpers is False
    assert parse_extra_config({}).io_helper_nice == 0
    assert parse_extra_config({}).common_during_build is None  # on in a daemon's fill, off in an engine
    assert parse_extra_config({"common_during_build": False}).common_during_build is False
    assert parse_extra_config({"common_during_build": True}).common_during_build is True
    assert parse_extra_config({}).common_io == "with_rank_file"
    assert parse_extra_config({"common_io": "staged"}).common_io == "staged"
    assert parse_extra_config({"io_helper_nice": 19}).io_helper_nice == 19


def test_option_keys_are_the_options() -> None:
    assert tuple(f.name for f in dataclasses.fields(LoaderOptions)) == OPTION_KEYS


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("x", r"must be a dict for load format marlin_prepacked, got str"),
        ({"bundel": "/b"}, r"Unexpected extra config keys for load format marlin_prepacked: \['bundel'\]"),
        ({"bundle": ""}, r"\['bundle'\] must be a directory path"),
        ({"bundle": 3}, r"\['bundle'\] must be a directory path"),
        ({"fallback": "yes"}, r"\['fallback'\] must be true or false"),
        ({"copy_during_build": 1}, r"\['copy_during_build'\] must be true or false"),
        ({"io_staged": 17}, r"\['io_staged'\] must be an integer in 0\.\.16"),
        ({"io_staged": True}, r"\['io_staged'\] must be an integer"),
        ({"io_stage_mib": 0}, r"\['io_stage_mib'\] must be an integer in 1\.\.256"),
        ({"io_defer_unregister": "no"}, r"\['io_defer_unregister'\] must be true or false"),
        ({"common_during_build": "yes"}, r"\['common_during_build'\] must be true or false"),
        ({"common_during_build": None}, r"\['common_during_build'\] must be true or false"),  # JSON null: not the default
        ({"common_io": "helpers"}, r"\['common_io'\] must be one of \['with_rank_file', 'staged'\]"),
        ({"io_common_by_helpers": 1}, r"\['io_common_by_helpers'\] must be true or false"),
        ({"io_helper_nice": 20}, r"\['io_helper_nice'\] must be an integer in 0\.\.19"),
        ({"io_helper_nice": -1}, r"\['io_helper_nice'\] must be an integer in 0\.\.19"),
        ({"io_own_share": True}, r"\['io_own_share'\] must be one of \['during_build', 'after_build', 'none'\]"),
        ({"verify": "some"}, r"\['verify'\] must be one of \['auto', 'full', 'size'\]"),
        ({"io_threads": 0}, r"\['io_threads'\] is 0 \(no registered threads per copy helper\) but io_staged is 0: give io_staged >= 1"),
        ({"io_threads": -1, "io_staged": 2}, r"\['io_threads'\] must be an integer in 1\.\.64"),
        ({"io_threads": False, "io_staged": 2}, r"\['io_threads'\] must be an integer"),
        ({"io_threads": True}, r"\['io_threads'\] must be an integer"),
        ({"chunk_mb": 4096}, r"\['chunk_mb'\] must be an integer in 1\.\.1024"),
        ({"io_mode": "direct"}, r"\['io_mode'\] must be one of \['auto', 'staged', 'registered', 'hybrid', 'processes'\]"),
    ],
)
def test_parse_extra_config_refuses(extra: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_extra_config(extra)
