"""``marlin.transformers_backend``: the backend's rules over transformers' modules, as the table's rows (pure, no vLLM).

What each row builds is proven against vLLM's real backend in ``test_transformers_backend_exact.py``; here, that the rules
give what those tests found, that the rows reach the converter (dimensions, specs, the manifest's record) and that the
serving path of each release is the release table's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marlin_pack.errors import UnsupportedCheckpointError
from marlin_pack.layer_kinds import LayerKind
from marlin_pack.marlin.architectures import ARCHITECTURES, LLAMA_LINEARS
from marlin_pack.marlin.hf_config import ARCHITECTURE_MODEL_TYPES
from marlin_pack.marlin.sharding import layer_specs, model_dims, rank_slices
from marlin_pack.marlin.transformers_backend import (
    BACKEND_CLASS,
    BACKEND_MODELS,
    BACKEND_MOE_CLASS,
    CHECKED_TRANSFORMERS,
    recorded_transformers,
)
from marlin_pack.vllm_plugin import releases

BACKEND = [a for a, row in ARCHITECTURES.items() if "transformers" in row.paths]


def _layers(arch: str) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(lin.name, lin.kind.value, tuple(p.module for p in lin.parts)) for lin in ARCHITECTURES[arch].linears]


def test_every_backend_model_is_a_row_of_the_table_serving_that_path() -> None:
    assert set(BACKEND) == set(BACKEND_MODELS)
    for name in BACKEND:
        row = ARCHITECTURES[name]
        assert row.vllm_class == (BACKEND_MOE_CLASS if row.moe else BACKEND_CLASS) or "native" in row.paths
        assert name in ARCHITECTURE_MODEL_TYPES  # its config class (marlin.hf_config)


def test_gemma_serves_both_paths_because_the_rules_give_gemma_py_s_layers() -> None:
    """The backend's rules over GemmaMLP / GemmaAttention give what vLLM's gemma.py builds: one row, two paths."""
    gemma = ARCHITECTURES["GemmaForCausalLM"]
    assert gemma.paths == {"native", "transformers"} and gemma.vllm_class == "gemma.GemmaForCausalLM"
    assert gemma.linears == LLAMA_LINEARS
    assert ARCHITECTURES["LlamaForCausalLM"].paths == {"native"}


# QKVFuser + GLUFuser over Llama's module names: (vLLM's layer, its kind, the checkpoint modules it reads)
_LLAMA_LAYERS = [("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("self_attn.o_proj", "row", ("self_attn.o_proj",)),
                 ("mlp.gate_up_proj", "merged-column", ("mlp.gate_proj", "mlp.up_proj")),
                 ("mlp.down_proj", "row", ("mlp.down_proj",))]


@pytest.mark.parametrize("arch,layers", [
    # QKVFuser + GLUFuser: Llama's names
    ("Olmo2ForCausalLM", _LLAMA_LAYERS),
    # a plain MLP: its tp_plan (colwise, rowwise) under its own names
    ("Starcoder2ForCausalLM", [("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                               ("self_attn.o_proj", "row", ("self_attn.o_proj",)),
                               ("mlp.c_fc", "column", ("mlp.c_fc",)), ("mlp.c_proj", "row", ("mlp.c_proj",))]),
    # no registry entry (the registry's fallback): Helium's and Ministral's Llama modules, NanoChat's fc1/fc2 MLP
    ("HeliumForCausalLM", _LLAMA_LAYERS),
    ("MinistralForCausalLM", _LLAMA_LAYERS),
    ("NanoChatForCausalLM", [("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("self_attn.o_proj", "row", ("self_attn.o_proj",)),
                             ("mlp.fc1", "column", ("mlp.fc1",)), ("mlp.fc2", "row", ("mlp.fc2",))]),
    ("PhiForCausalLM", [("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("self_attn.dense", "row", ("self_attn.dense",)),
                        ("mlp.fc1", "column", ("mlp.fc1",)), ("mlp.fc2", "row", ("mlp.fc2",))]),
    # no fuser matches query_key_value (q, k, v interleaved per head): colwise as one column
    ("GPTNeoXForCausalLM", [("attention.query_key_value", "column", ("attention.query_key_value",)),
                            ("attention.dense", "row", ("attention.dense",)),
                            ("mlp.dense_h_to_4h", "column", ("mlp.dense_h_to_4h",)),
                            ("mlp.dense_4h_to_h", "row", ("mlp.dense_4h_to_h",))]),
    # PackedQKVFuser keeps c_attn's name, stored fused; no tp_plan: the MLP replicated
    ("GPTBigCodeForCausalLM", [("attn.c_attn", "qkv", ("attn.c_attn",) * 3), ("attn.c_proj", "row", ("attn.c_proj",)),
                               ("mlp.c_fc", "replicated", ("mlp.c_fc",)), ("mlp.c_proj", "replicated", ("mlp.c_proj",))]),
    # gate_up_proj stored fused and chunked after the GEMM: colwise_gather_output, one column of 2i
    ("GlmForCausalLM", [("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                        ("self_attn.o_proj", "row", ("self_attn.o_proj",)),
                        ("mlp.gate_up_proj", "column", ("mlp.gate_up_proj",)), ("mlp.down_proj", "row", ("mlp.down_proj",))]),
])
def test_the_rules_give_the_layers_vllm_builds(arch: str, layers: list) -> None:
    """As the backend built them in vLLM 0.30.0-0.34.0 (transformers 5.16.1-5.22.2; the exact tests prove the bytes)."""
    assert _layers(arch) == layers


def test_sparse_moe_blocks_keep_the_attention_and_give_the_experts_to_marlin_moe() -> None:
    from marlin_pack.marlin.moe import MOE_ARCHITECTURES

    for name in ("OlmoeForCausalLM", "FlexOlmoForCausalLM", "MellumForCausalLM"):
        assert ARCHITECTURES[name].moe and [lin.name for lin in ARCHITECTURES[name].linears] == [
            "self_attn.qkv_proj", "self_attn.o_proj"]
    for name in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        m = MOE_ARCHITECTURES[name]
        assert (m.vllm_experts, m.num_experts_key, m.intermediate_key) == (
            "mlp.experts.routed_experts", "num_experts", "intermediate_size")
    assert [releases.serving_path(v, "OlmoeForCausalLM") for v in releases.supported()] == ["transformers"] + ["native"] * 4
    # olmoe.py (0.30.0-0.33.0) builds what the backend builds: one bundle serves both (bit-exact on 0.30.0, 0.33.0, 0.34.0)
    assert ARCHITECTURES["OlmoeForCausalLM"].paths == {"native", "transformers"}
    assert ARCHITECTURES["FlexOlmoForCausalLM"].paths == {"transformers"}


@pytest.mark.parametrize("arch,shared,width", [("HunYuanMoEV1ForCausalLM", "mlp.shared_mlp", "intermediate_size"),
                                                ("Kolibri1ForCausalLM", "mlp.shared_experts", "shared_expert_intermediate_size")])
def test_a_shared_expert_beside_the_experts_is_a_glu_of_marlin_linears(arch: str, shared: str, width: str) -> None:
    """GLUFuser over the sparse block's shared expert: gate_up_proj (gate, up) and down_proj, under the block's own name
    (vLLM 0.34's MoE fuser also hands the module to the experts' MoERunner; the bundle names it as vLLM builds it)."""
    from marlin_pack.marlin.moe import MOE_ARCHITECTURES

    assert _layers(arch) == [
        ("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.o_proj", "row", ("self_attn.o_proj",)),
        (f"{shared}.gate_up_proj", "merged-column", (f"{shared}.gate_proj", f"{shared}.up_proj")),
        (f"{shared}.down_proj", "row", (f"{shared}.down_proj",))]
    row = ARCHITECTURES[arch]
    assert row.moe and row.intermediate_key == width and row.vllm_class == BACKEND_MOE_CLASS
    assert MOE_ARCHITECTURES[arch].vllm_experts == "mlp.experts.routed_experts"


def test_mellum_layers_are_sparse_or_dense_as_mlp_layer_types_lists_them() -> None:
    """A dense layer: the attention and a GLU MLP of intermediate_size; a sparse one: the attention and the experts
    (moe_intermediate_size); no list: every layer sparse (MellumConfig's default)."""
    from marlin_pack.marlin.moe import MOE_ARCHITECTURES

    row = ARCHITECTURES["MellumForCausalLM"]
    assert _layers("MellumForCausalLM") == [
        ("self_attn.qkv_proj", "qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.o_proj", "row", ("self_attn.o_proj",))]
    assert row.mlp_layer_types is not None and [lin.name for lin in row.mlp_layer_types.dense] == ["mlp.gate_up_proj", "mlp.down_proj"]
    assert MOE_ARCHITECTURES["MellumForCausalLM"].intermediate_key == "moe_intermediate_size"
    config = _moe_config("MellumForCausalLM")
    d = model_dims(config)
    assert [[s.name for s in layer_specs(d, i)] for i in range(2)] == [
        ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj",
         "model.layers.0.mlp.down_proj"],
        ["model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"]]
    assert d.intermediate_size == 1024 and layer_specs(d, 0)[2].parts[0].size_n == 1024
    assert model_dims({**config, "mlp_layer_types": None}).layer_linears == (row.linears, row.linears)
    for bad in (["dense"], ["dense", "moe"], "sparse"):
        with pytest.raises(UnsupportedCheckpointError, match=r"^config\.json mlp_layer_types is .*, expected a list of "
                           r"\"sparse\" or \"dense\" for each of the 2 decoder layers \(MellumForCausalLM\)"):
            model_dims({**config, "mlp_layer_types": bad})


