"""vLLM's Transformers backend, as rules over data: which quantized layers it builds for an architecture.

vLLM serves some architectures through its Transformers backend (``vllm/model_executor/models/transformers/``; its
registry's ``_TRANSFORMERS_SUPPORTED_MODELS``, and any architecture the registry does not list whose transformers class
is backend-compatible: Helium, Ministral, NanoChat, the release table's ``backend_fallback``): it builds transformers'
own model class on the meta device, then replaces modules (``Base.recursive_replace``). What it makes of a decoder
layer's linears follows fixed rules, the same in every vLLM release marlin-pack serves (``fusers/qkv.py``,
``packed_qkv.py``, ``glu.py``, ``merged_column.py`` and ``utils.replace_linear_class`` are identical from 0.30.0 to
0.34.0), applied to the transformers modeling code:

* **QKV** (``QKVFuser``): three sibling linears of the attention module reading its input become one
  ``QKVParallelLinear`` named ``qkv_proj``, parts in the order q, k, v (q the widest), heads of the module's
  ``head_dim``; the module's output linear becomes ``RowParallelLinear``, under its own name.
* **Packed QKV** (``PackedQKVFuser``): one linear whose output is split ``(q, kv, kv)`` (GPTBigCode's ``c_attn``)
  becomes a ``QKVParallelLinear`` under its own name, loaded from the checkpoint's fused module.
* **GLU** (``GLUFuser``): ``act(gate(x)) * up(x)`` becomes one ``MergedColumnParallelLinear`` named ``gate_up_proj``
  (gate, then up); the down projection ``RowParallelLinear``.
* Every other linear takes its style from transformers' ``base_model_tp_plan``: ``colwise`` and
  ``colwise_gather_output`` ``ColumnParallelLinear``, ``rowwise`` and ``rowwise_split_input`` ``RowParallelLinear``
  (the weights are split the same way: gathering and splitting act on activations), anything else, or no plan,
  ``ReplicatedLinear``.
* **MoE** (``TransformersMoEForCausalLM``'s ``MoEMixin``): a sparse block's experts become one ``FusedMoE``
  (``mlp.experts.routed_experts``, :mod:`marlin_pack.marlin.moe`); its router stays unquantized; a shared expert beside
  them is a GLU as above under its own name (vLLM 0.34's ``MoEBlockFuser`` also hands that module to the experts'
  runner, so the module tree reaches it twice: the layer's ``prefix`` is the name it is built and loaded under).

Module names are transformers' under ``model.`` (vLLM's mapper replaces the checkpoint's base-model prefix,
``transformer.`` or ``gpt_neox.``, with ``model.``). Which modules a layer has, and how its forward combines them,
is transformers' modeling code: :data:`BACKEND_MODELS` holds that, per architecture, as read from the transformers
releases vLLM's supported releases install (:data:`CHECKED_TRANSFORMERS`); the rules turn it into the table's rows
(:func:`rows`, merged into :data:`marlin_pack.marlin.architectures.ARCHITECTURES`). Each row is tested bit-exact
against vLLM's real backend classes (``tests/marlin/test_transformers_backend_exact.py``) on every release.

Which release serves an architecture through the backend is the release table's (``vllm_plugin/releases.py``,
``transformers_backend``); a bundle records the transformers releases its backend layout was checked against
(``target.transformers``) and the loader refuses another (``releases.transformers_problem``).

This module imports neither vLLM nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from marlin_pack.layer_kinds import LayerKind
from marlin_pack.marlin.architecture_types import Architecture, Linear, MlpLayerTypes, Part

__all__ = [
    "CHECKED_TRANSFORMERS",
    "BACKEND_CLASS",
    "BACKEND_MOE_CLASS",
    "HfAttention",
    "HfMlp",
    "BackendModel",
    "BACKEND_MODELS",
    "backend_linears",
    "rows",
    "recorded_transformers",
    "config_problem",
]

# The transformers releases (major.minor, inclusive) whose modeling code the rows below were read from and tested
# against: what vLLM 0.30.0 (5.16) to 0.34.0 (5.22) install. A bundle records this range; the loader refuses a
# backend layout under a transformers outside it (the modules it traces could be others).
CHECKED_TRANSFORMERS = "5.16-5.22"

BACKEND_CLASS = "transformers.TransformersForCausalLM"
BACKEND_MOE_CLASS = "transformers.TransformersMoEForCausalLM"

TpStyle = Literal["colwise", "rowwise", "replicate"]


@dataclass(frozen=True)
class HfAttention:
    """transformers' attention module of a decoder layer: its linears, as its forward uses them."""

    module: str  # e.g. "self_attn"
    out: str  # the output projection (the module returns it): RowParallelLinear
    qkv: tuple[str, str, str] | None = None  # separate q, k, v projections of the module's input (QKVFuser)
    packed: str | None = None  # one projection split (q, kv, kv) (PackedQKVFuser)
    column: str | None = None  # one projection no fuser matches (GPT-NeoX's interleaved query_key_value): tp_plan


