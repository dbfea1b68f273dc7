"""``integrity.check_files(..., leave_to_copy=...)`` and ``settle_pending``: a digest left to the copy is compared and
stamped by the rules ``check`` follows (only bytes hashed, only files no one else may write), refused in its words."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from marlin_pack.bundle.integrity import check_files, settle_pending
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.errors import BundleError
from marlin_pack.gpu.plan import IoPlan
from marlin_pack.gpu.reader import ParallelReader
from marlin_pack.io import hashing
from marlin_pack.io.hashing import FileChangedError


@pytest.fixture
def bundle(make_bundle: Any, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(hashing, "RACY_NS", -1)
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(tmp_path / "stamps"))
    return damaged_copy(make_bundle("awq", "tiny")) / "marlin-pack"


def _pending(bundle: Path, full: bool | None = None) -> Any:
    manifest = read_manifest(bundle)
    rank = manifest.tensor_parallel_set(1).ranks[0].file
    report = check_files(bundle, manifest, [manifest.common, rank], full_hash=full,
                         leave_to_copy=lambda p: p.name == "rank-0.safetensors")
    return report


def _copy_digests(path: Path) -> dict:
    with ParallelReader(IoPlan("staged", threads=2, window=1 << 16)) as r:
        r.copy_files([(path, [])], hashed=[path])
        return r.digests


def test_the_decision_hashes_what_the_copy_does_not_read_and_leaves_the_rest(bundle: Path, tmp_path: Path) -> None:
    report = _pending(bundle)
    assert report.files == 1 and [p.name for p in report.pending] == ["tp1/rank-0.safetensors"]
    rank = report.pending[0].path
    settled = settle_pending(report.pending, _copy_digests(rank))
    assert (settled.files, settled.stamped, settled.nbytes) == (1, 1, rank.stat().st_size)
    assert _pending(bundle).pending == ()  # stamped: the next auto start hashes nothing
    assert [p.name for p in _pending(bundle, full=True).pending] == ["tp1/rank-0.safetensors"]


def test_a_copy_of_other_bytes_or_of_a_changing_file_is_refused_and_never_stamped(bundle: Path) -> None:
    report = _pending(bundle)
    rank = report.pending[0].path
    digests = _copy_digests(rank)
    forged = {str(rank): digests[str(rank)]._replace(digest="0" * 64)}
    with pytest.raises(BundleError, match=r"tp1/rank-0.safetensors has blake3 0000000000000000…, manifest says .*modified"):
        settle_pending(report.pending, forged)
    changed = {str(rank): FileChangedError(errno.ESTALE, "changed while it was hashed (truncated to 5 of its 9 bytes)",
                                           str(rank))}
    with pytest.raises(BundleError, match="rank-0.safetensors changed while it was hashed .truncated.*nothing was stamped"):
        settle_pending(report.pending, changed)
    with pytest.raises(BundleError, match="internal error: .* the copy did not"):
        settle_pending(report.pending, {})
    assert _pending(bundle).pending != ()  # nothing stamped


def test_a_file_others_may_write_is_compared_but_not_stamped(bundle: Path) -> None:
    report = _pending(bundle)
    rank = report.pending[0].path
    os.chmod(rank, 0o666)
    settled = settle_pending(report.pending, _copy_digests(rank))
    assert settled.stamped == 0 and settled.not_stamped[0][1].kind == "writable"
    assert "hashed at every start: writable by others" in (settled.summary() or "")


def test_a_source_file_left_to_the_read_that_reads_it_is_refused_in_the_source_checks_words(bundle: Path) -> None:
    """``check_source(..., leave_to_copy=...)`` (verify: the round trip's reads give the checkpoint's digests): sizes and
    headers checked, the digest pending; settled, a file of other bytes is the ``source.blake3`` refusal."""
    from marlin_pack.bundle.integrity import check_source
    from marlin_pack.errors import BundleMismatchError, MismatchField
    from marlin_pack.io.hashing import hash_file

    model = bundle.parent
    report = check_source(read_manifest(bundle), model, full_hash=True, leave_to_copy=lambda p: True)
    assert report.files == 0 and [(p.name, p.source) for p in report.pending] == [("model.safetensors", True)]
    path = report.pending[0].path
    assert settle_pending(report.pending, {str(path): hash_file(path)}).files == 1
    forged = {str(path): hash_file(path)._replace(digest="0" * 64)}
    with pytest.raises(BundleMismatchError, match=r"source file model.safetensors changed since the bundle was made") as e:
        settle_pending(report.pending, forged)
    assert e.value.field is MismatchField.source_blake3
