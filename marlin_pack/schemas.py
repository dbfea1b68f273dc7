"""The bundle manifest: a strict, versioned pydantic schema.

A manifest is untrusted input when read back (by ``verify`` or the vLLM loader):
every path is checked to stay inside the bundle, every size and shape is bounded,
unknown fields are refused. ``marlin-pack schema`` (or ``python -m marlin_pack.schemas``)
prints the JSON schema. Importing this module does not import torch.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from enum import Enum, unique
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from marlin_pack._constants import (
    FORMAT_NAME,
    FORMAT_VERSION,
    KERNEL_NAME,
    LAYOUT_VERSION,
    MACHETE_KERNEL_NAME,
    SUPPORTED_GROUP_SIZES,
)
from marlin_pack.layer_kinds import LayerKind
from marlin_pack.marlin.architectures import architecture_for

if TYPE_CHECKING:
    import torch

__all__ = [
    "SourceFormat",
    "WeightType",
    "ServingDtype",
    "torch_dtype",
    "LayerKind",
    "LayerKernel",
    "FileEntry",
    "SourceFile",
    "AwqSettings",
    "GptqSettings",
    "CompressedTensorsWeights",
    "CompressedTensorsGroup",
    "CompressedTensorsSettings",
    "QuantSettings",
    "SettingsFile",
    "Source",
    "Producer",
    "Target",
    "TARGET_KERNELS",
    "target_kernel",
    "QuantScheme",
    "LayerPart",
    "LayerEntry",
    "MoeLayerEntry",
    "RankEntry",
    "TensorParallelSet",
    "Manifest",
    "manifest_json_schema",
    "weight_file_name_problem",
    "OUTPUT_HEAD_NAMES",
    "output_head_problem",
]

# Matched with fullmatch: "$" alone also matches before a trailing newline.
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Relative POSIX path of plain names: no "..", no absolute paths, no backslashes.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")
_MAX_BYTES = 1 << 46  # 64 TiB: far above any real file, below anything absurd
_MAX_DIM = 1 << 24
# A checkpoint tensor's name, as Hugging Face modules make them (dotted identifiers).
_TENSOR_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*$")
_MAX_TENSOR_NAME = 300
# A tied output head's checkpoint names (InternLM2: output; a multimodal checkpoint of transformers < 4.52:
# language_model.lm_head; GPT-NeoX: embed_out): each architecture's are its Architecture.output_heads (output_head_problem).
OUTPUT_HEAD_NAMES = ("lm_head.weight", "output.weight", "language_model.lm_head.weight", "embed_out.weight")


def output_head_problem(name: str, architecture: str) -> str | None:
    """Why ``name`` cannot be a ``common_aliases`` name of a bundle of ``architecture`` (None: it can).

    An alias is a tied output head stored once, as a copy of the embeddings: exactly a checkpoint name of the
    output head vLLM's class for ``architecture`` loads (``Architecture.output_heads``), never another tensor
    whose name merely ends like one (``model.layers.0.mlp.lm_head.weight``). The one rule of every manifest reader
    (``verify``, ``check``, the loader: :class:`Manifest`) and of the aliases ``convert`` makes.
    """
    arch = architecture_for(architecture)
    heads = arch.output_heads if arch is not None else ()
    if name in heads:
        return None
    known = ", ".join(heads) if heads else "none: marlin-pack knows no output head of it"
    return f"only the output head of {architecture} ({known}) is stored as a copy of another tensor"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@unique
class SourceFormat(str, Enum):
    """On-disk format of the source checkpoint."""

    awq_gemm = "awq-gemm"
    gptq_v1 = "gptq-v1"
    compressed_tensors = "compressed-tensors"  # llm-compressor pack-quantized (WNA16)


@unique
class WeightType(str, Enum):
    """vLLM scalar type of the quantized weights (``vllm.scalar_type`` names)."""

    uint4 = "uint4"  # AWQ: unsigned 4-bit with zero points
    uint4b8 = "uint4b8"  # GPTQ 4-bit symmetric (bias 8)
    uint8b128 = "uint8b128"  # GPTQ / compressed-tensors 8-bit symmetric (bias 128)

    @property
    def bits(self) -> int:
        return 8 if self is WeightType.uint8b128 else 4

    @property
    def has_zero_points(self) -> bool:
        return self is WeightType.uint4


@unique
class ServingDtype(str, Enum):
    """dtype of activations, scales and bias in the engine."""

    float16 = "float16"
    bfloat16 = "bfloat16"


def torch_dtype(dtype: ServingDtype | str) -> torch.dtype:
    """The torch dtype of a serving dtype (``float16`` -> ``torch.float16``).

    Raises:
        ValueError: not a serving dtype.
    """
    import torch

    return getattr(torch, ServingDtype(dtype).value)  # type: ignore[no-any-return]


def _check_path(value: str) -> str:
    if not _SAFE_PATH.fullmatch(value) or len(value) > 255:
        raise ValueError(f"unsafe path {value!r}: expected a relative path of plain names")
    return value


def _check_hex(value: str) -> str:
    if not _HEX64.fullmatch(value):
        raise ValueError(f"expected 64 lowercase hex digits, found {value!r}")
    return value


class FileEntry(_Strict):
    """A file of the bundle, relative to the bundle directory."""

    path: str
    size: int = Field(ge=0, le=_MAX_BYTES)
    blake3: str = Field(description="BLAKE3 of the whole file, hex")

    _p = field_validator("path")(classmethod(lambda cls, v: _check_path(v)))
    _h = field_validator("blake3")(classmethod(lambda cls, v: _check_hex(v)))


def weight_file_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a weight file of a checkpoint (None: it can), as a clause after the name.

    vLLM loads the files ``glob("MODEL_DIR/*.safetensors")`` finds (``DefaultModelLoader``,
    filtered by ``model.safetensors.index.json`` when there is one) through safetensors: any top-level
    name ending in ``.safetensors``, spaces and non-ASCII letters included, except hidden ones (glob
    skips names starting with a dot) and names that are not UTF-8 (safetensors opens UTF-8 paths
    only). marlin-pack records such names in the manifest as they are. It refuses only control
    characters too (a newline or an escape sequence in a name would break its one-line reports).
    """
    if "/" in name or "\0" in name:
        return "is not a plain file name"
    if name.startswith("."):
        return "is hidden (starts with a dot): vLLM does not load it"
    if not name.endswith(".safetensors") or name == ".safetensors":
        return "is not a *.safetensors file"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not UTF-8: safetensors (and so vLLM) cannot open it"
    if len(encoded) > 255:
        return f"is {len(encoded)} bytes long, more than a file name can be (255)"
    if any(unicodedata.category(c) == "Cc" for c in name):
        return "holds control characters (a newline, a tab, an escape): marlin-pack's one-line reports could not show it"
    return None