@dataclass(frozen=True)
class HfMlp:
    """transformers' MLP of a decoder layer."""

    module: str  # e.g. "mlp"
    down: str
    gate: str | None = None  # set: act(gate(x)) * up(x) (GLUFuser)
    up: str | None = None  # the input projection (the GLU's up, or a plain MLP's only one)
    up_size: str = "i"  # size symbol of a plain input projection (Glm's stored fused gate_up_proj: 2i)
    style: TpStyle = "colwise"  # tp_plan style of a plain MLP's input projection
    down_style: TpStyle = "rowwise"


@dataclass(frozen=True)
class BackendModel:
    """One architecture as transformers models it, in the terms the backend's rules read."""

    name: str  # config.json architectures[0]
    attention: HfAttention
    mlp: HfMlp | None  # None: a sparse MoE block (MoEMixin: its experts one FusedMoE, marlin.moe.MOE_ARCHITECTURES)
    layers: str = "model.layers"  # vLLM's prefix of decoder layer i
    checkpoint_layers: tuple[str, ...] = ("model.layers",)
    output_head: str = "lm_head.weight"
    # config key -> (the value the modeling code must see for these rules to hold, what the module does otherwise)
    requires: tuple[tuple[str, object, str], ...] = ()
    # config keys the modeling code reads as they are, null included (what it then does): a config without them builds
    # no model, in transformers or in vLLM's backend (Ministral's head_dim)
    needs_set: tuple[tuple[str, str], ...] = ()
    # A sparse block's shared expert: a GLU MLP beside the experts (GLUFuser: gate_up_proj, down_proj). From vLLM 0.34
    # the MoE fuser runs it inside the experts' MoERunner, which holds it too; it is built and loaded under its own name.
    shared: HfMlp | None = None
    # Sparse blocks in some decoder layers only: (the config key listing each layer's "sparse" or "dense", the dense
    # layers' MLP), as Mellum's mlp_layer_types.
    dense_layers: tuple[str, HfMlp] | None = None
    # The config key of the "i" size symbol (a dense MLP's or the shared expert's width)
    intermediate_key: str = "intermediate_size"


def _qkv_linear(name: str, q: str, k: str, v: str) -> Linear:
    return Linear(name, LayerKind.qkv, "h", (Part("q", "q", q), Part("k", "kv", k), Part("v", "kv", v)))


def _one(name: str, kind: LayerKind, input_size: str, size: str) -> Linear:
    return Linear(name, kind, input_size, (Part("out", size, name),))


_STYLE_KINDS = {"colwise": LayerKind.column, "rowwise": LayerKind.row, "replicate": LayerKind.replicated}


def _mlp_linears(p: HfMlp) -> list[Linear]:
    if p.gate is not None:  # GLUFuser: self.gate_up_proj (gate, up); down rowwise
        gate, up = f"{p.module}.{p.gate}", f"{p.module}.{p.up}"
        return [Linear(f"{p.module}.gate_up_proj", LayerKind.merged_column, "h", (Part("gate", "i", gate), Part("up", "i", up))),
                _one(f"{p.module}.{p.down}", LayerKind.row, "i", "h")]
    return [_one(f"{p.module}.{p.up}", _STYLE_KINDS[p.style], "h", p.up_size),
            _one(f"{p.module}.{p.down}", _STYLE_KINDS[p.down_style], "i", "h")]


