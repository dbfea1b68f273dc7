"""Bad input: one clear error naming what was found and what to do; never a half-written bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack import CheckpointError, MarlinPackError, OutputExistsError, UnsupportedCheckpointError, convert
from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint, write_unquantized_checkpoint


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("q_"):
            cfg["quantization_config"][key[2:]] = value
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))


def _no_leftovers(tmp_path: Path, d: Path) -> None:
    assert not (d / "marlin-pack").exists()
    assert not [p for p in d.iterdir() if p.name.startswith(".marlin-pack")]


@pytest.fixture
def awq(make_checkpoint, tmp_path: Path) -> Path:
    return _copy(make_checkpoint("awq"), tmp_path)


def test_missing_config(awq: Path, tmp_path: Path) -> None:
    (awq / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json not found: expected the checkpoint's config.json"):
        convert(awq)
    _no_leftovers(tmp_path, awq)


def test_unreadable_config(awq: Path) -> None:
    (awq / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        convert(awq)


def test_truncated_safetensors(awq: Path, tmp_path: Path) -> None:
    f = awq / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* spans bytes .* truncated or corrupt"):
        convert(awq)
    _no_leftovers(tmp_path, awq)


def test_corrupt_header(awq: Path) -> None:
    f = awq / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\xff\xfe{{{{{{"
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"corrupt safetensors header"):
        convert(awq)


def test_missing_tensor(awq: Path) -> None:
    tensors = load_file(awq / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor model.layers.1.mlp.down_proj.scales is missing"):
        convert(awq)


def test_missing_shard(make_checkpoint, tmp_path: Path) -> None:
    d = _copy(make_checkpoint("awq", sharded=True), tmp_path)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index.json names {shard.name}, which is not in"):
        convert(d)


def test_shape_mismatch(awq: Path) -> None:
    _edit_config(awq, intermediate_size=640)
    with pytest.raises(CheckpointError, match=r"gate_proj.qweight has shape \[256, 64\], expected \[256, 80\] from config.json"):
        convert(awq)


def test_wrong_dtype(awq: Path) -> None:
    tensors = load_file(awq / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.qweight"] = tensors["model.layers.0.self_attn.o_proj.qweight"].to(torch.int64)
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"o_proj.qweight is int64, expected int32"):
        convert(awq)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"q_zero_point": False}, r"AWQ zero_point is False, expected true"),
        ({"q_bits": 8}, r"AWQ bits is 8, expected 4"),
        ({"q_group_size": 16}, r"AWQ group_size is 16, expected one of -1, 32, 64, 128"),
        ({"q_version": "gemv"}, r"AWQ version is 'gemv', expected 'gemm'"),
        ({"q_quant_method": "fp8"}, r"quant_method is 'fp8', expected 'awq' or 'gptq'"),
        ({"num_local_experts": 8}, r"mixture-of-experts model"),
        ({"architectures": ["GPT2LMHeadModel"]}, r"architecture is 'GPT2LMHeadModel', expected one of"),
    ],
)
def test_unsupported_awq_schemes(awq: Path, changes: dict, match: str) -> None:
    _edit_config(awq, **changes)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(awq)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"desc_act": True, "group_size": 128}, r"desc_act is true with group_size 128"),
        ({"sym": False}, r"GPTQ sym is False, expected true"),
        ({"bits": 2}, r"GPTQ bits is 2, expected 4 or 8"),
    ],
)
def test_unsupported_gptq_schemes(tmp_path: Path, kwargs: dict, match: str) -> None:
    d = write_gptq_checkpoint(tmp_path / "g", PRESETS["tiny"], tokenizer=False, **kwargs)
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(d)


def test_gptq_asymmetric_zeros_with_sym_config(tmp_path: Path) -> None:
    d = write_gptq_checkpoint(tmp_path / "g", PRESETS["tiny"], sym=False, tokenizer=False)
    _edit_config(d, q_sym=True)
    with pytest.raises(CheckpointError, match=r"qzeros holds zero points other than 7 although sym is true"):
        convert(d)
    _no_leftovers(tmp_path, d)


def test_moe_expert_tensors(awq: Path) -> None:
    tensors = load_file(awq / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.up_proj.qweight"] = torch.zeros(256, 64, dtype=torch.int32)
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"experts.0.up_proj.qweight is an MoE expert quantized module"):
        convert(awq)


def test_not_quantized(tmp_path: Path) -> None:
    d = write_unquantized_checkpoint(tmp_path / "u", PRESETS["tiny"], tokenizer=False)
    with pytest.raises(UnsupportedCheckpointError, match=r"no quantization_config: the checkpoint is not quantized"):
        convert(d)


def test_group_straddles_tp_shard(awq: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"64 input features per rank at --tp 4 split a quantization group of 128"):
        convert(awq, tp_sizes=(4,))


def test_tp_not_dividing_heads(awq: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match=r"not divisible by tensor-parallel size 3"):
        convert(awq, tp_sizes=(3,))


def test_unwritable_output(awq: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(MarlinPackError, match=r"cannot write to .*file"):
        convert(awq, blocker / "bundle")


def test_existing_output_needs_force(awq: Path) -> None:
    convert(awq)
    first = (awq / "marlin-pack" / "manifest.json").read_bytes()
    with pytest.raises(OutputExistsError, match=r"already exists; pass --force"):
        convert(awq)
    convert(awq, force=True)
    assert (awq / "marlin-pack" / "manifest.json").read_bytes() == first


def test_interrupted_run_leaves_nothing(awq: Path, tmp_path: Path) -> None:
    def interrupt(done: int, total: int, name: str) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(awq, progress=interrupt)
    _no_leftovers(tmp_path, awq)


def test_failed_force_keeps_old_bundle(awq: Path) -> None:
    convert(awq)
    before = (awq / "marlin-pack" / "manifest.json").read_bytes()

    def boom(done: int, total: int, name: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        convert(awq, force=True, progress=boom)
    assert (awq / "marlin-pack" / "manifest.json").read_bytes() == before


def test_force_never_replaces_a_non_bundle(awq: Path, tmp_path: Path) -> None:
    other = tmp_path / "important"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match=r"is not a marlin-pack bundle \(no manifest.json\); refusing to replace it"):
        convert(awq, other, force=True)
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(OutputExistsError, match=r"holds the checkpoint itself"):
        convert(awq, awq, force=True)
    assert (awq / "config.json").exists()


def test_bundle_permissions_follow_umask(awq: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        convert(awq)
    finally:
        os.umask(old)
    assert stat.S_IMODE((awq / "marlin-pack").stat().st_mode) == 0o755


@pytest.mark.parametrize("key,value", [("num_key_value_heads", "2"), ("head_dim", "x")])
def test_non_integer_dimensions(awq: Path, key: str, value: str) -> None:
    _edit_config(awq, **{key: value})
    with pytest.raises(UnsupportedCheckpointError, match=rf"config.json {key} is '{value}', expected a positive integer"):
        convert(awq)


@pytest.mark.parametrize("device", ["foo", "meta"])
def test_unsupported_device(awq: Path, device: str) -> None:
    with pytest.raises(MarlinPackError, match=rf"--device '{device}' is not supported; expected cpu or cuda"):
        convert(awq, device=device)
    _no_leftovers(awq.parent, awq)


def test_deeply_nested_config(awq: Path) -> None:
    (awq / "config.json").write_text("[" * 200_000)
    with pytest.raises(CheckpointError, match=r"nests JSON too deeply"):
        convert(awq)


def test_write_failure_is_one_line_and_leaves_nothing(awq: Path, tmp_path: Path) -> None:
    # A full disk, simulated with a file-size limit: the first write past it fails (EFBIG).
    import subprocess
    import sys

    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000));"
        "from marlin_pack.cli import main; sys.argv=['marlin-pack','convert',sys.argv[1],'-o',sys.argv[2]]; main()"
    )
    out = tmp_path / "out" / "bundle"
    r = subprocess.run([sys.executable, "-c", code, str(awq), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "writing the bundle under" in r.stderr and "failed (File too large)" in r.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []
