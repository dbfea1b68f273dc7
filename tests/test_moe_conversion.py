"""``convert`` of mixture-of-experts checkpoints: whole bundles bit-exact against vLLM 0.33.0, verify, refusals, CLI.

Every rank file of a converted tiny Mixtral / Qwen3-MoE / Qwen2-MoE checkpoint holds exactly what
vLLM's own model class holds after ``process_weights_after_loading`` (``vllm_moe_reference``: dense
Marlin linears and the Marlin MoE experts), nothing missing and nothing extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from marlin_pack import convert, verify
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.cli import app
from marlin_pack.errors import UnsupportedCheckpointError

pytest.importorskip("vllm")
from moe_checkpoints import write_moe_checkpoint  # noqa: E402
from oracles.vllm_moe_reference import VllmRefusedError, assert_moe_bundle_equals_vllm, reference_moe_rank_tensors  # noqa: E402

CASES = [
    ("MixtralForCausalLM", "awq", 4, torch.bfloat16, (1, 2, 4)),
    ("MixtralForCausalLM", "gptq", 4, torch.float16, (1, 2, 4)),
    ("Qwen3MoeForCausalLM", "awq", 4, torch.float16, (1, 2, 4)),
    ("Qwen3MoeForCausalLM", "gptq", 4, torch.bfloat16, (1, 2, 4)),
    ("Qwen3MoeForCausalLM", "gptq", 8, torch.float16, (1, 2)),
    ("Qwen2MoeForCausalLM", "awq", 4, torch.bfloat16, (1, 2)),
    ("Qwen2MoeForCausalLM", "gptq", 4, torch.float16, (1, 2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,bits,dtype,tps", CASES, ids=[f"{a[:7]}-{f}{b}-{str(d)[6:]}" for a, f, b, d, _ in CASES])
def test_moe_bundle_bit_exact(tmp_path: Path, arch: str, fmt: str, bits: int, dtype: torch.dtype, tps: tuple[int, ...]) -> None:
    model = write_moe_checkpoint(tmp_path / "m", arch, fmt, bits=bits, dtype=dtype)
    manifest = convert(model, tp=tps).manifest
    assert manifest.serving_dtype.value == str(dtype).removeprefix("torch.")
    n = assert_moe_bundle_equals_vllm(model, model / "marlin-pack", tps, dtype)
    assert n >= sum(tps) * 2 * 6  # every rank, 2 decoder layers, 6 expert tensors each (plus the dense layers)
    for s in manifest.tensor_parallel:
        assert [e.name.split(".")[2] for e in s.moe_layers] == ["0", "1"]
        assert all(e.name.endswith(".experts.routed_experts") for e in s.moe_layers)
    assert verify(model / "marlin-pack").ok


def test_moe_sharded_checkpoint_with_padding(tmp_path: Path) -> None:
    """A two-file checkpoint; 96 intermediate features per rank at TP 2, padded to 128 (group 32)."""
    model = write_moe_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM", "gptq", group_size=32, moe_intermediate_size=192,
                                 sharded=True)
    assert len(list(model.glob("*.safetensors"))) == 2
    manifest = convert(model, tp=(1, 2)).manifest
    entry = manifest.tensor_parallel_set(2).moe_layers[0]
    assert (entry.intermediate_size, entry.padded_intermediate) == (96, 128)
    assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.float16)
    assert verify(model / "marlin-pack").ok


def test_verify_finds_a_changed_expert(tmp_path: Path) -> None:
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq")
    convert(model, tp=(2,))
    bundle = model / "marlin-pack"
    # Re-write rank 1 with one scale changed, and the manifest's hash updated: only the rebuild can tell.
    path = bundle / "tp2" / "rank-1.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.block_sparse_moe.experts.routed_experts.w2_scales"
    tensors[name][3, 0, 5] += 1
    report = verify(bundle, integrity_only=True)
    assert report.ok
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta)
    from marlin_pack.io.hashing import file_digest

    m = json.loads((bundle / "manifest.json").read_text())
    m["tensor_parallel"][0]["ranks"][1]["file"].update(size=path.stat().st_size, blake3=file_digest(path, 1))
    (bundle / "manifest.json").write_text(json.dumps(m))
    report = verify(bundle)
    assert not report.ok
    failure = report.first_failure
    assert failure is not None and failure.name == "round-trip" and name in failure.detail and "tp 2 rank 1" in failure.detail


@pytest.mark.parametrize("fmt,qc,config,match", [
    ("gptq", {"desc_act": True, "group_size": -1}, {}, r"GPTQ desc_act is true; marlin-pack converts act-order-free GPTQ experts"),
    ("gptq", {"checkpoint_format": "gptq_v2"}, {}, r"checkpoint_format is 'gptq_v2'; marlin-pack converts gptq \(v1\) experts"),
    ("gptq", {"sym": False}, {}, r"GPTQ sym is False, expected true"),
    ("gptq", {}, {"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] mix dense and sparse decoder layers"),
    ("gptq", {}, {"decoder_sparse_step": 2}, r"decoder_sparse_step 2"),
    ("awq", {}, {"architectures": ["PhimoeForCausalLM"]},
     (r"^PhimoeForCausalLM is a mixture-of-experts model marlin-pack does not convert; its mixture-of-experts architectures are "
      r"MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, DeepseekV2ForCausalLM, "
      r"DeepseekV3ForCausalLM, FlexOlmoForCausalLM, HunYuanMoEV1ForCausalLM, Kolibri1ForCausalLM, MellumForCausalLM$")),
])
def test_unsupported_moe_input_refused_before_writing(tmp_path: Path, fmt: str, qc: dict, config: dict, match: str) -> None:
    model = write_moe_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM", fmt)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(qc)
    cfg.update(config)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=match):
        convert(model)
    assert not (model / "marlin-pack").exists()
    assert not [p for p in model.iterdir() if p.name.startswith(".marlin-pack")]


def test_quantized_router_refused(tmp_path: Path) -> None:
    """vLLM builds the router unquantized: a checkpoint that quantized it cannot be served either."""
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "gptq")
    t = load_file(model / "model.safetensors")
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        src = t[f"model.layers.0.block_sparse_moe.experts.0.w1.{leaf}"]
        t[f"model.layers.0.block_sparse_moe.gate.{leaf}"] = (src[:, :8] if src.dim() == 2 else src).clone()
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpointError, match=r"block_sparse_moe\.gate\.qweight is an unsupported quantized module"):
        convert(model)


def test_missing_expert_refused(tmp_path: Path) -> None:
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq")
    t = load_file(model / "model.safetensors")
    del t["model.layers.1.block_sparse_moe.experts.3.w2.scales"]
    save_file(t, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.scales"):
        convert(model)
    assert not (model / "marlin-pack").exists()


def test_cli_convert_inspect_verify_moe(tmp_path: Path) -> None:
    runner = CliRunner()
    model = write_moe_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM", "gptq")
    r = runner.invoke(app, ["convert", str(model), "--tp", "1,2", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["manifest"]["format_version"] == 4
    assert [len(s["moe_layers"]) for s in data["manifest"]["tensor_parallel"]] == [2, 2]
    r = runner.invoke(app, ["inspect", str(model / "marlin-pack")])
    assert r.exit_code == 0 and "2 Marlin MoE layers x 4 experts" in r.stdout, r.stdout
    r = runner.invoke(app, ["verify", str(model / "marlin-pack"), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True, r.output


def test_cli_unsupported_moe_one_line_exit_1(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "gptq")
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    cfg["quantization_config"]["group_size"] = -1
    (model / "config.json").write_text(json.dumps(cfg))
    code = "from marlin_pack.cli import main; import sys; sys.argv = ['marlin-pack', *sys.argv[1:]]; main()"
    r = subprocess.run([sys.executable, "-c", code, "convert", str(model)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: MixtralForCausalLM: GPTQ desc_act is true"), r.stderr
    assert not (model / "marlin-pack").exists()


def test_format_3_bundles_still_read(tmp_path: Path) -> None:
    """A dense bundle of format 3 (before moe_layers) is a format 4 manifest without experts: still read."""
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq")
    convert(model)
    bundle = model / "marlin-pack"
    m = json.loads((bundle / "manifest.json").read_text())
    m["format_version"] = 3
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Exception, match="moe_layers need format_version 4"):
        read_manifest(bundle)
    for s in m["tensor_parallel"]:
        s.pop("moe_layers")
    (bundle / "manifest.json").write_text(json.dumps(m))
    assert read_manifest(bundle).format_version == 3


def _rename(model: Path, old: str, new: str) -> None:
    """Rename every tensor whose name contains ``old`` (as another quantizer names the same modules)."""
    path = model / "model.safetensors"
    tensors = load_file(path)
    save_file({k.replace(old, new): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def test_mixtral_gate_up_down_proj_naming_bit_exact(tmp_path: Path) -> None:
    """block_sparse_moe.experts.N.{gate,up,down}_proj (llm-compressor's naming): vLLM's MixtralModel.hf_to_vllm_mapper
    renames them to w1/w3/w2, so vLLM serves them; so does marlin-pack, bit-exact."""
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "gptq")
    for old, new in ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
        _rename(model, old, new)
    convert(model, tp=(1, 2))
    assert assert_moe_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.float16) >= 3 * 2 * 6
    assert verify(model / "marlin-pack").ok


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_qwen_w1_w2_w3_naming_refused(tmp_path: Path, arch: str) -> None:
    """vLLM's Qwen MoE classes map experts.N.{gate,up,down}_proj only: RoutedExperts.load_weights matches w1/w3/w2 to no
    entry and skips them without an error, leaving the experts uninitialised (nothing correct to match); refused, named."""
    model = write_moe_checkpoint(tmp_path / "m", arch, "gptq")
    path = model / "model.safetensors"
    tensors = load_file(path)  # only the experts' projections (Qwen2-MoE's shared expert keeps gate_proj ...)
    renamed = {}
    for k, v in tensors.items():
        if ".experts." in k:
            for old, new in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
                k = k.replace(old, new)
        renamed[k] = v
    save_file(renamed, str(path), metadata={"format": "pt"})
    names = load_file(model / "model.safetensors")
    assert "model.layers.0.mlp.experts.0.w1.qweight" in names
    with pytest.raises(UnsupportedCheckpointError, match=r"stores its experts as mlp\.experts\.N\.\{w1,w3,w2\}.*gate_proj"):
        convert(model, tp=(1,))


def test_mixtral_mlp_naming_refused_naming_why(tmp_path: Path) -> None:
    """transformers 5's mlp.experts.N.{gate,up,down}_proj with the router at mlp.gate (GPTQModel 7's Mixtral)."""
    model = write_moe_checkpoint(tmp_path / "m", "MixtralForCausalLM", "awq")
    for old, new in ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")):
        _rename(model, old, new)
    with pytest.raises(VllmRefusedError):
        reference_moe_rank_tensors(model, 1, 0, torch.float16)
    with pytest.raises(UnsupportedCheckpointError, match="block_sparse_moe") as e:
        convert(model, tp=(1,))
    assert "incomplete" not in str(e.value)


def test_fused_expert_gate_up_refused(tmp_path: Path) -> None:
    """Per-expert fused gate_up_proj: vLLM's RoutedExperts splits it as an unquantized [2I, H] weight; refused, named."""
    model = write_moe_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM", "gptq")
    path = model / "model.safetensors"
    tensors = load_file(path)
    out = {k: v for k, v in tensors.items() if ".gate_proj." not in k and ".up_proj." not in k or ".experts." not in k}
    for k, v in tensors.items():
        if ".experts." in k and ".gate_proj." in k:
            up = tensors[k.replace(".gate_proj.", ".up_proj.")]
            out[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([v, up], -1) if v.dim() == 2 else v
    save_file(out, str(path), metadata={"format": "pt"})
    with pytest.raises(UnsupportedCheckpointError, match="fused expert tensors"):
        convert(model, tp=(1,))
