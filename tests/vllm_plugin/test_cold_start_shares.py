"""A fresh node's first start for the bundles a GPU reads only part of, or reads besides its rank file: experts bundles
(whose copy waits for vLLM's model: its Marlin MoE placeholders), pipeline stages (their layers of the rank file, their
common tensors) and expert shares (a GPU's experts of another TP size's rank file). With a cold bundle and an empty stamp
store the decision leaves every file's digest to the loader's copy; the copy reads each file whole, once: what it copies
and, into the hash only, what it does not (other stages' layers, other GPUs' experts). The digests are compared before
anything is bound or served, and files that match are stamped as ``check`` stamps them. On the CPU with vLLM's own
model classes (the MoE and stage oracles), every read of a bundle file counted (``bundle_reads.BundleBytes``), the page
cache's coldness stood in for (the ``cold`` fixture). ``marlin-pack check`` over stages and expert shares reads each file
once too. Dense bundles: ``test_cold_start_reads``.
"""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from bundle_reads import BundleBytes, truncate_mid_copy

from marlin_pack.errors import LoadRefusedError
from marlin_pack.io import hashing
from marlin_pack.io.hashing import file_identity
from marlin_pack.io.safetensors_io import read_header

vmr = pytest.importorskip("oracles.vllm_moe_reference")
sr = pytest.importorskip("oracles.vllm_stage_reference")
from stage_checkpoints import dtype_of, write_stage_bundle  # noqa: E402
from test_plugin_expert_share import _load  # noqa: E402
from test_plugin_stage import _bits, _load_stage  # noqa: E402

DTYPE = torch.float16
EP = {"enable_expert_parallel": True}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE GPTQ checkpoint (``marlin_pack.testing.synthetic_moe``: 2 decoder layers of 4 experts) converted
    for TP 1 and 2 (shared, read-only: tests break a ``damaged_copy``)."""
    from marlin_pack import convert
    from marlin_pack.testing.synthetic_moe import MoeShape, write_moe_checkpoint

    model = write_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", MoeShape(num_experts=4), "gptq", dtype=DTYPE)
    convert(model, tp=(1, 2))
    return model


@pytest.fixture(scope="module")
def stage_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GPTQ checkpoint of 5 decoder layers (the stage oracle's) converted for TP 1 and 2."""
    return write_stage_bundle(tmp_path_factory.mktemp("stage") / "m", "llama", 5)


def _stock(model_dir: Path, tp: int, rank: int, parallel: dict[str, Any], pp: tuple[int, int] = (1, 0),
           dp: tuple[int, int] = (1, 0)) -> dict[str, torch.Tensor]:
    """Every parameter stock vLLM holds on that GPU (and stage) after loading the checkpoint itself."""
    with vmr.vr._LOCK, vmr._moe_patched(tp, rank, pp=pp, dp=dp) as m, m.base.set_default_torch_dtype(DTYPE):
        ref, real = vmr._build(model_dir, tp, DTYPE, m, "marlin", parallel)
        ref.load_weights(vmr.vr._all_tensors(model_dir))
        m.base.process_weights_after_loading(ref, real, torch.device("cpu"))
        return {n: p.data.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:6]
    for name, t in want.items():
        if name.endswith(".qzeros") and t.numel() == 0:
            continue
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def _stamped(store: Path) -> set[int]:
    """The inodes the stamp store vouches for."""
    return {json.loads(p.read_text())["identity"][3] for p in store.glob("*.json")}


