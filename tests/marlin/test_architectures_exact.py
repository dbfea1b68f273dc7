"""Every architecture of the table converts bit-exactly to what vLLM's own model class holds.

Checkpoints come from ``arch_checkpoints`` (transformers' model class for the unquantized parts,
AWQ/GPTQ tensors for the decoder's linears); the reference instantiates vLLM's registered model
class for the checkpoint (``vllm_reference``), loads every tensor through its ``load_weights``
and runs its post-processing on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from marlin_pack import convert, verify
from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.marlin.architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES, UNSUPPORTED_ARCHITECTURES

pytest.importorskip("vllm")
from arch_checkpoints import ARCH_CONFIGS, write_arch_checkpoint  # noqa: E402
from oracles.oracle_compare import assert_bundle_equals_vllm  # noqa: E402

# vLLM refuses float16 for these (ModelConfig: "does not support float16").
BF16_ONLY = {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"}
FORMATS = {"awq": dict(fmt="awq"), "gptq4": dict(fmt="gptq", bits=4), "gptq8": dict(fmt="gptq", bits=8)}


def test_every_table_row_has_a_checkpoint_writer() -> None:
    from moe_checkpoints import MOE_CONFIGS  # the MoE rows: tests/test_moe_conversion.py

    assert set(ARCH_CONFIGS) | {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} \
        | set(MOE_CONFIGS) == set(SUPPORTED_ARCHITECTURES)


def _cases() -> list:
    cases = []
    for i, arch in enumerate(a for a in ARCH_CONFIGS if "native" in ARCHITECTURES[a].paths):  # the backend's: its own file
        for dtype in (torch.float16, torch.bfloat16):
            if dtype == torch.float16 and arch in BF16_ONLY:
                continue
            fmt = list(FORMATS)[(i + (dtype == torch.bfloat16)) % 3]  # every arch meets two formats
            cases.append(pytest.param(arch, fmt, dtype, id=f"{arch}-{fmt}-{str(dtype)[6:]}"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("arch,fmt,dtype", _cases())
def test_architecture_bit_exact_tp_1_2_4(tmp_path: Path, arch: str, fmt: str, dtype: torch.dtype) -> None:
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    if releases.serving_path(vllm_version(), arch) != "native":  # tests/marlin/test_transformers_backend_exact.py
        pytest.skip(f"vLLM {vllm_version()} serves {arch} through its Transformers backend")
    # 4 heads, 2 KV heads: TP 4 replicates KV heads; group 32 keeps whole groups per rank.
    model = write_arch_checkpoint(tmp_path / "model", arch, group_size=32, dtype=dtype, **FORMATS[fmt])
    convert(model, tp=(1, 2, 4), dtype=str(dtype).removeprefix("torch."))
    seen: list[str] = []
    n = assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2, 4), dtype, model_class=seen)
    assert n >= 7 * 2 * 4 * 2  # every rank, 4 layers x 2 decoder layers, 2+ tensors each
    assert set(seen) == {ARCHITECTURES[arch].vllm_class.split(".")[1]}  # vLLM's own class for it
    assert verify(model / "marlin-pack").ok


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a, row in ARCHITECTURES.items() if row.multimodal])
def test_multimodal_text_layers_quantized_vision_in_common(tmp_path: Path, arch: str) -> None:
    """Both checkpoint namings (transformers 4.52 to 4.57, and older or 5) give vLLM's names; the vision
    tower and projector are common tensors, under the checkpoint's names (vLLM's load_weights maps them)."""
    for names in ("v4.52", "legacy"):
        model = write_arch_checkpoint(tmp_path / names, arch, "gptq", dtype=torch.bfloat16, names=names)
        with safe_open(str(model / "model.safetensors"), "pt") as f:
            assert any(n.startswith("model.language_model.layers.") for n in f.keys()) == (names == "v4.52")  # noqa: SIM118
        manifest = convert(model, tp=(1, 2)).manifest
        assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.bfloat16)
        assert all(e.name.startswith("language_model.model.layers.") for e in manifest.tensor_parallel[0].layers)
        with safe_open(str(model / "marlin-pack" / "common.safetensors"), "pt") as f:
            common = set(f.keys())
        assert any("visual" in n or "vision_tower" in n for n in common)
        assert not any(n.endswith((".qweight", ".scales", ".qzeros")) for n in common)


@pytest.mark.parametrize("arch", ["Qwen2VLForConditionalGeneration", "Mistral3ForConditionalGeneration"])
def test_multimodal_language_model_under_model(tmp_path: Path, arch: str) -> None:
    """vLLM's mapper of Qwen2-VL and Mistral 3 maps ``model.`` to ``language_model.model.``:
    decoder layers at ``model.layers`` load there, and convert bit-exactly."""
    model = write_arch_checkpoint(tmp_path / "m", arch, "gptq", dtype=torch.bfloat16, names="model")
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert any(n.startswith("model.layers.0.") for n in f.keys())  # noqa: SIM118
    manifest = convert(model, tp=(1, 2)).manifest
    assert_bundle_equals_vllm(model, model / "marlin-pack", (1, 2), torch.bfloat16)
    assert all(e.name.startswith("language_model.model.layers.") for e in manifest.tensor_parallel[0].layers)


def test_gemma3_multimodal_refuses_model_layers_as_vllm_does(tmp_path: Path) -> None:
    """Gemma 3's mapper has no ``model.`` rule: vLLM refuses ``model.layers``, and so does convert, saying why."""
    from oracles.vllm_reference import VllmRefusedError, reference_rank_tensors

    arch = "Gemma3ForConditionalGeneration"
    model = write_arch_checkpoint(tmp_path / "m", arch, "gptq", dtype=torch.bfloat16, names="model")
    with pytest.raises(VllmRefusedError, match="no module or parameter named 'model'"):
        reference_rank_tensors(model, 1, 0, torch.bfloat16)
    with pytest.raises(UnsupportedCheckpointError, match=r"decoder layers are under model\.layers, .*Gemma3ForConditionalGeneration"
                       r".* only from model\.language_model\.layers or language_model\.model\.layers"):
        convert(model)


@pytest.mark.parametrize("arch", ["FalconForCausalLM", "MptForCausalLM"])
def test_unsupported_architecture_lists_the_supported(make_checkpoint, tmp_path: Path, arch: str) -> None:
    src = make_checkpoint("gptq", "tiny")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = [arch]
    model = tmp_path / "m"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="expected one of .*Gemma2ForCausalLM.*Phi3ForCausalLM") as e:
        convert(model)
    if arch in UNSUPPORTED_ARCHITECTURES:
        assert "Transformers backend" in str(e.value)


def test_gemma_defaults_to_bfloat16(tmp_path: Path) -> None:
    """vLLM's --dtype auto never picks float16 for Gemma 2/3: neither does convert."""
    model = write_arch_checkpoint(tmp_path / "g", "Gemma2ForCausalLM", "awq", dtype=torch.float16)
    assert convert(model).manifest.serving_dtype.value == "bfloat16"
