"""The synthetic checkpoint writer, checked from first principles (not through the converter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from marlin_pack.testing.synthetic import (
    PRESETS,
    ModelShape,
    write_awq_checkpoint,
    write_gptq_checkpoint,
    write_tokenizer,
    write_unquantized_checkpoint,
)

# What vLLM's auto_awq.py applies to unpacked nibbles to restore column order.
REVERSE_AWQ_PACK_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> codes [..., W, 32/bits], slot i = bits [i*b, (i+1)*b)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _dequant_awq(t: dict[str, torch.Tensor], p: str, g: int) -> torch.Tensor:
    k = t[f"{p}.qweight"].shape[0]
    codes = _unpack(t[f"{p}.qweight"], 4)[..., REVERSE_AWQ_PACK_ORDER].reshape(k, -1)
    zeros = _unpack(t[f"{p}.qzeros"], 4)[..., REVERSE_AWQ_PACK_ORDER].reshape(-1, codes.shape[1])
    grp = torch.arange(k) // (k if g == -1 else g)
    return ((codes - zeros[grp]) * t[f"{p}.scales"].float()[grp]).T  # HF weight [N, K]


def _dequant_gptq(t: dict[str, torch.Tensor], p: str, bits: int) -> torch.Tensor:
    qw = t[f"{p}.qweight"]
    codes = _unpack(qw.T, bits).reshape(qw.shape[1], -1).T  # [K, N]: row r*P+i from slot i of row r
    zeros = _unpack(t[f"{p}.qzeros"], bits).reshape(-1, codes.shape[1]) + 1  # v1 stores zero-1
    gi = t[f"{p}.g_idx"].long()
    return ((codes - zeros[gi]) * t[f"{p}.scales"].float()[gi]).T


def test_awq_names_shapes_config(tmp_path: Path) -> None:
    shape = PRESETS["tiny-qwen2"]
    d = write_awq_checkpoint(tmp_path, shape, group_size=64)
    t = _tensors(d)
    h, i, kv = 256, 512, 2 * 64
    dims = dict(zip(LINEARS, [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)], strict=True))
    for layer in range(2):
        for lin, (k, n) in dims.items():
            p = f"model.layers.{layer}.{lin}"
            assert t[f"{p}.qweight"].dtype == torch.int32 and t[f"{p}.qweight"].shape == (k, n // 8)
            assert t[f"{p}.qzeros"].dtype == torch.int32 and t[f"{p}.qzeros"].shape == (k // 64, n // 8)
            assert t[f"{p}.scales"].dtype == torch.float16 and t[f"{p}.scales"].shape == (k // 64, n)
            assert (f"{p}.bias" in t) == (lin in LINEARS[:3])  # qwen2: q/k/v biases only
            assert f"{p}.g_idx" not in t
            s = t[f"{p}.scales"]
            assert s.min() >= 0.5e-3 * 0.99 and s.max() <= 3e-3 * 1.01
    assert t["model.embed_tokens.weight"].shape == (512, h) and "lm_head.weight" in t
    # every nibble value, and every AWQ slot, is used: the words are really random
    assert _unpack(t["model.layers.0.mlp.up_proj.qweight"], 4).unique().numel() == 16
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["torch_dtype"] == "float16"
    assert cfg["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None}


@pytest.mark.parametrize(("bits", "fmt", "word"), [
    (4, "gptq", 0x77777777), (8, "gptq", 0x7F7F7F7F), (4, "gptq_v2", 0x88888888 - 2**32)])
def test_gptq_sym_zeros_and_g_idx(tmp_path: Path, bits: int, fmt: str, word: int) -> None:
    d = write_gptq_checkpoint(tmp_path, PRESETS["tiny"], bits=bits, group_size=32, checkpoint_format=fmt)
    t = _tensors(d)
    pack = 32 // bits
    for lin, k, n in [("self_attn.q_proj", 256, 256), ("mlp.down_proj", 512, 256)]:
        p = f"model.layers.1.{lin}"
        assert t[f"{p}.qweight"].shape == (k // pack, n) and t[f"{p}.qweight"].dtype == torch.int32
        assert t[f"{p}.qzeros"].shape == (k // 32, n // pack)
        assert (t[f"{p}.qzeros"] == word).all()
        assert torch.equal(t[f"{p}.g_idx"], torch.arange(k, dtype=torch.int32) // 32)
    qc = json.loads((d / "quantize_config.json").read_text())
    assert json.loads((d / "config.json").read_text())["quantization_config"] == qc
    assert qc["bits"] == bits and qc["sym"] is True and qc["checkpoint_format"] == fmt


def test_gptq_g_idx_variants(tmp_path: Path) -> None:
    t = _tensors(write_gptq_checkpoint(tmp_path / "a", PRESETS["tiny"], group_size=-1, tokenizer=False))
    assert t["model.layers.0.mlp.down_proj.scales"].shape == (1, 256)
    assert (t["model.layers.0.mlp.down_proj.g_idx"] == 0).all()
    t = _tensors(write_gptq_checkpoint(tmp_path / "b", PRESETS["tiny"], group_size=64, desc_act=True,
                                       sym=False, tokenizer=False))
    g_idx = t["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx, torch.arange(512, dtype=torch.int32) // 64)
    assert torch.equal(g_idx.sort().values, torch.arange(512, dtype=torch.int32) // 64)
    assert t["model.layers.0.mlp.down_proj.qzeros"].unique().numel() > 1  # random, asymmetric


def test_sharded_index_and_same_tensors(tmp_path: Path) -> None:
    shape, limit = PRESETS["tiny-qwen3"], 150_000
    seen: list[tuple[int, int]] = []
    sharded = write_gptq_checkpoint(tmp_path / "s", shape, group_size=64, max_shard_bytes=limit,
                                    tokenizer=False, progress=lambda a, b: seen.append((a, b)))
    single = write_gptq_checkpoint(tmp_path / "one", shape, group_size=64, tokenizer=False)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (single / "model.safetensors.index.json").exists()
    t_sharded, t_single = _tensors(sharded), _tensors(single)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t_sharded.values())
    assert set(index["weight_map"]) == set(t_sharded) == set(t_single)
    for f in files:
        with safe_open(f, "pt") as sf:
            assert sf.metadata() == {"format": "pt"}
            assert all(index["weight_map"][k] == f.name for k in sf.keys())  # noqa: SIM118 (safe_open is no dict)
    for f in files:
        sizes = [v.numel() * v.element_size() for v in load_file(f).values()]
        assert sum(sizes) <= limit or len(sizes) == 1
    assert all(torch.equal(t_sharded[k], t_single[k]) for k in t_single)
    assert "model.layers.1.self_attn.q_norm.weight" in t_single
    assert seen[-1][0] == seen[-1][1] == index["metadata"]["total_size"]
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))


def test_deterministic_and_safetensors_identical(tmp_path: Path) -> None:
    a = write_awq_checkpoint(tmp_path / "a", PRESETS["tiny-padded"], group_size=32, dtype=torch.bfloat16,
                             max_shard_bytes=300_000)
    b = write_awq_checkpoint(tmp_path / "b", PRESETS["tiny-padded"], group_size=32, dtype=torch.bfloat16,
                             max_shard_bytes=300_000)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    # byte-for-byte what safetensors' own writer produces for the same tensors
    for f in a.glob("*.safetensors"):
        assert save(load_file(f), metadata={"format": "pt"}) == f.read_bytes()
    c = write_awq_checkpoint(tmp_path / "c", PRESETS["tiny-padded"], group_size=32, seed=1, tokenizer=False)
    assert not torch.equal(_tensors(a)["lm_head.weight"].half(), _tensors(c)["lm_head.weight"])
    assert _tensors(a)["model.norm.weight"].dtype == torch.bfloat16


def test_meta_device_writes_headers_only(tmp_path: Path) -> None:
    """``device="meta"``: the same files, headers and sizes as a real write, every value zero (a hole)."""
    kw = dict(group_size=64, max_shard_bytes=150_000, tokenizer=False)
    real = write_gptq_checkpoint(tmp_path / "real", PRESETS["tiny-qwen3"], **kw)
    meta = write_gptq_checkpoint(tmp_path / "meta", PRESETS["tiny-qwen3"], device="meta", **kw)
    names = sorted(p.name for p in real.iterdir())
    assert names == sorted(p.name for p in meta.iterdir())
    for f in sorted(meta.glob("*.safetensors")):
        header = 8 + int.from_bytes(f.read_bytes()[:8], "little")
        assert f.read_bytes()[:header] == (real / f.name).read_bytes()[:header]
        assert f.stat().st_size == (real / f.name).stat().st_size
        assert all(not t.any() for t in load_file(f).values())
    assert (meta / "config.json").read_text() == (real / "config.json").read_text()


def test_tied_mistral_without_lm_head(tmp_path: Path) -> None:
    shape = ModelShape(model_type="mistral", tie_word_embeddings=True, num_hidden_layers=1)
    d = write_gptq_checkpoint(tmp_path, shape, bits=8, group_size=-1, tokenizer=False)
    t = _tensors(d)
    assert "lm_head.weight" not in t and "model.layers.1.mlp.up_proj.qweight" not in t
    assert (t["model.layers.0.mlp.up_proj.qzeros"] == 0x7F7F7F7F).all()
    assert t["model.layers.0.mlp.up_proj.qweight"].shape == (256 // 4, 512)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert not (d / "tokenizer.json").exists()


def test_rewrite_replaces_stale_shards(tmp_path: Path) -> None:
    write_awq_checkpoint(tmp_path, PRESETS["tiny"], max_shard_bytes=100_000, tokenizer=False)
    write_awq_checkpoint(tmp_path, PRESETS["tiny"], tokenizer=False)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"group_size=128 does not divide .* \[320, 480\]"):
        write_awq_checkpoint(tmp_path, PRESETS["tiny-padded"], group_size=128)
    with pytest.raises(ValueError, match="Unsupported GPTQ bits=3"):
        write_gptq_checkpoint(tmp_path, PRESETS["tiny"], bits=3)
    with pytest.raises(ValueError, match="Unknown model_type 'gpt2'"):
        write_awq_checkpoint(tmp_path, ModelShape(model_type="gpt2"))
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        write_tokenizer(tmp_path, 100)


def test_tokenizer_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tokenizer(tmp_path, 600)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 600 and (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in ["Hello, my name is", "  spaces\tand\nnewlines ~!@#", "naïve café ✓"]:
        ids = tok(text).input_ids
        assert ids[0] == 1 and max(ids) < 600
        assert tok.decode(ids, skip_special_tokens=True) == text
    tok.decode(list(range(600)))  # every id, fillers included, decodes


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("fmt", ["awq", "gptq", "none"])
def test_transformers_loads_and_forward_is_finite_in_fp16(tmp_path: Path, preset: str, fmt: str) -> None:
    """Names match transformers' exactly (strict load) and the dequantized model stays finite in fp16."""
    transformers = pytest.importorskip("transformers")
    shape = PRESETS[preset]
    if fmt == "awq":
        d = write_awq_checkpoint(tmp_path, shape, group_size=64, tokenizer=False)
    elif fmt == "gptq":
        d = write_gptq_checkpoint(tmp_path, shape, group_size=64, tokenizer=False)
    else:
        d = write_unquantized_checkpoint(tmp_path, shape, tokenizer=False)
    t = _tensors(d)
    for p in {k.rsplit(".", 1)[0] for k in t if k.endswith(".qweight")}:
        w = _dequant_awq(t, p, 64) if fmt == "awq" else _dequant_gptq(t, p, 4)
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{p}.{suffix}", None)
        t[f"{p}.weight"] = w.half()
    config = transformers.AutoConfig.from_pretrained(d)
    config.quantization_config = None
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    model.load_state_dict({k: v.half() for k, v in t.items()}, strict=True)
    ids = torch.randint(3, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert all(h.isfinite().all() and h.abs().max() < 1e3 for h in out.hidden_states)
    assert out.logits.isfinite().all() and out.logits.float().std() > 1e-3


_PEAK_SCRIPT = """
import resource, sys, torch
from marlin_pack.testing.synthetic import ModelShape, write_gptq_checkpoint
shape = ModelShape(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=4096)
write_gptq_checkpoint(sys.argv[1] + "/warm", ModelShape(), tokenizer=False)  # load lazy code paths first
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_gptq_checkpoint(sys.argv[1] + "/big", shape, max_shard_bytes=8 << 20, tokenizer=False)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_peak_memory_is_bounded_by_a_shard(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[1])
    growth = int(res.stdout.split()[-1])
    total = sum(f.stat().st_size for f in (tmp_path / "big").glob("*.safetensors"))
    assert total > 150 << 20  # ~170 MB written ...
    assert growth < 32 << 20, f"peak RSS grew by {growth >> 20} MiB while writing {total >> 20} MiB"
