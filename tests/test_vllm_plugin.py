"""CPU tests of the vLLM plugin: registration, options, bundle discovery and checks, the
fallback decision, the reader, Marlin forcing, and (against ``vllm_reference``) placing
bundle tensors into real vLLM layers with post-processing skipped."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from marlin_pack.vllm_plugin.checks import (
    EngineFacts,
    LayerFacts,
    LoaderOptions,
    LoadRefusedError,
    check_layers,
    check_rank_header,
    decide,
    parse_extra_config,
    plan_bundle,
    resolve_bundle_dir,
)
from marlin_pack.vllm_plugin.reader import CopyItem, ParallelReader, read_header
from safetensors.torch import load_file, save_file

import marlin_pack
from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.bundle import read_manifest
from marlin_pack.errors import BundleError, BundleMismatchError
from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.33.0"


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_awq_checkpoint(tmp_path_factory.mktemp("awq") / "ckpt", PRESETS["tiny"], tokenizer=False)
    marlin_pack.convert(d, tp_sizes=(1, 2), dtype="float16")
    return d


@pytest.fixture
def awq_copy(awq_dir: Path, tmp_path: Path) -> Path:
    """A private copy (checkpoint + bundle) a test may damage; stamps keep their meaning (copy2)."""
    return Path(shutil.copytree(awq_dir, tmp_path / "ckpt", copy_function=shutil.copy2))


def facts(model: Path | str, **kw: object) -> EngineFacts:
    base = dict(model=str(model), vllm_version=VLLM_VERSION, quantization="auto_awq")
    base.update(kw)
    return EngineFacts(**base)  # type: ignore[arg-type]


# --- registration ---------------------------------------------------------------------------


def test_importing_the_plugin_does_not_import_vllm() -> None:
    code = (
        "import sys, marlin_pack, marlin_pack.vllm_plugin, marlin_pack.vllm_plugin.prepacked, "
        "marlin_pack.vllm_plugin.checks, marlin_pack.vllm_plugin.reader; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_entry_point_resolves_to_register() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from marlin_pack.vllm_plugin import register

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "vllm.general_plugins"
    ]
    ep = EntryPoint(name="marlin_pack", value=declared["marlin_pack"], group="vllm.general_plugins")
    assert ep.load() is register
    installed = [e for e in entry_points(group="vllm.general_plugins") if e.name == "marlin_pack"]
    if installed:  # when the package is installed, the real metadata must agree
        assert installed[0].load() is register


def test_register_is_idempotent_and_get_model_loader_returns_ours() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from marlin_pack.vllm_plugin import register
    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    register()
    register()
    loader = get_model_loader(LoadConfig(load_format=LOAD_FORMAT))
    assert isinstance(loader, MarlinPrepackedLoader)
    assert loader.options == LoaderOptions()
    loader = get_model_loader(
        LoadConfig(
            load_format="marlin_prepacked", model_loader_extra_config={"bundle": "/b", "fallback": True}
        )
    )
    assert loader.options.bundle == Path("/b") and loader.options.fallback
    with pytest.raises(
        ValueError, match=r"Unexpected extra config keys for load format marlin_prepacked: \['bogus'\]"
    ):
        get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"bogus": 1}))


def test_vllm_plugin_machinery_calls_register(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.plugins as plugins

    import marlin_pack.vllm_plugin as plugin

    ep = EntryPoint(
        name="marlin_pack", value="marlin_pack.vllm_plugin:register", group="vllm.general_plugins"
    )
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group=None: [ep])
    monkeypatch.setattr(plugin, "_REGISTERED", False)
    loaded = plugins.load_plugins_by_group("vllm.general_plugins")
    assert loaded == {"marlin_pack": plugin.register}
    loaded["marlin_pack"]()
    assert plugin._REGISTERED


# --- extra config ---------------------------------------------------------------------------


def test_parse_extra_config_defaults_and_values() -> None:
    assert parse_extra_config({}) == LoaderOptions()
    o = parse_extra_config(
        {"bundle": "~/b", "fallback": True, "verify": "full", "io_threads": 3, "chunk_mb": 16}
    )
    assert o.bundle == Path("~/b").expanduser() and o.fallback and o.full_hash is True
    assert (o.io_threads, o.chunk_mb) == (3, 16)
    assert parse_extra_config({"verify": "size"}).full_hash is False
    assert parse_extra_config({}).full_hash is None


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("x", r"must be a dict for load format marlin_prepacked, got str"),
        ({"bundel": "/b"}, r"Unexpected extra config keys for load format marlin_prepacked: \['bundel'\]"),
        ({"bundle": ""}, r"\['bundle'\] must be a directory path"),
        ({"bundle": 3}, r"\['bundle'\] must be a directory path"),
        ({"fallback": "yes"}, r"\['fallback'\] must be true or false"),
        ({"verify": "some"}, r"\['verify'\] must be one of \['auto', 'full', 'size'\]"),
        ({"io_threads": 0}, r"\['io_threads'\] must be an integer in 1\.\.64"),
        ({"io_threads": True}, r"\['io_threads'\] must be an integer"),
        ({"chunk_mb": 4096}, r"\['chunk_mb'\] must be an integer in 1\.\.1024"),
    ],
)
def test_parse_extra_config_refuses(extra: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_extra_config(extra)


# --- bundle discovery and checks ------------------------------------------------------------


def test_bundle_discovery(tmp_path: Path) -> None:
    assert resolve_bundle_dir(LoaderOptions(), str(tmp_path)) == tmp_path / "marlin-pack"
    assert resolve_bundle_dir(LoaderOptions(bundle=Path("/x")), "org/model") == Path("/x")
    with pytest.raises(BundleMismatchError, match="not a local directory") as e:
        resolve_bundle_dir(LoaderOptions(), "org/model")
    assert e.value.field == "bundle"


@pytest.mark.parametrize(("tp_size", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_plan_for_each_rank(awq_dir: Path, tp_size: int, rank: int) -> None:
    plan = plan_bundle(LoaderOptions(), facts(awq_dir, tp_size=tp_size, tp_rank=rank))
    assert plan.bundle_dir == awq_dir / "marlin-pack" and plan.tp_set.tp_size == tp_size
    assert plan.rank_file == (awq_dir / f"marlin-pack/tp{tp_size}/rank-{rank}.safetensors").resolve()
    assert plan.common_file.name == "common.safetensors"
    header = read_header(plan.rank_file)
    check_rank_header(plan, {n: (i.dtype, i.shape) for n, i in header.tensors.items()}, header.metadata)


def test_explicit_bundle_path(awq_dir: Path) -> None:
    opts = parse_extra_config({"bundle": str(awq_dir / "marlin-pack")})
    assert plan_bundle(opts, facts(awq_dir)).bundle_dir == awq_dir / "marlin-pack"


@pytest.mark.parametrize(
    ("engine", "field", "match"),
    [
        (
            dict(tp_size=4, tp_rank=1),
            "tp_size",
            r"bundle has tp_size \[1, 2\], the engine runs tensor_parallel_size=4",
        ),
        (dict(dtype="bfloat16"), "serving_dtype", r"bundle holds float16 scales, the engine runs bfloat16"),
        (dict(vllm_version="0.34.0"), "vllm_version", r"made for vLLM 0\.33\.0, this engine runs 0\.34\.0"),
        (dict(quantization="auto_gptq"), "quant_method", r"engine quantization is auto_gptq"),
        (dict(marlin_input_dtype="int8"), "activation_dtype", r"VLLM_MARLIN_INPUT_DTYPE=int8 .* 8 bits"),
        (dict(marlin_input_dtype="FP8"), "activation_dtype", r"VLLM_MARLIN_INPUT_DTYPE=FP8"),
        (dict(pp_size=2), "pp_size", r"pipeline_parallel_size=2"),
        (dict(batch_invariant=True), "kernel", r"VLLM_BATCH_INVARIANT=1 disables Marlin"),
        (
            dict(disabled_kernels=("MarlinLinearKernel",)),
            "kernel",
            r"VLLM_DISABLED_KERNELS disables MarlinLinearKernel",
        ),
        (dict(linear_backend="machete"), "linear_backend", r"--linear-backend is 'machete'"),
        (
            dict(linear_backend="marlin", linear_backend_per_quant={"mixed_precision": "conch"}),
            "linear_backend",
            r"linear_backend_per_quant.mixed_precision is 'conch'",
        ),
    ],
)
def test_engine_mismatch_names_the_field(awq_dir: Path, engine: dict, field: str, match: str) -> None:
    with pytest.raises(BundleMismatchError, match=match) as e:
        plan_bundle(LoaderOptions(), facts(awq_dir, **engine))
    assert e.value.field == field


@pytest.mark.parametrize(
    "engine",
    [
        dict(linear_backend="marlin"),
        dict(linear_backend_per_quant={"mixed_precision": "marlin"}),
        dict(linear_backend="cutlass", linear_backend_per_quant={"mixed_precision": "marlin"}),
        dict(linear_backend_per_quant={"fp8": "cutlass"}),
        dict(marlin_input_dtype="bf16"),  # not an 8-bit type: vLLM ignores it
        dict(disabled_kernels=("MacheteLinearKernel",)),
    ],
)
def test_engine_settings_that_fit(awq_dir: Path, engine: dict) -> None:
    plan_bundle(LoaderOptions(), facts(awq_dir, **engine))


def _flip_byte(path: Path, offset_from_end: int = 1) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - offset_from_end)
        b = f.read(1)
        f.seek(st.st_size - offset_from_end)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new stamp, as an edit gives


def test_changed_source_file_is_refused(awq_copy: Path) -> None:
    _flip_byte(awq_copy / "model.safetensors")
    with pytest.raises(BundleMismatchError, match=r"source file model.safetensors changed") as e:
        plan_bundle(LoaderOptions(), facts(awq_copy))
    assert e.value.field == "source.sha256"
    # verify="size" trusts sizes and headers only
    plan_bundle(LoaderOptions(verify="size"), facts(awq_copy))


def test_extra_source_file_is_refused(awq_copy: Path) -> None:
    save_file({"x": torch.zeros(1)}, str(awq_copy / "extra.safetensors"))
    with pytest.raises(BundleMismatchError, match=r"holds safetensors files \['extra.safetensors'") as e:
        plan_bundle(LoaderOptions(), facts(awq_copy))
    assert e.value.field == "source.files"


def test_edited_rank_file_is_refused(awq_copy: Path) -> None:
    _flip_byte(awq_copy / "marlin-pack/tp1/rank-0.safetensors")
    with pytest.raises(
        BundleMismatchError, match=r"bundle file tp1/rank-0.safetensors has sha256 .* modified"
    ) as e:
        plan_bundle(LoaderOptions(), facts(awq_copy))
    assert e.value.field == "files"
    # another rank's file is not this rank's business
    plan_bundle(LoaderOptions(), facts(awq_copy, tp_size=2, tp_rank=0))
    with pytest.raises(BundleMismatchError, match="modified"):
        plan_bundle(LoaderOptions(verify="full"), facts(awq_copy))


def test_truncated_common_file_is_refused(awq_copy: Path) -> None:
    path = awq_copy / "marlin-pack/common.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(BundleMismatchError, match=r"common.safetensors is \d+ bytes, manifest says") as e:
        plan_bundle(LoaderOptions(), facts(awq_copy))
    assert e.value.field == "files"


def test_missing_or_foreign_bundle(tmp_path: Path, awq_copy: Path) -> None:
    with pytest.raises(BundleMismatchError, match=r"no bundle at .*marlin-convert|no bundle at") as e:
        plan_bundle(LoaderOptions(), facts(tmp_path))
    assert e.value.field == "manifest"
    manifest = awq_copy / "marlin-pack/manifest.json"
    raw = json.loads(manifest.read_text())
    raw["format_version"] = 2
    manifest.write_text(json.dumps(raw))
    with pytest.raises(BundleMismatchError) as e:
        plan_bundle(LoaderOptions(), facts(awq_copy))
    assert e.value.field == "format_version"


# --- the fallback decision ------------------------------------------------------------------


def test_decide_plans_when_everything_fits(awq_dir: Path) -> None:
    d = decide(LoaderOptions(), facts(awq_dir))
    assert not d.fallback and d.plan is not None and d.field is None


def test_decide_refuses_with_field_and_hint(awq_dir: Path) -> None:
    with pytest.raises(LoadRefusedError) as e:
        decide(LoaderOptions(), facts(awq_dir, dtype="bfloat16"))
    msg = str(e.value)
    assert e.value.field == "serving_dtype"
    assert msg.startswith(
        f"marlin-pack cannot serve {awq_dir} from bundle {awq_dir / 'marlin-pack'}: [serving_dtype]"
    )
    assert """pass --model-loader-extra-config '{"fallback": true}'""" in msg
    assert isinstance(e.value, BundleMismatchError) and isinstance(e.value.__cause__, BundleMismatchError)


def test_decide_falls_back_with_field_and_reason(awq_dir: Path, tmp_path: Path) -> None:
    d = decide(LoaderOptions(fallback=True), facts(awq_dir, tp_size=8))
    assert (
        d.fallback
        and d.plan is None
        and d.field == "tp_size"
        and "tensor_parallel_size=8" in (d.reason or "")
    )
    d = decide(LoaderOptions(fallback=True), facts(tmp_path))  # no bundle at all
    assert d.fallback and d.field == "manifest"


def test_decide_only_catches_bundle_errors(awq_dir: Path) -> None:
    def planner(options: LoaderOptions, f: EngineFacts):  # noqa: ANN202
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        decide(LoaderOptions(fallback=True), facts(awq_dir), planner)


# --- layer checks ---------------------------------------------------------------------------


def _good_layer_facts(awq_dir: Path) -> tuple[object, object, dict[str, LayerFacts]]:
    manifest = read_manifest(awq_dir / "marlin-pack")
    tp_set = manifest.tensor_parallel_set(1)
    found = {
        e.name: LayerFacts(
            method="AutoAWQMarlinLinearMethod",
            kernel="MarlinLinearKernel",
            partition_shape=(e.size_k, e.size_n),
            padded_nk=(e.padded_n, e.padded_k),
            group_size=manifest.quant.group_size,
            weight_type=manifest.quant.weight_type.value,
            act_dtype="float16",
            zero_points=True,
            has_bias=e.has_bias,
        )
        for e in tp_set.layers
    }
    return manifest, tp_set, found


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        (
            dict(kernel="MacheteLinearKernel"),
            "kernel",
            r"vLLM chose MacheteLinearKernel for layer .*qkv_proj",
        ),
        (dict(method="AutoAWQLinearMethod", kernel=None), "kernel", r"uses AutoAWQLinearMethod"),
        (dict(skips_when_marked=False), "kernel", r"not patched by marlin-pack"),
        (dict(partition_shape=(128, 512)), "layers", r"per-rank \(K, N\) is \(128, 512\)"),
        (dict(padded_nk=(1024, 256)), "layout", r"Marlin padded \(N, K\)"),
        (dict(group_size=64), "group_size", r"group size is 64, the bundle's is 128"),
        (dict(weight_type="uint4b8"), "weight_type", r"weight type is uint4b8"),
        (dict(act_dtype="int8"), "activation_dtype", r"activation dtype is int8"),
        (dict(zero_points=False), "zero_points", r"zero points is False"),
        (dict(has_bias=True), "layers", r"bias is True"),
    ],
)
def test_layer_mismatch_names_the_field(awq_dir: Path, change: dict, field: str, match: str) -> None:
    manifest, tp_set, found = _good_layer_facts(awq_dir)
    check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    name = "model.layers.1.self_attn.qkv_proj"
    found[name] = dataclasses.replace(found[name], **change)
    with pytest.raises(BundleMismatchError, match=match) as e:
        check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    assert e.value.field == field


def test_layer_set_mismatch(awq_dir: Path) -> None:
    manifest, tp_set, found = _good_layer_facts(awq_dir)
    del found["model.layers.0.mlp.down_proj"]
    found["lm_head"] = found["model.layers.1.mlp.down_proj"]
    with pytest.raises(
        BundleMismatchError,
        match=r"1 only in the bundle \(model.layers.0.mlp.down_proj\); 1 only in the engine \(lm_head\)",
    ) as e:
        check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    assert e.value.field == "layers"


def test_rank_header_mismatch(awq_dir: Path) -> None:
    plan = plan_bundle(LoaderOptions(), facts(awq_dir))
    header = read_header(plan.rank_file)
    tensors = {n: (i.dtype, i.shape) for n, i in header.tensors.items()}
    with pytest.raises(BundleMismatchError, match=r"has metadata .* expected") as e:
        check_rank_header(plan, tensors, {**header.metadata, "rank": "1"})
    assert e.value.field == "files"
    name = "model.layers.0.self_attn.o_proj.scales"
    with pytest.raises(
        BundleMismatchError, match=r"tensor model.layers.0.self_attn.o_proj.scales is \('BF16'"
    ):
        check_rank_header(plan, {**tensors, name: ("BF16", tensors[name][1])}, header.metadata)
    with pytest.raises(BundleMismatchError, match=r"lacks model.layers.0.self_attn.o_proj.scales"):
        check_rank_header(plan, {k: v for k, v in tensors.items() if k != name}, header.metadata)


# --- reader ---------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 3])
def test_reader_reads_every_tensor_to_cpu(awq_dir: Path, threads: int) -> None:
    path = awq_dir / "marlin-pack/tp1/rank-0.safetensors"
    header = read_header(path)
    want = load_file(str(path))
    out = {n: torch.empty(i.shape, dtype=i.torch_dtype) for n, i in header.tensors.items()}
    with ParallelReader(threads=threads, chunk_bytes=1 << 16) as r:  # small chunks: tensors split
        n = r.copy(path, [CopyItem(i.start, i.nbytes, out[name]) for name, i in header.tensors.items()])
    assert n == sum(i.nbytes for i in header.tensors.values())
    assert want.keys() == out.keys()
    for name, t in want.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_reader_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10, dtype=torch.int32)}, str(path))
    info = read_header(path).tensors["a"]
    with pytest.raises(ValueError, match="destination holds 36 bytes"):
        ParallelReader().copy(path, [CopyItem(info.start, info.nbytes, torch.empty(9, dtype=torch.int32))])
    with pytest.raises(BundleError, match="truncated"):
        ParallelReader().copy(
            path, [CopyItem(info.start + 8, info.nbytes, torch.empty(10, dtype=torch.int32))]
        )
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(BundleError, match=r"tensor 'a' has offsets"):
        read_header(path)
    path.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]")
    with pytest.raises(BundleError, match="not a JSON object"):
        read_header(path)


# --- prepacked marks and the patch ----------------------------------------------------------


def test_patch_skips_marked_layers_once() -> None:
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMarlinLinearMethod
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    from marlin_pack.vllm_plugin import prepacked

    assert sorted(prepacked.install_patches()) == ["AutoAWQMarlinLinearMethod", "AutoGPTQLinearMethod"]
    first = AutoGPTQLinearMethod.process_weights_after_loading
    prepacked.install_patches()  # idempotent: no double wrapping
    assert AutoGPTQLinearMethod.process_weights_after_loading is first

    calls: list[torch.nn.Module] = []
    method = SimpleNamespace(kernel=SimpleNamespace(process_weights_after_loading=calls.append))
    layer = torch.nn.Module()
    prepacked.mark_prepacked(layer)
    assert prepacked.is_prepacked(layer)
    AutoGPTQLinearMethod.process_weights_after_loading(method, layer)
    assert calls == [] and layer.input_global_scale is None and not prepacked.is_prepacked(layer)
    AutoGPTQLinearMethod.process_weights_after_loading(method, layer)  # the mark is one-shot
    assert calls == [layer]

    awq_layer = torch.nn.Module()  # AWQ: skipped before _convert_awq_to_standard_format
    prepacked.mark_prepacked(awq_layer)
    AutoAWQMarlinLinearMethod.process_weights_after_loading(method, awq_layer)
    assert calls == [layer] and awq_layer.input_global_scale is None

    assert prepacked.is_patched(AutoGPTQLinearMethod.__new__(AutoGPTQLinearMethod))
    prepacked.uninstall_patches()
    try:
        assert not prepacked.is_patched(AutoGPTQLinearMethod.__new__(AutoGPTQLinearMethod))
    finally:
        prepacked.install_patches()


# --- forcing Marlin -------------------------------------------------------------------------


def test_force_marlin_makes_vllm_choose_marlin(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config as vllm_config_mod
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS, _resolve_backend_kernels
    from vllm.platforms import PlatformEnum

    from marlin_pack.vllm_plugin.loader import force_marlin

    kc = KernelConfig()
    monkeypatch.setattr(
        vllm_config_mod, "get_current_vllm_config_or_none", lambda: SimpleNamespace(kernel_config=kc)
    )

    def candidates() -> list[str]:
        kernels = _resolve_backend_kernels(
            list(_POSSIBLE_KERNELS[PlatformEnum.CUDA]),
            "mixed-precision",
            quantization="mixed_precision",
            compute_capability=90,
        )
        return [k.__name__ for k in kernels]

    assert candidates().index("MacheteLinearKernel") < candidates().index(
        "MarlinLinearKernel"
    )  # H200 default
    kc.linear_backend_per_quant = {"fp8": "cutlass"}
    force_marlin(kc)
    assert kc.linear_backend_per_quant == {"fp8": "cutlass", "mixed_precision": "marlin"}
    assert candidates() == ["MarlinLinearKernel"]
    assert kc.compute_hash() != KernelConfig(linear_backend_per_quant={"fp8": "cutlass"}).compute_hash()


# --- end to end on real vLLM layers (CPU) ---------------------------------------------------

CASES = {
    "awq4": (lambda d: write_awq_checkpoint(d, PRESETS["tiny"], tokenizer=False), 1, 0),
    "gptq4": (lambda d: write_gptq_checkpoint(d, PRESETS["tiny"], tokenizer=False), 1, 0),
    "gptq8": (lambda d: write_gptq_checkpoint(d, PRESETS["tiny"], bits=8, tokenizer=False), 1, 0),
    "awq4-padded": (
        lambda d: write_awq_checkpoint(d, PRESETS["tiny-padded"], group_size=32, tokenizer=False),
        1,
        0,
    ),
    "gptq4-padded": (
        lambda d: write_gptq_checkpoint(d, PRESETS["tiny-padded"], group_size=32, tokenizer=False),
        1,
        0,
    ),
    "gptq4-tp2-rank1": (lambda d: write_gptq_checkpoint(d, PRESETS["tiny"], tokenizer=False), 2, 1),
    "awq4-tp2-rank0": (lambda d: write_awq_checkpoint(d, PRESETS["tiny"], tokenizer=False), 2, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_placed_layers_equal_stock_vllm_post_processing(tmp_path: Path, case: str) -> None:
    """Build real vLLM layers (as vllm_reference does), run the loader's checks, placement and
    vLLM's patched post-processing, and compare with stock vLLM's post-processed tensors."""
    vr = pytest.importorskip("vllm_reference")
    from marlin_pack.vllm_plugin.prepacked import install_patches, is_prepacked, mark_prepacked
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import (
        MarlinPrepackedLoader,
        _ModelState,
        layer_facts,
        quantized_layers,
    )

    write, tp_size, rank = CASES[case]
    ckpt = write(tmp_path / "ckpt")
    marlin_pack.convert(ckpt, tp_sizes=(tp_size,), dtype="float16")
    quantization = "auto_awq" if case.startswith("awq") else "auto_gptq"
    plan = plan_bundle(LoaderOptions(), facts(ckpt, tp_size=tp_size, tp_rank=rank, quantization=quantization))
    reference = vr.reference_rank_tensors(ckpt, tp_size, rank, torch.float16)

    install_patches()
    cfg = json.loads((ckpt / "config.json").read_text())
    v = vr._vllm()
    with vr._patched(tp_size, rank), v.set_default_torch_dtype(torch.float16):
        qc = vr._quant_config(v, ckpt, cfg["quantization_config"], v.default_model_class)
        root = vr._build_layers(v, vr._model_facts(cfg), qc, set(), cfg["num_hidden_layers"])
        layers = quantized_layers(root)
        check_layers(plan.manifest, plan.tp_set, {n: layer_facts(m) for n, m in layers.items()})
        loader = MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT))
        with ParallelReader(threads=2, chunk_bytes=1 << 16) as reader:
            items = loader._place(_ModelState(plan, layers), read_header(plan.rank_file))
            reader.copy(plan.rank_file, items)
        for layer in layers.values():
            mark_prepacked(layer)
            layer.quant_method.process_weights_after_loading(layer)  # vLLM's, patched: a no-op
            assert not is_prepacked(layer) and layer.input_global_scale is None
    got = {f"{n}.{p}": t for n, m in layers.items() for p, t in m.named_parameters(recurse=False)}
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        t = got[name]
        assert isinstance(t, torch.nn.Parameter), name
        assert t.dtype == want.dtype and t.shape == want.shape and t.is_contiguous(), name
        assert torch.equal(t.detach(), want), name


# --- the loader's own flow on CPU (model creation faked with real vLLM layers) ----------------


def _fake_engine(ckpt: Path, quantization: str) -> tuple[SimpleNamespace, SimpleNamespace]:
    from vllm.config.kernel import KernelConfig

    vllm_config = SimpleNamespace(
        kernel_config=KernelConfig(),
        speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device=torch.device("cpu")),
    )
    model_config = SimpleNamespace(
        model=str(ckpt),
        dtype=torch.float16,
        quantization=quantization,
        word_embeddings_untied_by_checkpoint=False,
    )
    return vllm_config, model_config


def _patch_create_model(monkeypatch: pytest.MonkeyPatch, vr: object, ckpt: Path, seen: list) -> None:
    """BaseModelLoader.create_model -> the four linears per decoder layer, built by vLLM's real classes."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    cfg = json.loads((ckpt / "config.json").read_text())

    def create_model(
        self: object, vllm_config: SimpleNamespace, model_config: object, prefix: str = ""
    ) -> object:
        seen.append(dict(vllm_config.kernel_config.linear_backend_per_quant or {}))
        v = vr._vllm()  # type: ignore[attr-defined]
        qc = vr._quant_config(v, ckpt, cfg["quantization_config"], v.default_model_class)  # type: ignore[attr-defined]
        root = vr._build_layers(v, vr._model_facts(cfg), qc, set(), cfg["num_hidden_layers"])  # type: ignore[attr-defined]
        root.common = []
        root.load_weights = lambda weights: {root.common.append((n, t.device)) or n for n, t in weights}
        return root

    monkeypatch.setattr(BaseModelLoader, "create_model", create_model)


