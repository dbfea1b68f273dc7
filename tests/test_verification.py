"""verify: passes on a faithful bundle, fails with a named reason on every kind of damage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from marlin_pack import convert, verify
from marlin_pack._constants import FORMAT_VERSION, READABLE_FORMAT_VERSIONS
from marlin_pack.io.hashing import file_digest


@pytest.fixture
def bundle(make_checkpoint, tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("gptq", "tiny-qwen2", bits=4, group_size=32), src)
    convert(src, tp=(1, 2))
    return src / "marlin-pack"


def _failure(b: Path, source: Path | None = None) -> tuple[str, str]:
    report = verify(b, source)
    assert not report.ok
    f = report.first_failure
    assert f is not None
    return f.name, f.detail


def test_faithful_bundle_passes(bundle: Path) -> None:
    report = verify(bundle)
    assert report.ok, report.first_failure
    assert [c.name for c in report.checks] == ["manifest", "files", "tensors", "source", "plan", "layout", "common", "round-trip"]
    assert "bit for bit" in report.checks[-1].detail


def test_flipped_byte_fails(bundle: Path) -> None:
    f = bundle / "tp2" / "rank-1.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    name, detail = _failure(bundle)
    assert name == "files" and "tp2/rank-1.safetensors has blake3" in detail and "was modified" in detail


def test_tampered_tensor_with_updated_hash_fails_round_trip(bundle: Path) -> None:
    # An attacker (or a bug) rewrites a tensor *and* the manifest hash: only the round trip can tell.
    path = bundle / "tp1" / "rank-0.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.qweight"
    tensors[name][0, 0] ^= 0x10
    save_file(tensors, path, metadata=RANK_0_OF_1)
    _rehash(bundle, path)
    name_, detail = _failure(bundle)
    assert name_ == "round-trip" and "down_proj (tp 1 rank 0): integer codes differ" in detail


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_nonzero_weight_padding_fails_round_trip(fmt: str, make_checkpoint, tmp_path: Path) -> None:
    # down_proj of tiny-padded has K = 480, padded to 512 for Marlin: a code in the padding rows must be zero.
    # The weights are compared in Marlin's layout (padding included); the decoded shard names the padding.
    from marlin_pack.marlin import repack

    src = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(fmt, "tiny-padded", group_size=32), src)
    convert(src, tp=(1,))
    bundle = src / "marlin-pack"
    assert verify(bundle).ok
    path = bundle / "tp1" / "rank-0.safetensors"
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.qweight"
    codes = repack.unpack_marlin_weights(tensors[name], 4)
    assert codes.shape[0] == 512 and not codes[480:].any()
    codes[511, 7] = 1
    tensors[name] = repack.pack_marlin_weights(codes, 4)
    save_file(tensors, path, metadata=RANK_0_OF_1)
    _rehash(bundle, path)
    name_, detail = _failure(bundle)
    assert name_ == "round-trip" and "down_proj (tp 1 rank 0): integer codes: padding is not zero" in detail, detail


def test_rank_file_of_another_rank_fails_tensors(bundle: Path) -> None:
    # Rank files say which rank of which TP size they are: a file of another rank is refused.
    path = bundle / "tp1" / "rank-0.safetensors"
    save_file(load_file(path), path, metadata={**RANK_0_OF_1, "tp_size": "2", "rank": "1"})
    _rehash(bundle, path)
    name, detail = _failure(bundle)
    assert name == "tensors" and "has metadata" in detail and "'rank': '0'" in detail


RANK_0_OF_1 = {"format": "marlin-pack", "format_version": str(FORMAT_VERSION), "tp_size": "1", "rank": "0"}


def _rehash(bundle: Path, path: Path) -> None:
    """Record a rewritten rank file's new size and hash in the manifest (as an attacker would)."""
    m = json.loads((bundle / "manifest.json").read_text())
    entry = m["tensor_parallel"][0]["ranks"][0]["file"]
    entry["size"], entry["blake3"] = path.stat().st_size, file_digest(path)
    (bundle / "manifest.json").write_text(json.dumps(m))


def test_changed_source_fails(bundle: Path) -> None:
    src = bundle.parent / "model.safetensors"
    data = bytearray(src.read_bytes())
    data[-3] ^= 0xFF
    src.write_bytes(bytes(data))
    name, detail = _failure(bundle)
    assert name == "source" and "changed since the bundle was made" in detail


