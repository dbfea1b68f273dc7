"""A fresh node's first start (issue 72): a cold bundle and an empty stamp store, ``verify: auto`` or ``full``. The
bundle is read once: the decision leaves the cold rank and common files' digests to the loader's copy, which hashes
the bytes it reads and compares them before anything is bound or served; a file that matched is stamped as
``check`` stamps it. On the CPU: the loader's own flow with vLLM's real layers (``test_plugin_loader``'s fakes), the
page cache's coldness stood in for (``hash_left_to_copy``) and the copy ``direct`` or ``staged`` as the plan makes it
for a cold file; every ``os.preadv`` and every mapped tensor of a bundle file counted (``bundle_reads.BundleBytes``). Experts
bundles, pipeline stages and expert shares: ``test_cold_start_shares``."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from bundle_reads import FIRST_BLOCK, BundleBytes, truncate_mid_copy
from safetensors.torch import load_file

from marlin_pack.errors import LoadRefusedError
from marlin_pack.io import hashing
from marlin_pack.io.hashing import file_identity
from marlin_pack.vllm_plugin import decision
from marlin_pack.vllm_plugin.patches.post_processing import is_prepacked

vr = pytest.importorskip("oracles.vllm_reference")
from test_plugin_loader import fake_create_model, fake_engine, io_plan, make_loader, with_vllm_embeddings  # noqa: E402


def _start(model_dir: Path, monkeypatch: pytest.MonkeyPatch, **extra: object) -> tuple[Any, Any]:
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
    loader = make_loader(**extra)
    with vr._patched(1, 0):
        return loader, loader.load_model(vllm_config, model_config)  # type: ignore[arg-type]


def _files(model_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in (model_dir / "marlin-pack/tp1/rank-0.safetensors", model_dir / "marlin-pack/common.safetensors")}


# The two cold plans: direct (memory would not keep the file cached) and staged through the page cache (it would).
COLD_MODES = ["direct", "staged"]


@pytest.mark.parametrize("mode", COLD_MODES)
@pytest.mark.parametrize("verify", ["auto", "full"])
def test_a_cold_start_reads_each_bundle_byte_once_and_stamps_it(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, verify: str, marlin_log: list[str],
    mode: str,
) -> None:
    monkeypatch.setenv("MARLIN_PACK_IO", json.dumps({"mode": mode, "threads": 2, "window_mib": 1}))
    model_dir = damaged_copy(awq_bundle)
    files = _files(model_dir)
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    reference = vr.reference_rank_tensors(model_dir, 1, 0, torch.float16)
    reads.ranges.clear()  # (the reference reads the checkpoint, not the bundle; cleared all the same)
    loader, model = _start(model_dir, monkeypatch, verify=verify)
    for name, path in files.items():  # each byte once: the copy's read, which the digest came from
        size = path.stat().st_size
        assert reads.once_past_the_first_block(path, size), (name, sorted(reads.ranges[reads.key(path)]))
        assert size <= reads.total(path) <= size + 2 * FIRST_BLOCK
        print(f"{name}: {size} bytes, {reads.total(path)} read ({reads.total(path) - size} of them before the copy)")
    for name, want in reference.items():
        layer, _, pname = name.rpartition(".")
        assert torch.equal(getattr(model.get_submodule(layer), pname).detach(), want), name
    stamps = {json.loads(p.read_text())["identity"][3] for p in cold.glob("*.json")}
    assert {file_identity(p)[3] for p in files.values()} <= stamps  # stamped as check stamps them
    line = [m for m in marlin_log if "as it was copied" in m]
    assert len(line) == 1 and "(2 files)" in line[0], marlin_log
    assert (str(cold) in line[0]) is (verify == "auto")  # (full says it hashes at every start instead)
    assert [m for m in marlin_log if "placed" in m and "hashed as it was read (digests compared after" in m]

    hashed_lines = len([m for m in marlin_log if "hashed" in m])  # the copy's (the checkpoint is sampled, not hashed)
    reads.ranges.clear()  # the next start: auto trusts the stamps (nothing hashed); full hashes again, in the one read
    _start(model_dir, monkeypatch, verify=verify)
    assert len([m for m in marlin_log if "hashed" in m]) == hashed_lines * (1 if verify == "auto" else 2)
    for name, path in files.items():
        assert reads.once_past_the_first_block(path, path.stat().st_size), (name, sorted(reads.ranges[reads.key(path)]))


def _flip_last_byte(model_dir: Path) -> None:
    rank = model_dir / "marlin-pack/tp1/rank-0.safetensors"
    data = bytearray(rank.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor: headers and sizes as they were
    rank.write_bytes(bytes(data))


@pytest.mark.parametrize("fallback", [False, True])
def test_a_flipped_byte_is_refused_after_the_copy_before_serving(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, fallback: bool, marlin_log: list[str]
) -> None:
    """The decision cannot see it (sizes and headers are right, the digest is left to the copy); the copy's digest
    refuses it before any layer is bound: the one-line refusal naming the file, or with ``fallback`` the checkpoint
    loaded the ordinary way into the model vLLM built. Nothing is stamped for it."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_dir = damaged_copy(awq_bundle, _flip_last_byte)
    rank = _files(model_dir)["rank-0.safetensors"]
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    ordinary: list[Any] = []
    monkeypatch.setattr(DefaultModelLoader, "load_weights", lambda self, model, model_config: ordinary.append(model))
    if not fallback:
        with pytest.raises(LoadRefusedError) as e:
            _start(model_dir, monkeypatch)
        text = str(e.value)
        assert "\n" not in text and "[files]" in text and "tp1/rank-0.safetensors has blake3" in text
        assert "the file was modified" in text and "fallback" in text
    else:
        _, model = _start(model_dir, monkeypatch, fallback=True)
        assert ordinary == [model] and not any(is_prepacked(m) for m in model.modules())
        assert any("loading the checkpoint the ordinary way because fallback is on" in m for m in marlin_log)
    assert reads.once_past_the_first_block(rank, rank.stat().st_size)  # refused after the copy read it, once
    stamped = {json.loads(p.read_text())["identity"][3] for p in cold.glob("*.json")}
    assert file_identity(rank)[3] not in stamped