def backend_linears(m: BackendModel) -> tuple[Linear, ...]:
    """The quantized linears the backend builds for one decoder layer of ``m`` (a sparse one, where its layers differ),
    in the order it registers them (attention, then MLP; within each, the fused layer first: the fusers add it, then
    replace the output projection; a sparse block's shared expert after its experts)."""
    a, p = m.attention, m.mlp
    attn: list[Linear] = []
    if a.qkv is not None:  # QKVFuser: self.qkv_proj, q/k/v deleted
        q, k, v = (f"{a.module}.{n}" for n in a.qkv)
        attn.append(_qkv_linear(f"{a.module}.qkv_proj", q, k, v))
    elif a.packed is not None:  # PackedQKVFuser: the module keeps its name, the checkpoint stores it fused
        name = f"{a.module}.{a.packed}"
        attn.append(_qkv_linear(name, name, name, name))
    elif a.column is not None:
        attn.append(_one(f"{a.module}.{a.column}", LayerKind.column, "h", "qkv"))
    attn.append(_one(f"{a.module}.{a.out}", LayerKind.row, "q", "h"))
    if p is None:  # the experts are a FusedMoE layer, the router unquantized; a shared expert an ordinary MLP
        return (*attn, *(_mlp_linears(m.shared) if m.shared is not None else ()))
    return (*attn, *_mlp_linears(p))


_INTERLEAVED_C_ATTN = "c_attn interleaves q, k and v per head, which no fuser of the backend splits"
_LLAMA_ATTENTION = HfAttention("self_attn", "o_proj", qkv=("q_proj", "k_proj", "v_proj"))


def _glu(module: str) -> HfMlp:
    """Llama's GLU MLP (gate_proj, up_proj, down_proj) under ``module``."""
    return HfMlp(module, "down_proj", gate="gate_proj", up="up_proj")


_GLU = _glu("mlp")


def _llama_like(name: str) -> BackendModel:
    return BackendModel(name, _LLAMA_ATTENTION, _GLU)


# transformers' modeling code of each architecture, as the backend's rules read it (transformers 5.16 to 5.22).
BACKEND_MODELS: dict[str, BackendModel] = {
    m.name: m
    for m in (
        *(_llama_like(n) for n in (
            "OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM", "GemmaForCausalLM",
            "StableLmForCausalLM", "SeedOssForCausalLM", "HunYuanDenseV1ForCausalLM", "VaultGemmaForCausalLM",
            "CwmForCausalLM",
            # no registry entry at all: vLLM serves it through the backend because transformers has the class
            # (releases.py's backend_fallback)
            "HeliumForCausalLM",
        )),
        # as Helium, served by the registry's fallback; MinistralAttention takes config.head_dim as is (its class default
        # null, no hidden_size / num_attention_heads in its place)
        BackendModel("MinistralForCausalLM", _LLAMA_ATTENTION, _GLU,
                     needs_set=(("head_dim", "MinistralAttention computes with it as is (None ** -0.5 raises)"),)),
        # plain MLPs: c_fc / fc1 / up_proj colwise, c_proj / fc2 / down_proj rowwise (their base_model_tp_plan)
        BackendModel("Starcoder2ForCausalLM", _LLAMA_ATTENTION, HfMlp("mlp", "c_proj", up="c_fc")),
        BackendModel("PhiForCausalLM", HfAttention("self_attn", "dense", qkv=("q_proj", "k_proj", "v_proj")),
                     HfMlp("mlp", "fc2", up="fc1")),
        BackendModel("ArceeForCausalLM", _LLAMA_ATTENTION, HfMlp("mlp", "down_proj", up="up_proj")),
        # NanoChat (no registry entry, served as Helium and Ministral): relu2(fc1(x)) then fc2, no gate
        BackendModel("NanoChatForCausalLM", _LLAMA_ATTENTION, HfMlp("mlp", "fc2", up="fc1")),
        BackendModel("Jais2ForCausalLM", _LLAMA_ATTENTION, HfMlp("mlp", "down_proj", up="up_proj")),
        # Glm stores gate_up_proj fused and chunks it after the GEMM: no GLU match; tp_plan colwise_gather_output
        BackendModel("GlmForCausalLM", _LLAMA_ATTENTION, HfMlp("mlp", "down_proj", up="gate_up_proj", up_size="2i")),
        # GPT-NeoX: query_key_value interleaves q, k, v per head (a view, no split): no fuser, tp_plan colwise
        BackendModel("GPTNeoXForCausalLM", HfAttention("attention", "dense", column="query_key_value"),
                     HfMlp("mlp", "dense_4h_to_h", up="dense_h_to_4h"),
                     checkpoint_layers=("gpt_neox.layers",), output_head="embed_out.weight"),
        # GPTBigCode (multi_query): c_attn split (h, kv, kv); no tp_plan, so the MLP is replicated on every rank
        BackendModel("GPTBigCodeForCausalLM", HfAttention("attn", "c_proj", packed="c_attn"),
                     HfMlp("mlp", "c_proj", up="c_fc", style="replicate", down_style="replicate"),
                     layers="model.h", checkpoint_layers=("transformer.h",),
                     requires=(("multi_query", True, _INTERLEAVED_C_ATTN),)),
        # sparse MoE blocks (MoEMixin): the experts mlp.experts.N.{gate,up,down}_proj as one FusedMoE,
        # mlp.experts.routed_experts (marlin.moe.MOE_ARCHITECTURES); Llama's attention
        BackendModel("OlmoeForCausalLM", _LLAMA_ATTENTION, None),
        BackendModel("FlexOlmoForCausalLM", _LLAMA_ATTENTION, None),
        # a shared expert beside the experts: HunYuan's mlp.shared_mlp (intermediate_size, as its experts), Kolibri 1's
        # mlp.shared_experts (shared_expert_intermediate_size); the routers (HunYuan's mlp.gate.wg, an nn.Linear) stay
        # unquantized
        BackendModel("HunYuanMoEV1ForCausalLM", _LLAMA_ATTENTION, None, shared=_glu("mlp.shared_mlp")),
        BackendModel("Kolibri1ForCausalLM", _LLAMA_ATTENTION, None, shared=_glu("mlp.shared_experts"),
                     intermediate_key="shared_expert_intermediate_size"),
        # Mellum: mlp_layer_types makes a layer sparse (experts) or dense (a GLU MLP of intermediate_size)
        BackendModel("MellumForCausalLM", _LLAMA_ATTENTION, None, dense_layers=("mlp_layer_types", _GLU)),
    )
}