def test_checkpoint_and_vllm_prefixes() -> None:
    """vLLM's mapper puts the base model under ``model.`` whatever the checkpoint's prefix (GPT-2's transformer., ...)."""
    assert ARCHITECTURES["GPTBigCodeForCausalLM"].checkpoint_layers == ("transformer.h",)
    assert ARCHITECTURES["GPTBigCodeForCausalLM"].layers == "model.h"
    assert ARCHITECTURES["GPTNeoXForCausalLM"].checkpoint_layers == ("gpt_neox.layers",)
    assert ARCHITECTURES["GPTNeoXForCausalLM"].output_heads == ("embed_out.weight",)


def _config(arch: str) -> dict:
    from arch_checkpoints import BACKEND_CONFIGS

    return {**BACKEND_CONFIGS[arch], "architectures": [arch]}


def _moe_config(arch: str) -> dict:
    from moe_checkpoints import MOE_CONFIGS

    return {**MOE_CONFIGS[arch], "architectures": [arch]}


def test_gpt_bigcode_dims_under_gpt2_names_and_multi_query() -> None:
    d = model_dims(_config("GPTBigCodeForCausalLM"), ["transformer.h.0.attn.c_attn.qweight"])
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size, d.num_layers) == (256, 4, 1, 64, 512, 2)
    (qkv, *_rest) = layer_specs(d, 0)
    assert qkv.name == "model.h.0.attn.c_attn" and qkv.kind is LayerKind.qkv
    assert [(p.name, p.prefix, p.offset, p.size_n) for p in qkv.parts] == [
        ("c_attn[q]", "transformer.h.0.attn.c_attn", 0, 256), ("c_attn[k]", "transformer.h.0.attn.c_attn", 256, 64),
        ("c_attn[v]", "transformer.h.0.attn.c_attn", 320, 64)]
    # TP 2: the one KV head replicated on both ranks
    assert [(s.n0, s.n) for s in rank_slices(qkv, d, 2, 1)] == [(128, 128), (0, 64), (0, 64)]
    no_inner = {k: v for k, v in _config("GPTBigCodeForCausalLM").items() if k != "n_inner"}
    assert model_dims(no_inner).intermediate_size == 4 * 256
    with pytest.raises(UnsupportedCheckpointError, match=r"^config\.json multi_query is False, expected True for "
                       r"GPTBigCodeForCausalLM: without it c_attn interleaves q, k and v per head, which no fuser of the backend "
                       r"splits, so vLLM's Transformers backend builds layers marlin-pack does not lay out; serve this model "
                       r"without --load-format marlin_prepacked$"):
        model_dims({**no_inner, "multi_query": False})