def test_a_file_cut_short_mid_copy_is_refused_cleanly(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path
) -> None:
    """The rank file truncated while the copy reads it: one line naming it, nothing served, nothing stamped."""
    model_dir = damaged_copy(awq_bundle)
    rank = _files(model_dir)["rank-0.safetensors"]
    cut = truncate_mid_copy(monkeypatch, rank)
    with pytest.raises(LoadRefusedError) as e:
        _start(model_dir, monkeypatch)
    text = str(e.value)
    assert cut.is_set() and "\n" not in text and "[files]" in text and str(rank) in text, text
    assert "truncated" in text
    assert not [t for t in threading.enumerate() if t.name in ("marlin-pack-copy-hash", "marlin-pack-arena-copy")]
    assert not list(cold.glob("*.json")) or file_identity(rank)[3] not in {
        json.loads(p.read_text())["identity"][3] for p in cold.glob("*.json")}


def test_a_warm_bundle_is_hashed_before_the_copy_as_before(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path
) -> None:
    """Where the file is in the page cache the decision hashes it (a read of memory, not of the disk), and the copy
    reads the tensors: nothing is left to the copy."""
    monkeypatch.setattr(decision, "hash_left_to_copy", lambda path: False)
    model_dir = damaged_copy(awq_bundle)
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
    chosen = make_loader()._decide(vllm_config, model_config).bundle
    assert chosen is not None and chosen.hashed.pending == () and chosen.hashed.files == 2  # the checkpoint: sampled


def test_check_leaves_nothing_to_a_copy(awq_bundle: Path, damaged_copy: Any, cold: Path) -> None:
    """``marlin-pack check`` (preflight) copies nothing: it hashes every file it must itself, cold or not."""
    from marlin_pack.vllm_plugin.preflight import preflight

    model_dir = damaged_copy(awq_bundle)
    report = preflight(model_dir, tp_size=2)
    assert report.decision == "load" and report.hashed.pending == ()