def test_other_source_fails(bundle: Path, make_checkpoint) -> None:
    other = make_checkpoint("gptq", "tiny-qwen2", bits=4, group_size=32, seed=1)
    name, detail = _failure(bundle, other)
    assert name == "source" and "model.safetensors" in detail


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "tp1/../../x.safetensors"])
def test_manifest_path_traversal_refused(bundle: Path, path: str) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    m["common"]["path"] = path
    (bundle / "manifest.json").write_text(json.dumps(m))
    name, detail = _failure(bundle)
    assert name == "manifest" and "field common.path" in detail and "unsafe path" in detail


def test_symlink_escape_refused(bundle: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(bundle / "common.safetensors", outside)
    (bundle / "common.safetensors").unlink()
    os.symlink(outside, bundle / "common.safetensors")
    name, detail = _failure(bundle)
    assert name == "files" and "points outside the bundle" in detail


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m.update(format_version=max(READABLE_FORMAT_VERSIONS) + 1), f"has format_version {max(READABLE_FORMAT_VERSIONS) + 1}"),
        (lambda m: m.update(format="other"), "has format 'other'"),
        (lambda m: m.update(extra_field=1), "field extra_field: Extra inputs are not permitted"),
        (lambda m: m["common"].update(size=-5), "field common.size"),
        (lambda m: m["quant"].update(bits=8), "does not match bits=8"),
    ],
)
def test_malformed_manifest_refused(bundle: Path, edit, match: str) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    name, detail = _failure(bundle)
    assert name == "manifest" and match in detail


def test_missing_rank_file(bundle: Path) -> None:
    (bundle / "tp2" / "rank-0.safetensors").unlink()
    name, detail = _failure(bundle)
    assert name == "files" and "tp2/rank-0.safetensors is missing" in detail


def test_without_source_is_incomplete_not_ok(bundle: Path, tmp_path: Path) -> None:
    # A bundle away from its checkpoint: the source checks cannot run, and a skipped check is not "ok".
    moved = tmp_path / "elsewhere"
    shutil.copytree(bundle, moved)
    report = verify(moved)
    assert not report.ok and report.incomplete and report.first_failure is None
    skipped = [c for c in report.checks if c.status == "skipped"]
    assert [c.name for c in skipped] == ["source", "plan", "layout", "common", "round-trip"]
    assert "pass `source=MODEL_DIR`" in skipped[0].detail  # the API's argument (the CLI shows --source)
    assert verify(moved, bundle.parent).ok  # naming the source makes it complete