def config_problem(architecture: str, config: Mapping[str, Any]) -> str | None:
    """Why the backend's rules do not give ``architecture``'s row for this ``config`` (its config class's view, with
    defaults), in one line; None: they do."""
    m = BACKEND_MODELS.get(architecture)
    for key, null in m.needs_set if m is not None else ():
        if config.get(key) is None:
            return (f"config.json {key} is null or absent, expected a positive integer for {architecture}: transformers' "
                    f"{null}, so neither transformers nor vLLM's Transformers backend builds this model; set {key} in "
                    f"config.json (usually hidden_size / num_attention_heads)")
    for key, want, otherwise in m.requires if m is not None else ():
        if config.get(key, want) != want:
            return (f"config.json {key} is {config.get(key)!r}, expected {want!r} for {architecture}: without it {otherwise}, so "
                    f"vLLM's Transformers backend builds layers marlin-pack does not lay out; serve this model without "
                    f"--load-format marlin_prepacked")
    return None


def rows() -> dict[str, Architecture]:
    """The architecture table's rows of every architecture in :data:`BACKEND_MODELS` (the backend's layout)."""
    return {
        m.name: Architecture(m.name, BACKEND_CLASS if m.mlp is not None else BACKEND_MOE_CLASS, backend_linears(m),
                             layers=m.layers, checkpoint_layers=m.checkpoint_layers, output_head=m.output_head,
                             moe=m.mlp is None, intermediate_key=m.intermediate_key,
                             mlp_layer_types=None if m.dense_layers is None else MlpLayerTypes(
                                 m.dense_layers[0], tuple(_mlp_linears(m.dense_layers[1]))),
                             paths=frozenset({"transformers"}))
        for m in BACKEND_MODELS.values()
    }


def recorded_transformers(arch: Architecture) -> str | None:
    """What a bundle of ``arch`` records as ``target.transformers``: the transformers releases its Transformers-backend
    layout was checked against, where a release serves it through the backend (None: vLLM's own class only)."""
    return CHECKED_TRANSFORMERS if "transformers" in arch.paths else None