@pytest.mark.parametrize("verify", ["auto", "full"])
def test_check_reads_each_file_once_whatever_the_ranks(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, verify: str
) -> None:
    """``marlin-pack check -tp 2`` where no stamp can be kept (a store others may open) or with ``--verify full``: each
    rank's check hashes the common file, and the command reads it once; the source checkpoint only in samples."""
    from typer.testing import CliRunner

    from marlin_pack.cli import app
    from marlin_pack.io.safetensors_io import read_header_bytes

    monkeypatch.setattr(hashing, "RACY_NS", -1)
    shared = tmp_path / "shared-stamps"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # refused as a stamp store: nothing is stamped, every rank would hash again
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(shared))
    model_dir = damaged_copy(awq_bundle)
    reads = BundleBytes(monkeypatch, model_dir)
    result = CliRunner().invoke(app, ["check", str(model_dir), "-tp", "2", "--verify", verify])
    assert result.exit_code == 0, result.output
    common = model_dir / "marlin-pack/common.safetensors"
    sources = sorted(model_dir.glob("*.safetensors"))
    assert sources
    for path in [common, *sorted((model_dir / "marlin-pack/tp2").glob("*.safetensors"))]:
        header = len(read_header_bytes(path))  # read by the checks of each rank (a few KiB), besides the hash
        assert reads.once_past_the_first_block(path, path.stat().st_size, first=header, most=8), (
            path.name, sorted(reads.ranges[reads.key(path)]))
    for path in sources:  # the checkpoint: its header and samples, kilobytes, by each rank's check
        assert reads.only_samples(path, most=8), (path.name, sorted(reads.ranges[reads.key(path)]))
    assert not list(shared.iterdir())


@pytest.mark.parametrize("mode", COLD_MODES)
def test_a_daemon_fill_reads_each_bundle_byte_once(
    awq_bundle: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, mode: str
) -> None:
    """A weight-cache daemon's fill (vLLM's daemon calls create_model and load_weights, inside ``exit_in_background``):
    the same one read, the digests compared before its weights are handed over, the files stamped."""
    monkeypatch.setenv("MARLIN_PACK_IO", json.dumps({"mode": mode, "threads": 2, "window_mib": 1}))
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from marlin_pack.gpu.helpers import exit_in_background

    model_dir = damaged_copy(awq_bundle)
    files = _files(model_dir)
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    fake_create_model(monkeypatch, model_dir)
    vllm_config, model_config = fake_engine(model_dir, "auto_awq", monkeypatch)
    loader = make_loader()
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16), exit_in_background():
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    for name, path in files.items():
        assert reads.once_past_the_first_block(path, path.stat().st_size), (name, sorted(reads.ranges[reads.key(path)]))
    stamps = {json.loads(p.read_text())["identity"][3] for p in cold.glob("*.json")}
    assert {file_identity(p)[3] for p in files.values()} <= stamps
    assert not any(is_prepacked(m) for m in model.modules())  # placed and finished


def test_common_tensors_left_to_the_common_files_one_read_are_not_copied_beside_the_construction(
    make_bundle: Any, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, cold: Path
) -> None:
    """A plan that copies the large common tensors beside the construction (``common_during_build``: a daemon's fill with
    helpers) leaves them to the common file's one read when its digest is left to the copy: read whole and hashed once,
    the embedding and head bound from there, not read a second time beside the construction."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model_dir = damaged_copy(make_bundle("gptq", "tiny"))
    files = _files(model_dir)
    common = load_file(str(files["common.safetensors"]))
    with_vllm_embeddings(monkeypatch, model_dir)
    io_plan(monkeypatch, mode="staged", threads=2, window_mib=1, common_during_build=True)
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    vllm_config, model_config = fake_engine(model_dir, "auto_gptq", monkeypatch)
    loader = make_loader()
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        from marlin_pack.vllm_plugin import patches

        patches.install()  # the engine's worker has them: the embedding method's stubs
        model = loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        loader.load_weights(model, model_config)  # type: ignore[arg-type]
        process_weights_after_loading(model, model_config, torch.device("cpu"))  # type: ignore[arg-type]
    assert loader._timings.common_beside is None
    for name, path in files.items():
        assert reads.once_past_the_first_block(path, path.stat().st_size), (name, sorted(reads.ranges[reads.key(path)]))
    assert torch.equal(model.lm_head.weight, common["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, common["model.embed_tokens.weight"])
    assert {file_identity(p)[3] for p in files.values()} <= {json.loads(p.read_text())["identity"][3] for p in cold.glob("*.json")}