def test_integrity_only_checks_the_bundle_alone(bundle: Path, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere"
    shutil.copytree(bundle, moved)
    report = verify(moved, integrity_only=True)
    assert report.ok and [c.status for c in report.checks][:3] == ["ok", "ok", "ok"]
    assert {c.status for c in report.checks[3:]} == {"skipped"}
    (moved / "tp1" / "rank-0.safetensors").write_bytes(b"x")
    assert not verify(moved, integrity_only=True).ok


@pytest.mark.parametrize(
    "forge",
    [
        lambda m: m["source"]["quant_settings"].update(group_size=64),  # settings edited, digest left
        lambda m: m["source"].update(quant_settings_file="quantize_config.json"),
        lambda m: m["source"].update(digest="f" * 64),
    ],
    ids=["settings", "settings-file", "digest"],
)
def test_forged_source_record_fails(bundle: Path, forge) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    forge(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    name, detail = _failure(bundle)
    assert name == "source" and "source.digest does not match" in detail and "re-run `marlin-pack convert " in detail


def test_changed_irrelevant_quantization_key_passes(bundle: Path) -> None:
    # Calibration settings change nothing the bundle holds (nor what vLLM reads): not stale.
    cfg = json.loads((bundle.parent / "config.json").read_text())
    cfg["quantization_config"].update(damp_percent=0.5, dataset=["other calibration text"])
    (bundle.parent / "config.json").write_text(json.dumps(cfg))
    report = verify(bundle)
    assert report.ok, report.first_failure


def test_changed_relevant_quantization_key_fails(bundle: Path) -> None:
    cfg = json.loads((bundle.parent / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 128
    (bundle.parent / "config.json").write_text(json.dumps(cfg))
    name, detail = _failure(bundle)
    assert name == "source" and "config.json: quantization setting group_size is 128, the bundle was made with 32" in detail


def test_overlapping_tensors_fail(bundle: Path) -> None:
    # Two tensors sharing bytes: safetensors refuses such a file, so must verify (hash updated to match).
    path = bundle / "tp1" / "rank-0.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    a, b = "model.layers.0.mlp.down_proj.qweight", "model.layers.1.mlp.down_proj.qweight"  # same shape
    header[b]["data_offsets"] = header[a]["data_offsets"]  # earlier offsets: never more digits
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])
    _rehash(bundle, path)
    name, detail = _failure(bundle)
    assert name == "tensors" and "overlap" in detail


def test_extra_safetensors_outside_the_index_is_not_part_of_the_source(make_checkpoint, tmp_path: Path) -> None:
    # Mistral-style repos ship consolidated.safetensors beside an indexed sharded checkpoint.
    src = tmp_path / "sharded"
    shutil.copytree(make_checkpoint("awq", sharded=True), src)
    shutil.copy(sorted(src.glob("model-*.safetensors"))[0], src / "consolidated.safetensors")
    convert(src)
    report = verify(src / "marlin-pack")
    assert report.ok, report.first_failure


def test_malformed_file_with_matching_hash_is_reported_not_raised(bundle: Path) -> None:
    f = bundle / "common.safetensors"
    f.write_bytes(f.read_bytes() + bytes(8))  # trailing bytes: safetensors refuses the file
    m = json.loads((bundle / "manifest.json").read_text())
    m["common"]["size"], m["common"]["blake3"] = f.stat().st_size, file_digest(f)
    (bundle / "manifest.json").write_text(json.dumps(m))
    name, detail = _failure(bundle)
    assert name == "common" and "not a file safetensors reads (8 bytes follow the last tensor)" in detail


def test_deeply_nested_manifest(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("[" * 200_000)
    name, detail = _failure(tmp_path)
    assert name == "manifest" and "RecursionError" in detail


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_manifest_that_is_not_a_regular_file_is_refused_without_blocking(bundle: Path, special: str) -> None:
    m = bundle / "manifest.json"
    m.unlink()
    if special == "fifo":
        os.mkfifo(m)
    else:
        m.symlink_to("/dev/zero")  # stat says 0 bytes; reading never ends
    name, detail = _failure(bundle)
    assert name == "manifest" and "not a regular file" in detail


@pytest.mark.parametrize(
    "edit,field",
    [(lambda m: m["common"].update(path=m["common"]["path"] + "\n"), "field common.path"),
     (lambda m: m["common"].update(blake3=m["common"]["blake3"] + "\n"), "field common.blake3"),
     (lambda m: m.update(common_aliases={"lm_head.weight\n": "model.embed_tokens.weight"}), "field common_aliases")],
)
def test_manifest_names_with_a_trailing_newline_are_refused(bundle: Path, edit, field: str) -> None:
    """A regex's "$" also matches before a final newline: the schema matches names whole."""
    m = json.loads((bundle / "manifest.json").read_text())
    edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))
    name, detail = _failure(bundle)
    assert name == "manifest" and field in detail


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct-asym"])
def test_machete_bundle_passes_and_a_flipped_nibble_is_caught(make_checkpoint, tmp_path: Path, fmt: str) -> None:
    """A ``--kernel machete`` bundle verifies; one flipped nibble of a prepacked weight (hash updated, as an attacker
    would) fails the round trip, naming the layer; so does a changed pre-scaled zero point."""
    from marlin_pack._constants import MACHETE_FORMAT_VERSION

    src = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint(fmt, "tiny", group_size=64), src)
    bundle = convert(src, tp=(1,), kernel="machete").bundle
    assert verify(bundle).ok
    path = bundle / "tp1" / "rank-0.safetensors"
    meta = {**RANK_0_OF_1, "format_version": str(MACHETE_FORMAT_VERSION)}
    original = load_file(path)
    weight = "weight_packed" if fmt.startswith("ct") else "qweight"
    name = f"model.layers.1.mlp.down_proj.{weight}"
    tensors = {k: v.clone() for k, v in original.items()}
    tensors[name].view(-1)[123] ^= 0x0F0  # one nibble: one code of the prepacked stream
    save_file(tensors, path, metadata=meta)
    _rehash(bundle, path)
    step, detail = _failure(bundle)
    assert step == "round-trip" and "down_proj (tp 1 rank 0): integer codes differ" in detail, detail
    if fmt != "gptq":
        zeros = "weight_zero_point" if fmt.startswith("ct") else "qzeros"
        tensors = {k: v.clone() for k, v in original.items()}
        tensors[f"model.layers.0.self_attn.o_proj.{zeros}"][0, 0] += 1
        save_file(tensors, path, metadata=meta)
        _rehash(bundle, path)
        step, detail = _failure(bundle)
        assert step == "round-trip" and "o_proj (tp 1 rank 0): zero points (-scale * zero)" in detail, detail


# Each file read once: the digests of "files" and "source" come from the comparisons' reads (io.preads.HashedTensorFile).