def test_gpt_neox_one_column_of_q_k_v() -> None:
    d = model_dims(_config("GPTNeoXForCausalLM"), ["gpt_neox.layers.0.attention.dense.qweight"])
    qkv = layer_specs(d, 0)[0]
    assert qkv.name == "model.layers.0.attention.query_key_value" and qkv.parts[0].size_n == 3 * 256
    assert [(s.n0, s.n) for s in rank_slices(qkv, d, 2, 1)] == [(384, 384)]


def test_a_backend_bundle_records_the_transformers_releases_it_was_checked_against() -> None:
    assert recorded_transformers(ARCHITECTURES["Olmo2ForCausalLM"]) == CHECKED_TRANSFORMERS == "5.16-5.22"
    assert recorded_transformers(ARCHITECTURES["GemmaForCausalLM"]) == CHECKED_TRANSFORMERS
    assert recorded_transformers(ARCHITECTURES["LlamaForCausalLM"]) is None
    checked = CHECKED_TRANSFORMERS.split("-")
    # every release's own transformers is inside the range (its oracles ran with it)
    for entry in releases.RELEASES:
        assert releases.transformers_problem(CHECKED_TRANSFORMERS, entry.transformers) is None, entry.version
    assert checked == ["5.16", "5.22"]


@pytest.mark.parametrize("arch", BACKEND)
def test_each_release_takes_a_path_the_row_serves_or_says_which_do(arch: str) -> None:
    row = ARCHITECTURES[arch]
    served = [v for v in releases.supported() if releases.path_problem(v, arch, row.paths) is None]
    assert "0.34.0" in served  # the newest release serves every row
    for v in releases.supported():
        problem = releases.path_problem(v, arch, row.paths)
        assert (problem is None) == (releases.serving_path(v, arch) in row.paths)
        if problem is not None:
            assert problem.endswith(f"serve it with vLLM {', '.join(served)}") and "\n" not in problem