@pytest.mark.parametrize("kind", ["awq4", "gptq4"])
def test_load_model_flow_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """load_model: forced Marlin at creation, checks, placement, marks, common tensors through
    model.load_weights, vLLM's real process_weights_after_loading (a no-op for the layers)."""
    vr = pytest.importorskip("vllm_reference")
    from marlin_pack.vllm_plugin.prepacked import is_prepacked
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    ckpt = CASES[kind][0](tmp_path / "ckpt")
    marlin_pack.convert(ckpt, tp_sizes=(1,), dtype="float16")
    reference = vr.reference_rank_tensors(ckpt, 1, 0, torch.float16)
    seen: list = []
    _patch_create_model(monkeypatch, vr, ckpt, seen)
    vllm_config, model_config = _fake_engine(ckpt, "auto_awq" if kind.startswith("awq") else "auto_gptq")
    loader = MarlinPrepackedLoader(
        LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"io_threads": 2})
    )
    with vr._patched(1, 0):
        model = loader.load_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert seen == [{"mixed_precision": "marlin"}]
    assert vllm_config.kernel_config.linear_backend_per_quant == {"mixed_precision": "marlin"}  # stays set
    common = load_file(str(ckpt / "marlin-pack/common.safetensors"))
    assert sorted(n for n, _ in model.common) == sorted(common)
    for name, want in reference.items():
        layer, _, pname = name.rpartition(".")
        got = getattr(model.get_submodule(layer), pname)
        assert torch.equal(got.detach(), want), name
    assert not any(is_prepacked(m) for m in model.modules())
    assert not model.training