def _header_bytes(path: Path) -> int:
    """The length of a safetensors file's header, its 8-byte length included (read here with ``read``, not counted)."""
    with path.open("rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _read_once(reads: BundleBytes, files: list[Path]) -> None:
    """Every byte of each file read once, but its first block (the decision's header check and O_DIRECT probe, then the
    copy: at most 3 times)."""
    for path in files:
        first = max(4096, _header_bytes(path))
        assert reads.once_past_the_first_block(path, path.stat().st_size, first=first), (
            reads.key(path), sorted(reads.ranges[reads.key(path)])[:8])
        print(f"{reads.key(path)}: {path.stat().st_size} bytes, {reads.total(path)} read")


def _no_copy_threads() -> None:
    assert not [t for t in threading.enumerate() if t.name in ("marlin-pack-copy-hash", "marlin-pack-arena-copy")]


# --- experts bundles and expert shares ------------------------------------------------------------------------------

# case -> (tp, tp_rank, dp, dp_rank, parallel, pp, the files read: the rank file, [the experts file])
MOE_CASES: dict[str, tuple[int, int, int, int, dict[str, Any], tuple[int, int], tuple[str, ...]]] = {
    # experts bundle, no share: the copy waits for vLLM's construction (Marlin MoE placeholders), then hashes
    "experts-tp2-rank1": (2, 1, 1, 0, {}, (1, 0), ("tp2/rank-1",)),
    # expert parallelism: experts 2-3 of tp1/rank-0, the attention of tp2/rank-1
    "share-ep-tp2-rank1": (2, 1, 1, 0, EP, (1, 0), ("tp2/rank-1", "tp1/rank-0")),
    # data parallelism without EP: the experts of the flattened rank (tp2/rank-1), the attention of tp1/rank-0
    "share-dp2-rank1": (1, 0, 2, 1, {}, (1, 0), ("tp1/rank-0", "tp2/rank-1")),
    # a pipeline stage at expert parallelism: its layer of tp2/rank-0, its experts of that layer of tp1/rank-0
    "stage-share-pp2-stage1-ep": (2, 0, 1, 0, EP, (2, 1), ("tp2/rank-0", "tp1/rank-0")),
}


def _moe_files(model_dir: Path, names: tuple[str, ...]) -> list[Path]:
    return [model_dir / f"marlin-pack/{n}.safetensors" for n in names] + [model_dir / "marlin-pack/common.safetensors"]


@pytest.mark.parametrize(("case", "verify", "daemon"), [
    ("experts-tp2-rank1", "auto", False), ("experts-tp2-rank1", "full", False), ("experts-tp2-rank1", "auto", True),
    ("share-ep-tp2-rank1", "auto", False), ("share-dp2-rank1", "auto", False),
    ("stage-share-pp2-stage1-ep", "auto", False), ("stage-share-pp2-stage1-ep", "full", True),
])
def test_experts_and_shares_read_each_bundle_byte_once_and_stamp_it(
    moe_model: Path, damaged_copy: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, marlin_log: list[str],
    case: str, verify: str, daemon: bool,
) -> None:
    """Each file the GPU reads (its rank file, an expert share's file, the common file) is read once, whole: the bytes
    it copies and, only into the hash, the others' layers and experts; every parameter is stock vLLM's; every file is
    stamped; the digests were compared before anything was bound (one line). A weight-cache daemon's fill likewise."""
    tp, rank, dp, dp_rank, parallel, pp, names = MOE_CASES[case]
    model_dir = damaged_copy(moe_model)
    files = _moe_files(model_dir, names)
    want = _stock(model_dir, tp, rank, parallel, pp, (dp, dp_rank))
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    got, _, decision = _load(model_dir, "auto_gptq", DTYPE, monkeypatch, tp, rank, dp, dp_rank, parallel, daemon=daemon,
                             pp=pp, extra={"verify": verify}, io_plan=None)
    _equal(got, want)
    sel = decision.bundle
    assert [p.path for p in sel.hashed.pending] == files[-1:] + files[:1] + files[1:-1]  # common, rank, experts
    assert (sel.experts is not None) is (len(names) == 2) and (sel.stage is not None) is (pp[0] > 1)
    _read_once(reads, files)
    assert {file_identity(p)[3] for p in files} <= _stamped(cold)  # stamped as check stamps them
    line = [m for m in marlin_log if "as it was copied" in m]
    assert len(line) == 1 and f"({len(files)} files)" in line[0], marlin_log
    assert (str(cold) in line[0]) is (verify == "auto")  # (full says it hashes at every start instead)
    assert [m for m in marlin_log if "placed" in m and "hashed as it was read (digests compared after" in m]
    _no_copy_threads()


def _flip_a_byte_of_expert_0(model_dir: Path) -> None:
    """One byte of expert 0 in tp1/rank-0's last experts tensor: sizes and headers as they were."""
    path = model_dir / "marlin-pack/tp1/rank-0.safetensors"
    header = read_header(path)
    name, info = max(((n, i) for n, i in header.tensors.items() if ".experts." in n), key=lambda kv: kv[1].start)
    data = bytearray(path.read_bytes())
    data[info.start] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fallback", [False, True])
def test_a_flipped_byte_of_another_gpus_expert_is_refused_after_the_copy_before_serving(
    moe_model: Path, damaged_copy: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, marlin_log: list[str],
    fallback: bool,
) -> None:
    """EP rank 1 of 2 copies experts 2-3 of tp1/rank-0; a byte of expert 0 there is one it only hashes. The decision
    cannot see it (sizes and headers are right); the copy's digest refuses it before any layer is bound: the one-line
    refusal naming the file, or with ``fallback`` the checkpoint loaded the ordinary way into the model vLLM built (the
    placeholders released for the arena get memory again), which then holds what stock vLLM holds. Nothing stamped."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model_dir = damaged_copy(moe_model, _flip_a_byte_of_expert_0)
    files = _moe_files(model_dir, MOE_CASES["share-ep-tp2-rank1"][-1])
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    ordinary: list[Any] = []

    def load_ordinarily(self: Any, model: Any, model_config: Any) -> None:  # as DefaultModelLoader feeds the checkpoint
        ordinary.append(model)
        model.load_weights(vmr.vr._all_tensors(model_dir))

    monkeypatch.setattr(DefaultModelLoader, "load_weights", load_ordinarily)
    args = ("auto_gptq", DTYPE, monkeypatch, 2, 1, 1, 0, EP)
    if not fallback:
        with pytest.raises(LoadRefusedError) as e:
            _load(model_dir, *args, io_plan=None)
        text = str(e.value)
        assert "\n" not in text and "[files]" in text and "tp1/rank-0.safetensors has blake3" in text, text
        assert "the file was modified" in text and "fallback" in text
        assert not ordinary
    else:
        got, _, _ = _load(model_dir, *args, extra={"fallback": True}, io_plan=None)
        assert len(ordinary) == 1
        assert any("loading the checkpoint the ordinary way because fallback is on" in m for m in marlin_log)
        _equal(got, _stock(model_dir, 2, 1, EP))
    _read_once(reads, files)  # refused after the copy read every file, once
    assert not {file_identity(p)[3] for p in files} & _stamped(cold)
    _no_copy_threads()


@pytest.mark.parametrize("case", ["experts-tp2-rank1", "share-ep-tp2-rank1"])
def test_an_experts_file_cut_short_mid_copy_is_refused_cleanly(
    moe_model: Path, damaged_copy: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, case: str,
) -> None:
    """The file holding the experts truncated while the copy reads it: one line naming it, nothing served, no copy or
    hash thread left, nothing stamped."""
    tp, rank, dp, dp_rank, parallel, pp, names = MOE_CASES[case]
    model_dir = damaged_copy(moe_model)
    path = model_dir / f"marlin-pack/{names[-1]}.safetensors"
    cut = truncate_mid_copy(monkeypatch, path)
    with pytest.raises(LoadRefusedError) as e:
        _load(model_dir, "auto_gptq", DTYPE, monkeypatch, tp, rank, dp, dp_rank, parallel, pp=pp, io_plan=None)
    text = str(e.value)
    assert cut.is_set() and "\n" not in text and "[files]" in text and str(path) in text, text
    assert "truncated" in text
    _no_copy_threads()
    assert file_identity(path)[3] not in _stamped(cold)


# --- pipeline stages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("partition", "stage", "daemon"), [(None, 1, False), ("5,0", 1, False), (None, 0, True)],
                         ids=["stage1", "stage-without-layers", "daemon-stage0"])
def test_a_stage_reads_each_bundle_byte_once_and_stamps_it(
    stage_model: Path, damaged_copy: Any, patched: Any, monkeypatch: pytest.MonkeyPatch, cold: Path, marlin_log: list[str],
    partition: str | None, stage: int, daemon: bool,
) -> None:
    """Stage ``stage`` of 2 (TP 1) copies its layers of the rank file and its common tensors; the rest of both files is
    read once too, into their hashes, and both are stamped. A stage without decoder layers copies nothing of the rank
    file and still hashes it (read once, whole). A weight-cache daemon's stage fill likewise."""
    if partition is not None:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    model_dir = damaged_copy(stage_model)
    files = [model_dir / "marlin-pack/tp1/rank-0.safetensors", model_dir / "marlin-pack/common.safetensors"]
    want = sr.stage_params(model_dir, 1, 0, dtype_of("llama"), (2, stage))
    reads = BundleBytes(monkeypatch, model_dir / "marlin-pack")
    got, _, decision = _load_stage(model_dir, "llama", monkeypatch, 2, stage, 1, 0, daemon=daemon)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name
    share = decision.bundle.stage
    assert share is not None and share.rank_bytes < share.rank_file_bytes and share.common_bytes < share.common_file_bytes
    assert (share.rank_bytes == 0) is (partition == "5,0")
    _read_once(reads, files)
    assert {file_identity(p)[3] for p in files} <= _stamped(cold)
    line = [m for m in marlin_log if "as it was copied" in m]
    assert len(line) == 1 and "(2 files)" in line[0], marlin_log
    _no_copy_threads()


# --- marlin-pack check ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["-tp", "2", "-pp", "2", "-ep"], ["-tp", "1", "-dp", "2"], ["-tp", "2", "-dp", "2", "-ep"]])
def test_check_reads_each_file_once_over_stages_and_expert_shares(
    moe_model: Path, damaged_copy: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str],
) -> None:
    """``marlin-pack check`` where no stamp can be kept (a store others may open): every (replica, stage, rank) checks
    its rank file, the file its experts come from and the common file, the command reading each once, and samples the
    source checkpoint."""
    from typer.testing import CliRunner

    from marlin_pack.cli import app

    monkeypatch.setattr(hashing, "RACY_NS", -1)
    shared = tmp_path / "shared-stamps"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # refused as a stamp store: nothing is stamped, every rank would hash again
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(shared))
    model_dir = damaged_copy(moe_model)
    reads = BundleBytes(monkeypatch, model_dir)
    result = CliRunner().invoke(app, ["check", str(model_dir), *args, "--verify", "full"])
    assert result.exit_code == 0, result.output
    bundle = model_dir / "marlin-pack"  # every file is some GPU's: tp1/rank-0 holds its attention or its experts
    files = [bundle / "common.safetensors", *sorted(bundle.glob("tp*/*.safetensors"))]
    sources = sorted(model_dir.glob("*.safetensors"))
    assert len(files) + len(sources) == 5, (files, sources)
    for path in files:
        header = _header_bytes(path)  # read by the checks of each GPU (a few KiB), besides the hash
        assert reads.once_past_the_first_block(path, path.stat().st_size, first=header, most=16), (
            reads.key(path), sorted(reads.ranges[reads.key(path)])[:8])
    for path in sources:  # the checkpoint: its header and samples, by the check of each GPU
        assert reads.only_samples(path, most=16), (reads.key(path), sorted(reads.ranges[reads.key(path)])[:8])
    assert not list(shared.iterdir())