@pytest.fixture
def sharded(make_checkpoint, tmp_path: Path) -> Path:
    """A bundle of TP 1 and 2 made from a checkpoint in six files (int32 tensors before float16 ones in each, as
    safetensors writes them: the comparisons read each file's scales before the codes ahead of them)."""
    src = tmp_path / "sharded"
    shutil.copytree(make_checkpoint("gptq", "tiny-qwen2", bits=4, group_size=32, sharded=True), src)
    convert(src, tp=(1, 2))
    return src / "marlin-pack"


def _header_end(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _tensor_at(path: Path, name: str) -> tuple[int, int]:
    """``[start, end)`` of tensor ``name`` in the file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start, end = json.loads(f.read(n))[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def _flip(path: Path, at: int, to: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01 if to is None else to]))


def _reads_of(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Path]]:
    from vllm_plugin.bundle_reads import BundleBytes

    model = sharded.parent
    return BundleBytes(monkeypatch, model), sorted(model.rglob("*.safetensors"))


def _once(reads: Any, files: list[Path], headers: int = 4) -> None:
    """Every byte of every file past its header read exactly once; the header at most ``headers`` times (the checks
    of headers read them apart, and the digest once)."""
    total = size_all = 0
    for path in files:
        size, start = path.stat().st_size, _header_end(path)
        assert reads.times_read(path, size, start) == {1}, (path, sorted(reads.ranges[reads.key(path)]))
        assert reads.times_read(path, start) <= set(range(1, headers + 1)), path
        total, size_all = total + reads.total(path), size_all + size
    print(f"{len(files)} files, {size_all} bytes, {total} read ({total / size_all:.3f}x)")


def test_verify_reads_each_bundle_and_checkpoint_file_once(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads, files = _reads_of(sharded, monkeypatch)
    checkpoint = [f for f in files if f.parent == sharded.parent]
    assert len(checkpoint) > 2 and {f.relative_to(sharded).as_posix() for f in files if f not in checkpoint} == {
        "common.safetensors", "tp1/rank-0.safetensors", "tp2/rank-0.safetensors", "tp2/rank-1.safetensors"}
    report = verify(sharded)
    assert report.ok, report.first_failure
    assert [c.name for c in report.checks] == ["manifest", "files", "tensors", "source", "plan", "layout", "common", "round-trip"]
    _once(reads, files)


def test_integrity_only_reads_the_bundle_once(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads, files = _reads_of(sharded, monkeypatch)
    assert verify(sharded, integrity_only=True).ok
    _once(reads, [f for f in files if sharded in f.parents])
    assert not [f for f in files if sharded not in f.parents and reads.total(f)]  # the checkpoint: not at all


def test_past_the_held_limit_a_range_is_read_again_and_still_hashed(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may wait for the bytes before it (HELD 0): each range read ahead of them in its file is read again when
    the hash reaches it; the bundle (read in file order) is still read once, and a flipped byte of such a range (a
    scale of the checkpoint, read before the codes) still fails "source"."""
    from marlin_pack.io import hashing

    monkeypatch.setattr(hashing, "HELD", 0)
    reads, files = _reads_of(sharded, monkeypatch)
    assert verify(sharded).ok
    _once(reads, [f for f in files if sharded in f.parents])
    twice = [f for f in files if sharded not in f.parents and 2 in reads.times_read(f, f.stat().st_size, _header_end(f))]
    assert twice and all(reads.times_read(f, f.stat().st_size, _header_end(f)) <= {1, 2} for f in files)
    shard = twice[0]
    scales = next(n for n in json.loads(shard.read_bytes()[8:_header_end(shard)]) if n.endswith(".scales"))
    _flip(shard, _tensor_at(shard, scales)[0])
    report = verify(sharded)
    f = report.first_failure
    assert f is not None and f.name == "source" and "changed since the bundle was made" in f.detail, f
    assert report.checks[-1] is f


def test_a_digest_mismatch_is_reported_before_the_comparison_that_also_fails(sharded: Path) -> None:
    """A flipped code: the round trip reads it and differs, and the digest differs; "files" is reported (the report ends
    there), as when the files were hashed before the comparisons. With the manifest's digest rewritten to match (as an
    attacker would), the round trip names it."""
    path = sharded / "tp1" / "rank-0.safetensors"
    _flip(path, sum(_tensor_at(path, "model.layers.1.mlp.down_proj.qweight")) // 2)
    report = verify(sharded)
    assert [(c.name, c.status) for c in report.checks] == [("manifest", "ok"), ("files", "failed")]
    assert "tp1/rank-0.safetensors has blake3" in report.checks[-1].detail and "was modified" in report.checks[-1].detail
    _rehash(sharded, path)
    name, detail = _failure(sharded)
    assert name == "round-trip" and "down_proj (tp 1 rank 0): integer codes differ" in detail, detail


def test_a_flipped_byte_of_a_bundle_header_padding_fails_files(sharded: Path) -> None:
    """The spaces padding a rank file's header: no check of the header or tensors reads them; the digest does."""
    path = next(p for p in sorted(sharded.rglob("*.safetensors")) if p.read_bytes()[_header_end(p) - 1] == ord(" "))
    _flip(path, _header_end(path) - 1, ord("\n"))  # still JSON
    name, detail = _failure(sharded)
    assert name == "files" and f"{path.relative_to(sharded).as_posix()} has blake3" in detail and "was modified" in detail
    m = json.loads((sharded / "manifest.json").read_text())
    for entry in [m["common"], *(r["file"] for s in m["tensor_parallel"] for r in s["ranks"])]:
        if entry["path"] == path.relative_to(sharded).as_posix():
            entry["blake3"] = file_digest(path)
    (sharded / "manifest.json").write_text(json.dumps(m))
    assert verify(sharded).ok  # nothing but the digest sees them


def test_a_flipped_byte_of_a_checkpoint_tensor_fails_source(sharded: Path) -> None:
    shard = sorted(sharded.parent.glob("model-*.safetensors"))[2]
    qweight = next(n for n in json.loads(shard.read_bytes()[8:_header_end(shard)]) if n.endswith(".qweight"))
    _flip(shard, sum(_tensor_at(shard, qweight)) // 2)
    report = verify(sharded)
    f = report.first_failure
    assert f is not None and f.name == "source" and f"source file {shard.name} changed since the bundle was made" in f.detail
    assert [c.name for c in report.checks] == ["manifest", "files", "tensors", "source"]


@pytest.mark.parametrize("which", ["bundle", "checkpoint"])
@pytest.mark.parametrize("when", ["compared", "hashed"])
def test_a_file_truncated_while_verified_is_reported_as_such(sharded: Path, monkeypatch: pytest.MonkeyPatch, which: str,
                                                             when: str) -> None:
    """Cut to half at the comparison's first read of it: the comparison reads it short and says so ("changed while it
    was read"), which the report gives as it did when the digests were taken first; cut once the comparisons are done,
    while what they left of it is read for its digest: the digest is refused ("changed while it was hashed"), as
    "files" or "source" refuses a file changing while it hashes it whole."""
    from marlin_pack.io import preads

    path = sharded / "tp2" / "rank-1.safetensors" if which == "bundle" else sorted(sharded.parent.glob("model-*.safetensors"))[1]
    cut: list[None] = []

    def truncate(f: Any) -> None:
        if not cut and f.path == path:
            cut.append(os.truncate(path, path.stat().st_size // 2))

    if when == "compared":
        read = preads.TensorFile._read_bytes
        monkeypatch.setattr(preads.TensorFile, "_read_bytes", lambda self, info: (truncate(self), read(self, info))[1])
    else:
        finish = preads.HashedTensorFile.finish
        monkeypatch.setattr(preads.HashedTensorFile, "finish", lambda self: (truncate(self), finish(self))[1])
    report = verify(sharded)
    f = report.first_failure
    assert cut and f is not None and report.checks[-1] is f, report.checks
    if when == "compared":
        assert f.name in ("common", "round-trip") and f"{path.name} changed while it was read (truncated to" in f.detail, f
    else:
        assert f.name == ("files" if which == "bundle" else "source"), f
        assert "changed while it was hashed (truncated to" in f.detail and "something is writing it" in f.detail, f.detail


def test_a_flipped_byte_no_comparison_reads_fails_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's multi-token-prediction layer: vLLM skips it, so the bundle neither converts nor compares it; its
    bytes are read for the checkpoint's digest alone, once, and a flipped one fails "source"."""
    pytest.importorskip("transformers")
    from moe_checkpoints import write_moe_checkpoint

    model = write_moe_checkpoint(tmp_path / "m", "DeepseekV3ForCausalLM", "awq", mtp_layers=1)
    bundle = convert(model, tp=(1,)).bundle
    reads, files = _reads_of(bundle, monkeypatch)
    assert verify(bundle).ok
    _once(reads, files)
    ckpt = model / "model.safetensors"
    mtp = next(n for n in json.loads(ckpt.read_bytes()[8:_header_end(ckpt)]) if n.startswith("model.layers.3.") and "qweight" in n)
    _flip(ckpt, sum(_tensor_at(ckpt, mtp)) // 2)
    name, detail = _failure(bundle)
    assert name == "source" and "source file model.safetensors changed since the bundle was made" in detail, detail