def test_create_model_kernel_mismatch_refuses_or_falls_back(
    awq_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vr = pytest.importorskip("vllm_reference")
    from marlin_pack.vllm_plugin.prepacked import is_prepacked
    from vllm.config.load import LoadConfig

    import marlin_pack.vllm_plugin.loader as loader_mod

    real_facts = loader_mod.layer_facts

    def machete_for_down_proj(module: torch.nn.Module) -> LayerFacts:
        f = real_facts(module)
        return (
            dataclasses.replace(f, kernel="MacheteLinearKernel") if module.prefix.endswith("down_proj") else f
        )

    monkeypatch.setattr(loader_mod, "layer_facts", machete_for_down_proj)
    _patch_create_model(monkeypatch, vr, awq_copy, [])
    vllm_config, model_config = _fake_engine(awq_copy, "auto_awq")

    loader = loader_mod.MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT))
    fp16 = vr._vllm().set_default_torch_dtype(torch.float16)  # as the daemon and load_model do
    with (
        fp16,
        vr._patched(1, 0),
        pytest.raises(LoadRefusedError, match=r"\[kernel\] vLLM chose MacheteLinearKernel") as e,
    ):
        loader.create_model(vllm_config, model_config)  # type: ignore[arg-type]
    assert e.value.field == "kernel"

    calls: list = []
    fallback = loader_mod.MarlinPrepackedLoader(
        LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config={"fallback": True})
    )
    monkeypatch.setattr(
        fallback, "_default_loader", lambda: SimpleNamespace(load_weights=lambda m, c: calls.append(m))
    )
    with vr._patched(1, 0), vr._vllm().set_default_torch_dtype(torch.float16):
        model = fallback.create_model(vllm_config, model_config)  # type: ignore[arg-type]
        fallback.load_weights(model, model_config)  # type: ignore[arg-type]
    assert calls == [model]  # the ordinary loader loads the checkpoint
    assert not any(is_prepacked(m) for m in model.modules())


def test_load_weights_needs_its_own_model() -> None:
    from vllm.config.load import LoadConfig

    from marlin_pack.vllm_plugin.loader import MarlinPrepackedLoader

    loader = MarlinPrepackedLoader(LoadConfig(load_format=LOAD_FORMAT))
    with pytest.raises(RuntimeError, match="only load weights into a model built by its own create_model"):
        loader.load_weights(torch.nn.Module(), SimpleNamespace())  # type: ignore[arg-type]
