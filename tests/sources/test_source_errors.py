"""A checkpoint marlin-pack cannot read or vLLM would not serve: one clear error, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from marlin_pack import CheckpointError, UnsupportedCheckpointError, convert
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.testing.synthetic import PRESETS, write_gptq_checkpoint, write_unquantized_checkpoint


@pytest.fixture
def awq(awq_copy: Path) -> Path:
    return awq_copy


def test_missing_config(awq: Path, tmp_path: Path, no_leftovers) -> None:
    (awq / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json not found: expected the checkpoint's config.json"):
        convert(awq)
    no_leftovers(awq)


def test_unreadable_config(awq: Path) -> None:
    (awq / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        convert(awq)


def test_truncated_safetensors(awq: Path, tmp_path: Path, no_leftovers) -> None:
    f = awq / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* spans bytes .* truncated or corrupt"):
        convert(awq)
    no_leftovers(awq)


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


def test_missing_shard(make_checkpoint, damaged_copy) -> None:
    d = damaged_copy(make_checkpoint("awq", sharded=True))
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index.json names {shard.name}, which is not in"):
        convert(d)


def test_shape_mismatch(awq: Path, edit_config) -> None:
    edit_config(awq, intermediate_size=640)
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
        ({"q_quant_method": "fp8"}, r"quant_method is 'fp8', expected 'awq', 'gptq' or 'compressed-tensors'"),
        ({"num_local_experts": 8}, r"mixture-of-experts model"),
        ({"architectures": ["GPT2LMHeadModel"]}, r"architecture is 'GPT2LMHeadModel', expected one of"),
    ],
)
def test_unsupported_awq_schemes(awq: Path, changes: dict, match: str, edit_config) -> None:
    edit_config(awq, **changes)
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


def test_gptq_asymmetric_zeros_with_sym_config(tmp_path: Path, edit_config, no_leftovers) -> None:
    d = write_gptq_checkpoint(tmp_path / "g", PRESETS["tiny"], sym=False, tokenizer=False)
    edit_config(d, q_sym=True)
    with pytest.raises(CheckpointError, match=r"qzeros holds zero points other than 7 although sym is true"):
        convert(d)
    no_leftovers(d)


def test_moe_expert_tensors(awq: Path) -> None:
    tensors = load_file(awq / "model.safetensors")
    tensors["model.layers.0.mlp.experts.0.up_proj.qweight"] = torch.zeros(256, 64, dtype=torch.int32)
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(UnsupportedCheckpointError, match=r"experts.0.up_proj.qweight is an MoE expert quantized module"):
        convert(awq)


def test_not_quantized(tmp_path: Path) -> None:
    d = write_unquantized_checkpoint(tmp_path / "u", PRESETS["tiny"], tokenizer=False)
    msg = r"no quantization_config \(and there is no quantize_config.json\): the checkpoint is not quantized"
    with pytest.raises(UnsupportedCheckpointError, match=msg):
        convert(d)


@pytest.mark.parametrize("key,value", [("num_key_value_heads", "2"), ("head_dim", "x")])
def test_non_integer_dimensions(awq: Path, key: str, value: str, edit_config) -> None:
    edit_config(awq, **{key: value})
    with pytest.raises(UnsupportedCheckpointError, match=rf"config.json {key} is '{value}', expected a positive integer"):
        convert(awq)


def test_deeply_nested_config(awq: Path) -> None:
    (awq / "config.json").write_text("[" * 200_000)
    with pytest.raises(CheckpointError, match=r"nests JSON too deeply"):
        convert(awq)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_fifo_instead_of_a_file_is_refused_without_blocking(awq: Path, name: str) -> None:
    import os

    (awq / name).unlink()
    os.mkfifo(awq / name)
    with pytest.raises(CheckpointError, match=r"is a FIFO, not a regular file"):
        convert(awq)


def test_device_file_instead_of_config_is_refused(awq: Path) -> None:
    (awq / "config.json").unlink()
    (awq / "config.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"is a character device, not a regular file"):
        convert(awq)


def test_absurd_layer_count_is_refused_at_once(awq: Path, edit_config) -> None:
    edit_config(awq, num_hidden_layers=10**9)
    with pytest.raises(UnsupportedCheckpointError, match=r"num_hidden_layers is 1000000000, expected at most"):
        convert(awq)
    edit_config(awq, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"num_hidden_layers is 3, the checkpoint holds decoder layers 0..1; .*layer 2 is missing"):
        convert(awq)


def test_module_with_no_tensors_is_refused(awq: Path, no_leftovers) -> None:
    tensors = load_file(awq / "model.safetensors")
    for suffix in ("qweight", "qzeros", "scales"):
        del tensors[f"model.layers.1.self_attn.o_proj.{suffix}"]
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"module model.layers.1.self_attn.o_proj has no weights .*neither qweight nor weight"):
        convert(awq)
    no_leftovers(awq)


def test_missing_decoder_layer_is_refused(awq: Path) -> None:
    tensors = {k: v for k, v in load_file(awq / "model.safetensors").items() if not k.startswith("model.layers.1.")}
    save_file(tensors, awq / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layer 1 is missing"):
        convert(awq)


def test_non_utf8_path_says_so(awq: Path, tmp_path: Path) -> None:
    import os

    odd = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9"))
    awq.rename(odd)
    with pytest.raises(CheckpointError, match=r"is not a UTF-8 path .*rename the directory"):
        convert(odd)


def test_unusual_dtypes_travel_in_common(awq: Path) -> None:
    tensors = load_file(awq / "model.safetensors")
    tensors["model.extra_u16"] = torch.arange(4, dtype=torch.int32).to(torch.uint16)
    save_file(tensors, awq / "model.safetensors")
    convert(awq)
    assert torch.equal(load_file(awq / "marlin-pack" / "common.safetensors")["model.extra_u16"], tensors["model.extra_u16"])


def test_config_that_is_not_utf8_says_so(awq: Path) -> None:
    (awq / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(CheckpointError, match=r"config.json is not UTF-8 text .*restore the file"):
        convert(awq)


def test_source_changed_while_converting_is_refused(awq: Path, no_leftovers) -> None:
    # Hashes are taken while the tensors are read: a file rewritten meanwhile must not be stamped as hashed.
    shard = awq / "model.safetensors"

    def rewrite(done: int, total: int, name: str) -> None:
        if done == 1:
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            tmp = awq / "partial"
            tmp.write_bytes(bytes(data))
            tmp.replace(shard)  # what a download tool does

    with pytest.raises(CheckpointError, match=r"model.safetensors changed while converting"):
        convert(awq, progress=rewrite)
    no_leftovers(awq)


def test_shard_that_is_a_device_is_refused_as_such(awq: Path) -> None:
    (awq / "model.safetensors").unlink()
    (awq / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"model.safetensors is a character device, not a regular file; expected a safetensors"):
        convert(awq)


@pytest.mark.parametrize("value", [0, -1, True, "32000"])
def test_bad_vocab_size_is_refused(awq: Path, value: object, edit_config, no_leftovers) -> None:
    edit_config(awq, vocab_size=value)
    with pytest.raises(UnsupportedCheckpointError, match=rf"config.json vocab_size is {value!r}, expected a positive integer"):
        convert(awq)
    no_leftovers(awq)


@pytest.mark.parametrize("name", ["model 1.safetensors", "modèle.safetensors", "模型 (v2).safetensors"])
def test_weight_file_names_vllm_loads_are_converted(awq: Path, name: str) -> None:
    (awq / "model.safetensors").rename(awq / name)
    m = convert(awq).manifest
    assert [f.name for f in m.source.files] == [name]
    assert read_manifest(awq / "marlin-pack").source.files[0].name == name


def test_hidden_weight_file_is_not_part_of_the_checkpoint(awq: Path) -> None:
    """vLLM's glob skips names starting with a dot; so does marlin-pack."""
    save_file({"x": torch.zeros(2)}, str(awq / ".partial.safetensors"))
    assert [f.name for f in convert(awq).manifest.source.files] == ["model.safetensors"]


@pytest.mark.parametrize(
    "name,match",
    [("a\tb.safetensors", r"weight file 'a\\tb.safetensors', which holds control characters"),
     ("a\x1b[31mb.safetensors", r"holds control characters")],
)
def test_weight_file_names_marlin_pack_cannot_record_are_refused(awq: Path, name: str, match: str, no_leftovers) -> None:
    (awq / "model.safetensors").rename(awq / name)
    with pytest.raises(CheckpointError, match=match):
        convert(awq)
    no_leftovers(awq)


def test_index_naming_an_odd_weight_file_is_refused(make_checkpoint, damaged_copy) -> None:
    import json

    d = damaged_copy(make_checkpoint("awq", sharded=True))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (f"sub/{first}" if v == first else v) for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index.json names weight file 'sub/{first}', which is not a plain file name"):
        convert(d)