def test_paths_per_release() -> None:
    """What the registries of 0.30.0-0.34.0 say (tests/vllm_plugin/test_releases.py reads the running one's)."""
    path = releases.serving_path
    assert [path(v, "Olmo2ForCausalLM") for v in releases.supported()] == ["transformers"] * 5
    assert [path(v, "PhiForCausalLM") for v in releases.supported()] == ["transformers"] * 3 + ["native"] * 2
    assert [path(v, "GemmaForCausalLM") for v in releases.supported()] == ["transformers"] + ["native"] * 4
    assert [path(v, "LlamaForCausalLM") for v in releases.supported()] == ["native"] * 5
    assert [path(v, "HunYuanMoEV1ForCausalLM") for v in releases.supported()] == ["transformers"] * 5
    assert [path(v, "MellumForCausalLM") for v in releases.supported()] == ["transformers"] * 3 + ["native"] * 2
    assert [path(v, "Kolibri1ForCausalLM") for v in releases.supported()] == ["transformers"] * 2 + ["unregistered"] * 3
    # listed by no registry, served by its fallback to transformers' class (every release's transformers has them)
    for arch in ("HeliumForCausalLM", "MinistralForCausalLM", "NanoChatForCausalLM"):
        assert [path(v, arch) for v in releases.supported()] == ["transformers"] * 5
        assert all(releases.via_fallback(v, arch) for v in releases.supported())
        assert ARCHITECTURES[arch].paths == {"transformers"} and ARCHITECTURES[arch].vllm_class == BACKEND_CLASS
    assert not any(releases.via_fallback(v, "Olmo2ForCausalLM") for v in releases.supported())
    assert not releases.via_fallback("0.32.0", "Kolibri1ForCausalLM") and not releases.via_fallback("0.29.0", "HeliumForCausalLM")
    assert path("0.29.0", "Olmo2ForCausalLM") is None


def test_a_release_that_does_not_register_an_architecture_says_so_in_one_line() -> None:
    """Kolibri 1 (transformers 5.20+): vLLM 0.33.0 and 0.34.0 list it for the backend, 0.30.0-0.32.0 not at all."""
    paths = ARCHITECTURES["Kolibri1ForCausalLM"].paths
    assert releases.path_problem("0.32.0", "Kolibri1ForCausalLM", paths) == (
        "vLLM 0.32.0 does not serve Kolibri1ForCausalLM: its model registry lists no such architecture; "
        "serve it with vLLM 0.34.0, 0.33.0")
    assert releases.path_problem("0.33.0", "Kolibri1ForCausalLM", paths) is None
    # Mellum: 0.30.0 and 0.31.0 build mellum.py
    assert releases.path_problem("0.31.0", "MellumForCausalLM", ARCHITECTURES["MellumForCausalLM"].paths) == (
        "vLLM 0.31.0 serves MellumForCausalLM with its own model class, whose layers differ from those of vLLM's "
        "Transformers backend the bundle holds; serve it with vLLM 0.34.0, 0.33.0, 0.32.0")