class SourceFile(_Strict):
    """A ``*.safetensors`` file of the source checkpoint."""

    name: str
    size: int = Field(ge=0, le=_MAX_BYTES)
    blake3: str = Field(description="BLAKE3 of the whole file, hex")
    header_sha256: str
    sample_sha256: str | None = Field(
        default=None,
        description="SHA-256 of samples of every tensor's bytes (marlin_pack.io.sampling), hex; what a start compares "
        "instead of the whole file's BLAKE3. None: a bundle made before samples were recorded (the file is hashed whole)",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        """Any name vLLM loads as a weight file (``weight_file_name_problem``); joined to MODEL_DIR, it stays inside it."""
        why = weight_file_name_problem(v)
        if why is not None:
            raise ValueError(f"source file {v!r} {why}")
        return v

    _h = field_validator("blake3", "header_sha256")(classmethod(lambda cls, v: _check_hex(v)))
    _s = field_validator("sample_sha256")(classmethod(lambda cls, v: v if v is None else _check_hex(v)))


class AwqSettings(_Strict):
    """The AWQ settings a bundle depends on: what marlin-pack's reader and vLLM's
    ``AutoAWQConfig.from_config`` read, as they read them (aliases resolved, defaults applied).

    ``null``: the checkpoint does not set it (the reader then refuses the checkpoint).
    """

    quant_method: Literal["awq"] = "awq"
    bits: int | None = Field(description="w_bit, else bits (vLLM's order)")
    group_size: int | None = Field(description="q_group_size, else group_size (vLLM's order)")
    zero_point: bool | None
    version: str = Field(description="AutoAWQ kernel, lowercase; gemm when absent")
    lm_head: bool
    modules_to_not_convert: list[str]
    dynamic: bool = Field(description="per-module overrides present (GPTQModel's dynamic)")


class GptqSettings(_Strict):
    """The GPTQ settings a bundle depends on: what marlin-pack's reader and vLLM's
    ``AutoGPTQConfig.from_config`` read, as they read them (defaults applied).

    ``null``: the checkpoint does not set it.
    """

    quant_method: Literal["gptq"] = "gptq"
    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    checkpoint_format: str = Field(description="gptq or gptq_v2, lowercase; gptq when absent")
    lm_head: bool
    modules_in_block_to_quantize: list[str] = Field(description="flattened, as vLLM reads it")
    dynamic: dict[str, dict[str, int | float | bool | str | None]] = Field(
        description="GPTQModel's per-module rules, in order: '-:REGEX' leaves matching vLLM layers unquantized, "
        "'+:REGEX' or 'REGEX' overrides settings of matching layers"
    )


class CompressedTensorsWeights(_Strict):
    """One config group's ``weights`` quantization arguments, as compressed-tensors' ``QuantizationArgs``
    reads them (``strategy`` inferred from ``group_size`` when unset, ``actorder`` aliases resolved:
    static -> weight, dynamic/true -> group). ``null``: not set."""

    num_bits: int | None
    type: str | None = Field(description="int or float, lowercase")
    symmetric: bool | None
    strategy: str | None = Field(description="tensor, channel, group, block, ..., lowercase")
    group_size: int | None
    actorder: str | None = Field(description="weight or group; null without activation ordering")
    dynamic: bool = Field(description="dynamic (runtime) weight quantization")


class CompressedTensorsGroup(_Strict):
    """One entry of ``config_groups``: what it targets and how it quantizes weights."""

    targets: list[str]
    format: str | None = Field(description="per-group compression format; null: the config's format")
    weights: CompressedTensorsWeights | None
    input_activations: bool = Field(description="activations are quantized too (not weight-only)")
    output_activations: bool


class CompressedTensorsSettings(_Strict):
    """The compressed-tensors (llm-compressor) settings a bundle depends on: what marlin-pack's
    reader and vLLM's ``CompressedTensorsConfig.from_config`` read. Calibration details,
    observers, versions and the KV-cache scheme are left out.
    """

    quant_method: Literal["compressed-tensors"] = "compressed-tensors"
    format: str | None = Field(description="compression format of the config (pack-quantized for WNA16)")
    config_groups: dict[str, CompressedTensorsGroup] = Field(
        description="groups vLLM reads (groups targeting only an attention module are skipped, as vLLM does)"
    )
    ignore: list[str] = Field(description="modules left unquantized (names or 're:' regexes)")
    sparsity: bool = Field(description="a sparsity_config with targets is present")
    transform: bool = Field(description="a transform_config (rotations) is present")
    lm_head: bool


QuantSettings = Annotated[AwqSettings | GptqSettings | CompressedTensorsSettings, Field(discriminator="quant_method")]
# Where the settings were found: config.json's quantization_config, else (older AutoGPTQ) quantize_config.json.
SettingsFile = Literal["config.json", "quantize_config.json"]


class Source(_Strict):
    """What the bundle was made from.

    Only the quantization settings that decide the bundle are recorded, not the whole
    ``quantization_config``: quantizers also store calibration data, paths, dates and tool
    versions there, which change nothing a bundle holds.
    """

    format: SourceFormat
    architecture: str
    model_type: str
    files: list[SourceFile] = Field(min_length=1)
    quant_settings: QuantSettings
    quant_settings_file: SettingsFile
    digest: str = Field(
        description="sha256 over every file's name and BLAKE3, the quantization settings and the file they came from"
    )

    _h = field_validator("digest")(classmethod(lambda cls, v: _check_hex(v)))


class Producer(_Strict):
    name: Literal["marlin-pack"] = "marlin-pack"
    version: str


# target.kernel: the vLLM linear kernels a bundle's quantized layers are laid out for, "+"-joined in name order
# (target_kernel). A Marlin-only bundle says MarlinLinearKernel, as every bundle did before Machete layers named
# theirs; a bundle written with --kernel machete names Machete, and Marlin too where some layers stay Marlin.
TARGET_KERNELS = (KERNEL_NAME, MACHETE_KERNEL_NAME, f"{MACHETE_KERNEL_NAME}+{KERNEL_NAME}")
TargetKernel = Literal["MarlinLinearKernel", "MacheteLinearKernel", "MacheteLinearKernel+MarlinLinearKernel"]


class Target(_Strict):
    """The engine the layout was computed for."""

    vllm_version: str
    kernel: TargetKernel = KERNEL_NAME  # type: ignore[assignment]
    layout_version: Literal[1] = LAYOUT_VERSION  # type: ignore[assignment]
    # The transformers releases (major.minor range, e.g. "5.16-5.22") whose modeling code vLLM's Transformers backend
    # builds the bundle's layers from, as checked (marlin.transformers_backend); absent: vLLM's own model class only.
    transformers: str | None = Field(default=None, pattern=r"^\d+\.\d+-\d+\.\d+$")
    # The serving paths the bundle is for where fewer than its architecture's (an Olmoe checkpoint whose experts are named
    # w1/w3/w2: only vLLM's Transformers backend loads them, marlin.moe.ExpertNaming.paths); absent: the architecture's.
    paths: tuple[Literal["native", "transformers"], ...] | None = Field(default=None, min_length=1)


class QuantScheme(_Strict):
    weight_type: WeightType
    bits: Literal[4, 8]
    group_size: Literal[SUPPORTED_GROUP_SIZES]  # type: ignore[valid-type]
    zero_points: bool

    @model_validator(mode="after")
    def _consistent(self) -> QuantScheme:
        if self.bits != self.weight_type.bits or self.zero_points != self.weight_type.has_zero_points:
            raise ValueError(
                f"weight_type {self.weight_type.value} does not match bits={self.bits}, "
                f"zero_points={self.zero_points}"
            )
        return self


@unique
class LayerKernel(str, Enum):
    """The kernel (and so the post-processed layout) of one quantized layer: vLLM's per-layer choice."""

    marlin = "marlin"  # MarlinLinearKernel: padded, permuted (marlin_pack.marlin)
    machete = "machete"  # MacheteLinearKernel (SM90 only): prepacked, unpadded (marlin_pack.machete)


def target_kernel(kernels: Iterable[LayerKernel]) -> str:
    """``target.kernel`` of a bundle whose quantized layers are in these layouts (one of :data:`TARGET_KERNELS`)."""
    names = {LayerKernel.marlin: KERNEL_NAME, LayerKernel.machete: MACHETE_KERNEL_NAME}
    return "+".join(sorted({names[k] for k in kernels})) or KERNEL_NAME


class LayerPart(_Strict):
    """One checkpoint module fused into a vLLM layer, e.g. ``k_proj`` in ``qkv_proj``."""

    name: str
    size: int = Field(gt=0, le=_MAX_DIM, description="per-rank output columns of this part")


class LayerEntry(_Strict):
    """Shapes of one quantized vLLM layer on every rank of a TP set (identical across ranks)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$", max_length=300)
    kind: LayerKind
    size_k: int = Field(gt=0, le=_MAX_DIM, description="input features per rank")
    size_n: int = Field(gt=0, le=_MAX_DIM, description="output features per rank")
    padded_k: int = Field(gt=0, le=_MAX_DIM)
    padded_n: int = Field(gt=0, le=_MAX_DIM)
    parts: list[LayerPart] = Field(min_length=1)
    kv_replicas: int = Field(default=1, ge=1, le=1024)
    has_bias: bool
    kernel: LayerKernel = Field(
        default=LayerKernel.marlin, description="the layout this layer's tensors hold (absent: marlin, as before format 5)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> LayerEntry:
        if self.kernel is LayerKernel.machete and (
            (self.padded_k, self.padded_n) != (self.size_k, self.size_n) or self.size_k % 64 or self.size_n % 128
        ):
            raise ValueError(
                f"layer {self.name}: a Machete layer is unpadded with K % 64 == 0 and N % 128 == 0, "
                f"found ({self.size_k}, {self.size_n}) padded to ({self.padded_k}, {self.padded_n})"
            )
        if sum(p.size for p in self.parts) != self.size_n:
            raise ValueError(f"layer {self.name}: parts sum to {sum(p.size for p in self.parts)}, size_n={self.size_n}")
        if self.padded_k < self.size_k or self.padded_n < self.size_n:
            raise ValueError(f"layer {self.name}: padded shape smaller than logical shape")
        if self.padded_k % 16 or self.padded_n % 64:
            raise ValueError(f"layer {self.name}: padded shape ({self.padded_k}, {self.padded_n}) is not Marlin-tiled")
        return self


class MoeLayerEntry(_Strict):
    """One routed-experts layer (vLLM's FusedMoE) on every rank of a TP set, all experts on each rank.

    Its tensors are ``{name}.w13_qweight``, ``w2_qweight``, ``w13_scales``, ``w2_scales``,
    ``w13_qzeros``, ``w2_qzeros``, as vLLM's Marlin MoE path holds them
    (``marlin_pack.marlin.moe``); for compressed-tensors bundles the names of
    ``CompressedTensorsWNA16MoEMethod`` (``marlin.moe.CT_MOE_NAMES``).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.]+$", max_length=300, description="vLLM's experts module")
    num_experts: int = Field(gt=0, le=4096)
    hidden_size: int = Field(gt=0, le=_MAX_DIM)
    intermediate_size: int = Field(gt=0, le=_MAX_DIM, description="per expert, per rank (I / tp)")
    padded_intermediate: int = Field(gt=0, le=_MAX_DIM, description="after Marlin MoE tile padding")

    @model_validator(mode="after")
    def _consistent(self) -> MoeLayerEntry:
        if self.padded_intermediate < self.intermediate_size or self.padded_intermediate % 64 or self.hidden_size % 128:
            raise ValueError(f"experts {self.name}: shapes ({self.hidden_size}, {self.padded_intermediate}) are not Marlin MoE tiles")
        return self


class RankEntry(_Strict):
    rank: int = Field(ge=0, le=1023)
    file: FileEntry


class TensorParallelSet(_Strict):
    """Every rank's file for one tensor-parallel size."""

    tp_size: int = Field(ge=1, le=1024)
    ranks: list[RankEntry]
    layers: list[LayerEntry] = Field(min_length=1)
    moe_layers: list[MoeLayerEntry] = Field(default_factory=list, description="routed-experts layers (format 4)")

    @model_validator(mode="after")
    def _ranks(self) -> TensorParallelSet:
        if [r.rank for r in self.ranks] != list(range(self.tp_size)):
            raise ValueError(f"tp_size {self.tp_size} needs ranks 0..{self.tp_size - 1} in order")
        names = [e.name for e in self.layers] + [e.name for e in self.moe_layers]
        if len(names) != len(set(names)):
            raise ValueError(f"tp_size {self.tp_size}: a layer is listed twice")
        return self


class Manifest(_Strict):
    """The bundle manifest (``manifest.json``).

    Example:
        >>> m = Manifest.model_validate_json(Path("bundle/manifest.json").read_text())
        >>> m.tensor_parallel_set(2).ranks[1].file.path
        'tp2/rank-1.safetensors'
    """

    format: Literal["marlin-pack"] = FORMAT_NAME  # type: ignore[assignment]
    # 3: dense only (still read: it is a format 4 manifest without moe_layers); 4 adds moe_layers.
    # 5 adds layers in Machete's layout (LayerEntry.kernel); written only where a layer has it.
    format_version: Literal[3, 4, 5] = FORMAT_VERSION  # type: ignore[assignment]
    producer: Producer
    target: Target
    quant: QuantScheme
    serving_dtype: ServingDtype
    activation_dtype: ServingDtype
    source: Source
    common: FileEntry = Field(description="non-quantized tensors, unchanged, under checkpoint names")
    common_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="checkpoint tensors stored once: name -> the common tensor with the same bytes "
        "(a tied lm_head saved as a copy of the input embeddings)",
    )
    tensor_parallel: list[TensorParallelSet] = Field(min_length=1)

    @field_validator("common_aliases")
    @classmethod
    def _alias_names(cls, v: dict[str, str]) -> dict[str, str]:
        """Every alias is a tied output head (the only copy ``convert`` stores once) fed as a plain tensor name.

        The loader hands the stored tensor to vLLM under each alias: checked here, where every
        reader of a manifest (``verify``, ``check``, the loader) passes, never on the GPU.
        """
        for alias, stored in v.items():
            for name in (alias, stored):
                if len(name) > _MAX_TENSOR_NAME or not _TENSOR_NAME.fullmatch(name):
                    raise ValueError(f"common_aliases maps {alias!r} to {stored!r}: {name!r} is not a tensor name")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        sizes = [s.tp_size for s in self.tensor_parallel]
        if sizes != sorted(set(sizes)):
            raise ValueError(f"tensor_parallel sizes must be unique and ascending, found {sizes}")
        if self.activation_dtype != self.serving_dtype:
            raise ValueError("activation_dtype must equal serving_dtype (16-bit activations only)")
        if set(self.common_aliases) & set(self.common_aliases.values()):
            raise ValueError("common_aliases must point at stored tensors, not at other aliases")
        self._aliases_outside_quantized_layers()
        for alias, stored in self.common_aliases.items():
            why = output_head_problem(alias, self.source.architecture)
            if why is not None:
                raise ValueError(f"common_aliases maps {alias!r} to {stored!r}: {why}")
        self._same_layers_at_every_tp_size()
        if self.format_version < 4 and any(s.moe_layers for s in self.tensor_parallel):
            raise ValueError("moe_layers need format_version 4")
        if self.format_version < 5 and self.has_machete_layers:
            raise ValueError("layers with kernel machete need format_version 5")
        laid_out = target_kernel(e.kernel for s in self.tensor_parallel for e in s.layers)
        if self.target.kernel not in (laid_out, KERNEL_NAME):  # MarlinLinearKernel: what every bundle said before
            raise ValueError(f"target.kernel is {self.target.kernel}, the layers are laid out for {laid_out}")
        paths = [self.common.path] + [r.file.path for s in self.tensor_parallel for r in s.ranks]
        if len(paths) != len(set(paths)):
            raise ValueError("a file is listed twice")
        return self

    def _same_layers_at_every_tp_size(self) -> None:
        """Every TP size holds the same layers, in the same order: the experts of one size's rank files serve another's
        engine (expert and data parallelism), and ``verify`` compares each size with the one list the checkpoint implies."""
        def listed(s: TensorParallelSet) -> tuple[list[str], list[str]]:
            return ([f"{e.name} ({e.kind.value})" for e in s.layers],
                    [f"{m.name} ({m.num_experts} experts, hidden size {m.hidden_size})" for m in s.moe_layers])

        first = self.tensor_parallel[0]
        want = listed(first)
        for s in self.tensor_parallel[1:]:
            for what, a, b in zip(("layers", "moe_layers"), want, listed(s), strict=True):
                if a != b:
                    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                    raise ValueError(
                        f"tp {s.tp_size} {what}[{i}] is {b[i] if i < len(b) else 'missing'}, tp {first.tp_size} has "
                        f"{a[i] if i < len(a) else 'none'} there; every TP size holds the same layers"
                    )

    def _aliases_outside_quantized_layers(self) -> None:
        """No alias names (or points at) a tensor of a quantized layer: those come from the rank files only."""
        prefixes: set[str] = set()
        for s in self.tensor_parallel:
            for e in s.layers:
                parent = e.name.rpartition(".")[0]
                prefixes.add(f"{e.name}.")
                prefixes.update(f"{parent}.{p.name}." if parent else f"{p.name}." for p in e.parts)  # checkpoint modules
            prefixes.update(f"{m.name}." for m in s.moe_layers)
        for alias, stored in self.common_aliases.items():
            for name in (alias, stored):
                layer = next((p for p in prefixes if name.startswith(p)), None)
                if layer is not None:
                    raise ValueError(
                        f"common_aliases maps {alias!r} to {stored!r}: {name} is a tensor of the quantized layer {layer[:-1]}"
                    )

    @property
    def tp_sizes(self) -> list[int]:
        return [s.tp_size for s in self.tensor_parallel]

    @property
    def has_machete_layers(self) -> bool:
        return any(e.kernel is LayerKernel.machete for s in self.tensor_parallel for e in s.layers)

    def tensor_parallel_set(self, tp_size: int) -> TensorParallelSet:
        """The set for ``tp_size``; raises ``KeyError`` if the bundle has none."""
        for s in self.tensor_parallel:
            if s.tp_size == tp_size:
                return s
        raise KeyError(tp_size)

    def files(self) -> list[FileEntry]:
        """Every file of the bundle, manifest excluded."""
        return [self.common] + [r.file for s in self.tensor_parallel for r in s.ranks]

    def to_json(self) -> str:
        """Deterministic JSON: sorted keys, two-space indent, trailing newline; a layer's ``kernel`` only where it is
        not Marlin (so that Marlin bundles keep the bytes, and the format, they had before Machete layers existed)."""
        data = self.model_dump(mode="json")
        for key in ("transformers", "paths"):  # bundles without them keep their bytes
            if data["target"].get(key) is None:
                data["target"].pop(key, None)
        for s in data["tensor_parallel"]:
            for e in s["layers"]:
                if e.get("kernel") == LayerKernel.marlin.value:
                    del e["kernel"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def manifest_json_schema() -> dict[str, object]:
    """The JSON schema of :class:`Manifest`."""
    return Manifest.model_json_schema()


if __name__ == "__main__":
    print(json.dumps(manifest_json_schema(), indent=2, sort_keys=True))
