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