@pytest.mark.parametrize("arch,words", [
    ("AriaForConditionalGeneration", ("a multimodal model vLLM serves through its Transformers backend "
                                     "(TransformersMultiModalMoEForCausalLM)")),
    ("Emu3ForConditionalGeneration", ("a multimodal model vLLM serves through its Transformers backend "
                                     "(TransformersMultiModalForCausalLM)")),
    ("HunYuanVLForConditionalGeneration", "a multimodal model"),
    ("VibeVoiceAsrForConditionalGeneration", "a multimodal model"),
    ("NanbeigeForCausalLM", ("vLLM builds it through its Transformers backend from the modeling code each checkpoint "
                            "ships (config.json auto_map, trust_remote_code); no transformers release has the class")),
    # no registry entry, served by the registry's fallback to transformers' class, whose layers the rules do not give
    ("DogeForCausalLM", ("vLLM's registry lists no such architecture and serves transformers' class through its "
                        "Transformers backend, whose layers for it marlin-pack does not lay out: its attention has a dt_proj")),
    ("YoutuForCausalLM", "vLLM's registry lists no such architecture"),
    ("SolarOpenForCausalLM", "vLLM's registry lists no such architecture"),
    ("MiniMaxM3VLForCausalLM", "vLLM's registry lists no such architecture"),
])
def test_backend_models_marlin_pack_does_not_lay_out_are_refused_in_one_line(arch: str, words: str) -> None:
    """The multimodal backend models and Nanbeige (remote code): one line naming why, not the list of what is supported,
    whatever their config holds (Aria's experts included)."""
    for config in ({"architectures": [arch]}, {"architectures": [arch], "hidden_size": 256, "num_experts": 4,
                                               "text_config": {"moe_num_experts": 4}}):
        with pytest.raises(UnsupportedCheckpointError) as e:
            model_dims(config)
        message = str(e.value)
        assert message.startswith(f"architecture is {arch!r}: {words}") and "\n" not in message
        assert message.endswith("serve it without --load-format marlin_prepacked (vLLM picks its own kernel, if one takes it)")
        assert "expected one of" not in message


def test_convert_refuses_a_multimodal_backend_model_in_one_line(make_checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from marlin_pack import convert

    src = make_checkpoint("gptq", "tiny")
    model = tmp_path / "m"
    model.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    config = {**json.loads((src / "config.json").read_text()), "architectures": ["Emu3ForConditionalGeneration"],
              "model_type": "emu3"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match=r"^architecture is 'Emu3ForConditionalGeneration': a multimodal "
                       r"model vLLM serves through its Transformers backend \(TransformersMultiModalForCausalLM\); "
                       r"marlin-pack does not lay out its layers; serve it without --load-format marlin_prepacked"):
        convert(model)
    assert not (model / "marlin-pack").exists()


def test_a_bundle_manifest_carries_the_record(tmp_path: Path) -> None:
    """convert writes target.transformers for a backend architecture, and nothing for vLLM's own classes (their
    manifests keep their bytes)."""
    import torch
    from arch_checkpoints import write_arch_checkpoint

    from marlin_pack import convert

    model = write_arch_checkpoint(tmp_path / "olmo2", "Olmo2ForCausalLM", "gptq", group_size=32, dtype=torch.bfloat16)
    manifest = convert(model, tp=(1,)).manifest
    assert manifest.target.transformers == CHECKED_TRANSFORMERS
    assert json.loads((model / "marlin-pack" / "manifest.json").read_text())["target"]["transformers"] == "5.16-5.22"
    llama = write_arch_checkpoint(tmp_path / "granite", "GraniteForCausalLM", "gptq", group_size=32, dtype=torch.bfloat16)
    convert(llama, tp=(1,))
    assert "transformers" not in json.loads((llama / "marlin-pack" / "manifest.json").read_text())["target"]


def test_olmoe_experts_named_w1_w3_w2_convert_for_the_backend_only(tmp_path: Path) -> None:
    """vLLM 0.34.0's backend maps Olmoe's experts named mlp.experts.N.{w1,w3,w2} (TransformersRoutedExperts), olmoe.py
    (0.30.0-0.33.0) does not: such a checkpoint converts, its bundle recording the backend as its only path; the usual
    names record nothing (the row's two paths)."""
    from moe_checkpoints import write_moe_checkpoint
    from safetensors.torch import load_file, save_file

    from marlin_pack import convert
    from marlin_pack.marlin.moe import MOE_ARCHITECTURES

    assert [n.paths for n in MOE_ARCHITECTURES["OlmoeForCausalLM"].namings] == [None, frozenset({"transformers"})]
    assert MOE_ARCHITECTURES["OlmoeForCausalLM"].refused == ()
    model = write_moe_checkpoint(tmp_path / "m", "OlmoeForCausalLM", "gptq", group_size=32)
    assert convert(model, tp=(1,)).manifest.target.paths is None
    for path in model.glob("*.safetensors"):
        renamed = {}
        for k, v in load_file(path).items():
            for old, new in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")):
                k = k.replace(old, new) if ".experts." in k else k
            renamed[k] = v
        save_file(renamed, str(path), metadata={"format": "pt"})
    manifest = convert(model, tp=(1,), force=True).manifest
    assert manifest.target.paths == ("transformers",) and manifest.target.transformers == CHECKED_TRANSFORMERS
    assert json.loads((model / "marlin-pack" / "manifest.json").read_text())["target"]["paths"] == ["transformers"]
