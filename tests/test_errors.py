"""The error vocabulary: mismatch fields print their wire names on every Python version."""

from __future__ import annotations

import pytest

from marlin_pack.errors import BundleMismatchError, LoadRefusedError, MismatchField


def test_mismatch_field_formats_as_its_value() -> None:
    e = BundleMismatchError("source.blake3", "changed")
    assert e.field is MismatchField.source_blake3 and e.field == "source.blake3"
    assert f"[{e.field}]" == "[source.blake3]" and str(MismatchField.tp_size) == "tp_size"


def test_unknown_field_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        LoadRefusedError("no-such-field", "x")


@pytest.mark.parametrize("make", [
    lambda m: __import__("marlin_pack.errors").errors.BundleError(m),
    lambda m: LoadRefusedError("files", m),
    lambda m: __import__("marlin_pack.errors").errors.UnsupportedCheckpointError(m),
])
def test_an_error_quoting_hostile_text_is_one_safe_line(make) -> None:  # type: ignore[no-untyped-def]
    """A refusal quoting a manifest string or a path: its text (the CLI's line, vLLM's report of a LoadRefusedError)
    shows the escape sequences and the newline, so it cannot clear the screen or forge a second line."""
    import traceback

    e = make("bundle file /m/\x1b]0;title\x07\x1b[2J\nrank 0/1: load.safetensors is missing")
    want = "bundle file /m/\\x1b]0;title\\x07\\x1b[2J\\nrank 0/1: load.safetensors is missing"
    assert str(e) == want
    assert traceback.format_exception_only(e)[-1].endswith(f": {want}\n")
