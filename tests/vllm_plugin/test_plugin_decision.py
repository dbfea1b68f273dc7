"""``decision``: bundle discovery, the engine and file checks, the refuse/fall-back decision and
the layer checks, as pure functions over plain facts (no vLLM). Also the rank-file header check
(``bundle.rank_files``) the loader runs on the selected bundle."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from source_edits import flip_byte, flip_sampled_byte, unsampled_offset, without_samples

from marlin_pack.bundle.rank_files import check_rank_header, rank_file_path
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.errors import BundleMismatchError, LoadRefusedError, MismatchField
from marlin_pack.io.safetensors_io import read_header
from marlin_pack.vllm_plugin.decision import (
    EngineFacts,
    check_engine,
    decide,
    refusal,
    resolve_bundle_dir,
    select_bundle,
)
from marlin_pack.vllm_plugin.layer_check import SUPPORTED_METHODS, LayerFacts, check_layers
from marlin_pack.vllm_plugin.options import LoaderOptions, parse_extra_config
from marlin_pack.vllm_plugin.preflight import preflight

VLLM_VERSION = "0.33.0"


def facts(model: Path | str, **kw: object) -> EngineFacts:
    base: dict[str, object] = dict(model=str(model), vllm_version=VLLM_VERSION, quantization="auto_awq")
    base.update(kw)
    return EngineFacts(**base)  # type: ignore[arg-type]


def flip_last_byte(path: Path) -> None:
    """Change one byte and give the file a new mtime, as an edit does (same size)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 1)
        b = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# --- bundle discovery -------------------------------------------------------------------------


def test_bundle_discovery(tmp_path: Path) -> None:
    assert resolve_bundle_dir(LoaderOptions(), str(tmp_path)) == tmp_path / "marlin-pack"
    assert resolve_bundle_dir(LoaderOptions(bundle=Path("/x")), "org/model") == Path("/x")
    with pytest.raises(BundleMismatchError, match="org/model is not in the Hugging Face cache .*has no marlin-pack bundle") as e:
        resolve_bundle_dir(LoaderOptions(), "org/model")
    assert e.value.field == "bundle" and e.value.field is MismatchField.bundle


@pytest.mark.parametrize(("tp_size", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_select_bundle_for_each_rank(awq_bundle: Path, tp_size: int, rank: int) -> None:
    selected = select_bundle(LoaderOptions(), facts(awq_bundle, tp_size=tp_size, tp_rank=rank))
    assert selected.bundle_dir == awq_bundle / "marlin-pack" and selected.tp_set.tp_size == tp_size
    assert selected.rank == rank
    assert selected.rank_file == (awq_bundle / "marlin-pack" / rank_file_path(tp_size, rank)).resolve()
    assert selected.rank_file == (awq_bundle / f"marlin-pack/tp{tp_size}/rank-{rank}.safetensors").resolve()
    assert selected.common_file.name == "common.safetensors"
    check_rank_header(selected.manifest, selected.tp_set, selected.rank, read_header(selected.rank_file))


def test_explicit_bundle_path(awq_bundle: Path) -> None:
    opts = parse_extra_config({"bundle": str(awq_bundle / "marlin-pack")})
    assert select_bundle(opts, facts(awq_bundle)).bundle_dir == awq_bundle / "marlin-pack"


# --- the engine checks ------------------------------------------------------------------------

ENGINE_MISMATCHES = [
    (dict(tp_size=4, tp_rank=1), "tp_size", (r"bundle has tp 1,2, the engine runs --tensor-parallel-size 4, which this checkpoint "
                                             r"cannot be split into \(marlin-pack convert accepts --tp 1,2 for it\)")),
    (dict(tp_size=2, tp_rank=2), "tp_rank", r"rank 2 is outside tp_size 2"),
    (dict(dtype="bfloat16"), "serving_dtype", r"bundle holds float16 scales, the engine runs bfloat16"),
    (dict(vllm_version="0.35.0"), "vllm_version",
     r"vLLM 0\.35\.0 is not a release marlin-pack supports \(supported: 0\.34\.0, 0\.33\.0, 0\.32\.0, 0\.31\.0, 0\.30\.0\)"),
    (dict(vllm_version="0.29.0"), "vllm_version", r"vLLM 0\.29\.0 is not a release marlin-pack supports"),
    (dict(quantization="auto_gptq"), "quant_method", r"engine quantization is auto_gptq"),
    (dict(marlin_input_dtype="int8"), "activation_dtype", r"VLLM_MARLIN_INPUT_DTYPE=int8 .* 8 bits"),
    (dict(marlin_input_dtype="FP8"), "activation_dtype", r"VLLM_MARLIN_INPUT_DTYPE=FP8"),
    (dict(batch_invariant=True), "kernel", r"VLLM_BATCH_INVARIANT=1 disables Marlin"),
    (dict(disabled_kernels=("MarlinLinearKernel",)), "kernel", r"VLLM_DISABLED_KERNELS disables MarlinLinearKernel"),
    (dict(linear_backend="machete"), "linear_backend", r"--linear-backend is 'machete'"),
    (
        dict(linear_backend="marlin", linear_backend_per_quant={"mixed_precision": "conch"}),
        "linear_backend",
        r"linear_backend_per_quant.mixed_precision is 'conch'",
    ),
]


@pytest.mark.parametrize(("engine", "field", "match"), ENGINE_MISMATCHES)
def test_engine_mismatch_names_the_field(awq_bundle: Path, engine: dict, field: str, match: str) -> None:
    manifest = read_manifest(awq_bundle / "marlin-pack")
    with pytest.raises(BundleMismatchError, match=match) as e:
        check_engine(manifest, facts(awq_bundle, **engine))
    assert e.value.field == field and isinstance(e.value.field, MismatchField)
    with pytest.raises(BundleMismatchError, match=match) as e:  # select_bundle checks the engine first
        select_bundle(LoaderOptions(), facts(awq_bundle, **engine))
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
        dict(quantization=None),
        dict(quantization="awq_marlin"),
    ],
)
def test_engine_settings_that_fit(awq_bundle: Path, engine: dict) -> None:
    manifest = read_manifest(awq_bundle / "marlin-pack")
    assert check_engine(manifest, facts(awq_bundle, **engine)).tp_size == 1
    select_bundle(LoaderOptions(), facts(awq_bundle, **engine))


# --- pipeline stages -------------------------------------------------------------------------


def test_a_pipeline_stage_selects_its_share(awq_bundle: Path) -> None:
    """The tiny model's 2 layers over 2 stages: each stage's TP set, rank header and common header hold only its
    layers (and the embedding on the first, the final norm and head on the last); PP=1 selects no stage."""
    whole = select_bundle(LoaderOptions(), facts(awq_bundle))
    assert whole.stage is None
    shares = [select_bundle(LoaderOptions(), facts(awq_bundle, pp_size=2, pp_rank=s)) for s in range(2)]
    for s, sel in enumerate(shares):
        share = sel.stage
        assert share is not None and share.layers == (s, s + 1) and share.num_layers == 2
        assert sel.tp_set is share.tp_set and sel.rank_header is share.rank_header and sel.common_header is share.common_header
        assert {e.name.split(".")[2] for e in sel.tp_set.layers} == {str(s)}
        assert all(n.startswith(f"model.layers.{s}.") for n in sel.rank_header.tensors)
        assert sel.rank_file == whole.rank_file and sel.common_file == whole.common_file  # the same files, a part of them
        assert share.rank_file_bytes == sum(i.nbytes for i in whole.rank_header.tensors.values())
    first, last = (set(sel.common_header.tensors) for sel in shares)
    assert "model.embed_tokens.weight" in first - last and {"model.norm.weight", "lm_head.weight"} <= last - first
    assert first | last == set(whole.common_header.tensors) and not first & last
    assert sum(sel.stage.rank_bytes for sel in shares) == shares[0].stage.rank_file_bytes  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("engine", "env", "match"),
    [
        (dict(pp_size=2, pp_rank=2), None, r"\[pp_size\] pipeline rank 2 is outside --pipeline-parallel-size 2"),
        (dict(pp_size=2, pp_rank=0), "1,2", (r"\[pp_size\] VLLM_PP_LAYER_PARTITION='1,2' sums to 3 layers, the model has 2; "
                                             r"fix VLLM_PP_LAYER_PARTITION or unset it")),
        (dict(pp_size=3, pp_rank=0), "1,x,1", r"is not comma-separated layer counts"),
    ],
)
def test_a_pipeline_that_does_not_fit_is_refused_in_one_line(
    awq_bundle: Path, monkeypatch: pytest.MonkeyPatch, engine: dict, env: str | None, match: str,
) -> None:
    if env is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(LoadRefusedError, match=match) as e:
        decide(LoaderOptions(), facts(awq_bundle, **engine))
    assert e.value.field == "pp_size" and "\n" not in str(e.value)
    assert decide(LoaderOptions(fallback=True), facts(awq_bundle, **engine)).field == "pp_size"


def test_a_named_partition_moves_a_stages_share(awq_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,0")
    first, last = (select_bundle(LoaderOptions(), facts(awq_bundle, pp_size=2, pp_rank=s)).stage for s in range(2))
    assert first is not None and last is not None
    assert first.layers == (0, 2) and last.layers == (2, 2) and not last.tp_set.layers and last.rank_bytes == 0
    assert set(last.common_header.tensors) == {"model.norm.weight", "lm_head.weight"}
    assert first.text().startswith("stage 0/2 (layers 0-1 of 2 layers): ")
    assert last.text().startswith("stage 1/2 (none of 2 layers): 0.0 kB of ")
    one = dataclasses.replace(first, layers=(0, 1), num_layers=1)
    assert one.text().startswith("stage 0/2 (layer 0 of 1 layer): ")


# --- source and bundle files ------------------------------------------------------------------


@pytest.mark.parametrize("verify", ["auto", "full"])
def test_changed_source_file_is_refused(awq_bundle: Path, damaged_copy, verify: str) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint whose tensors hold other bytes (quantized again, another revision) is told apart by its samples."""
    model = damaged_copy(awq_bundle, lambda d: flip_sampled_byte(d / "model.safetensors"))
    with pytest.raises(BundleMismatchError, match=r"source file model.safetensors holds other tensor bytes than when the "
                       r"bundle was made \(sampled\); re-run `marlin-pack convert ") as e:
        select_bundle(LoaderOptions(verify=verify), facts(model))
    assert e.value.field == "source.sample"
    select_bundle(LoaderOptions(verify="size"), facts(model))  # verify="size" trusts sizes and headers only


def test_a_start_samples_the_checkpoint_and_verify_hashes_it_whole(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    """What samples do not prove: a byte between them. A start reads kilobytes of the checkpoint (vLLM does not read it
    at all when it serves the bundle); ``marlin-pack verify`` hashes it whole and refuses."""
    from marlin_pack.verification import verify

    path = awq_bundle / "model.safetensors"
    model = damaged_copy(awq_bundle, lambda d: flip_byte(d / "model.safetensors", unsampled_offset(path)))
    for how in ("auto", "full"):
        select_bundle(LoaderOptions(verify=how), facts(model))
    report = verify(model / "marlin-pack", model)
    failed = report.first_failure
    assert not report.ok and failed is not None and "model.safetensors changed since the bundle was made" in failed.detail, report


def test_a_bundle_without_samples_hashes_its_checkpoint(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    """A bundle an older marlin-pack wrote records no samples: its start hashes the checkpoint whole, as then."""
    model = damaged_copy(awq_bundle, lambda d: (without_samples(d), flip_last_byte(d / "model.safetensors")))
    with pytest.raises(BundleMismatchError, match=r"source file model.safetensors changed") as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "source.blake3"


def test_extra_source_file_is_refused(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    model = damaged_copy(awq_bundle, lambda d: save_file({"x": torch.zeros(1)}, str(d / "extra.safetensors")))
    with pytest.raises(BundleMismatchError, match=r"holds safetensors files \['extra.safetensors'") as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "source.files"


def test_edited_rank_file_is_refused(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    model = damaged_copy(awq_bundle, lambda d: flip_last_byte(d / "marlin-pack/tp1/rank-0.safetensors"))
    with pytest.raises(BundleMismatchError, match=r"bundle file tp1/rank-0.safetensors has blake3 .* modified") as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "files"
    select_bundle(LoaderOptions(), facts(model, tp_size=2, tp_rank=0))  # another rank's file is not this rank's business
    with pytest.raises(BundleMismatchError, match="modified"):
        select_bundle(LoaderOptions(verify="full"), facts(model))


def test_truncated_common_file_is_refused(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    def truncate(d: Path) -> None:
        path = d / "marlin-pack/common.safetensors"
        path.write_bytes(path.read_bytes()[:-4])

    model = damaged_copy(awq_bundle, truncate)
    with pytest.raises(BundleMismatchError, match=r"common.safetensors is \d+ bytes, manifest says") as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "files"


def test_missing_or_foreign_bundle(tmp_path: Path, awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BundleMismatchError, match=r"no bundle at") as e:
        select_bundle(LoaderOptions(), facts(tmp_path))
    assert e.value.field == "manifest"

    def bump_format_version(d: Path) -> None:
        manifest = d / "marlin-pack/manifest.json"
        raw = json.loads(manifest.read_text())
        raw["format_version"] = 1  # an older marlin-pack's bundle
        manifest.write_text(json.dumps(raw))

    model = damaged_copy(awq_bundle, bump_format_version)
    with pytest.raises(BundleMismatchError) as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "format_version"
    assert (
        "has format_version 1, this marlin-pack reads formats 3 to 5 (made by an older marlin-pack); "
        f"re-convert it with `marlin-pack convert {model} --force`"
    ) in str(e.value)


# --- the fallback decision --------------------------------------------------------------------


def test_decide_selects_when_everything_fits(awq_bundle: Path) -> None:
    d = decide(LoaderOptions(), facts(awq_bundle))
    assert not d.fallback and d.bundle is not None and d.field is None and d.reason is None
    assert d.bundle.rank_file.name == "rank-0.safetensors"


def test_decide_refuses_with_field_and_hint(awq_bundle: Path) -> None:
    with pytest.raises(LoadRefusedError) as e:
        decide(LoaderOptions(), facts(awq_bundle, dtype="bfloat16"))
    msg = str(e.value)
    assert e.value.field == "serving_dtype"
    assert msg.startswith(f"marlin-pack cannot serve {awq_bundle} from bundle {awq_bundle / 'marlin-pack'}: [serving_dtype]")
    assert """pass --model-loader-extra-config '{"fallback": true}'""" in msg
    assert isinstance(e.value, BundleMismatchError) and isinstance(e.value.__cause__, BundleMismatchError)


def test_refusal_message() -> None:
    e = refusal(MismatchField.tp_size, "why", "org/model", None)
    assert isinstance(e, LoadRefusedError) and e.field is MismatchField.tp_size
    assert str(e).startswith("marlin-pack cannot serve org/model from its bundle: [tp_size] why. Fix it, or pass")


def test_decide_falls_back_with_field_and_reason(awq_bundle: Path, tmp_path: Path) -> None:
    d = decide(LoaderOptions(fallback=True), facts(awq_bundle, tp_size=8))
    assert d.fallback and d.bundle is None and d.field == "tp_size" and "--tensor-parallel-size 8" in (d.reason or "")
    d = decide(LoaderOptions(fallback=True), facts(tmp_path))  # no bundle at all
    assert d.fallback and d.field == "manifest"


def test_decide_refuses_only_on_bad_input(awq_bundle: Path) -> None:
    """A bug is no refusal: without fallback it propagates as it was (with fallback: an internal error, see below)."""
    def selector(options: LoaderOptions, f: EngineFacts):  # noqa: ANN202
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        decide(LoaderOptions(), facts(awq_bundle), selector=selector)
    assert "internal error RuntimeError: bug" in str(decide(LoaderOptions(fallback=True), facts(awq_bundle), selector=selector).reason)


# --- layer checks -----------------------------------------------------------------------------


def _good_layer_facts(model: Path) -> tuple[object, object, dict[str, LayerFacts]]:
    manifest = read_manifest(model / "marlin-pack")
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
        (dict(kernel="MacheteLinearKernel"), "kernel", r"vLLM chose MacheteLinearKernel for layer .*qkv_proj"),
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
def test_layer_mismatch_names_the_field(awq_bundle: Path, change: dict, field: str, match: str) -> None:
    manifest, tp_set, found = _good_layer_facts(awq_bundle)
    check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    name = "model.layers.1.self_attn.qkv_proj"
    found[name] = dataclasses.replace(found[name], **change)
    with pytest.raises(BundleMismatchError, match=match) as e:
        check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    assert e.value.field == field


def test_layer_set_mismatch(awq_bundle: Path) -> None:
    manifest, tp_set, found = _good_layer_facts(awq_bundle)
    del found["model.layers.0.mlp.down_proj"]
    found["lm_head"] = found["model.layers.1.mlp.down_proj"]
    with pytest.raises(
        BundleMismatchError,
        match=r"1 only in the bundle \(model.layers.0.mlp.down_proj\); 1 only in the engine \(lm_head\)",
    ) as e:
        check_layers(manifest, tp_set, found)  # type: ignore[arg-type]
    assert e.value.field == "layers"


def test_supported_methods_are_the_patched_quant_methods() -> None:
    from marlin_pack.vllm_plugin.patches.post_processing import QUANT_METHODS

    # compressed-tensors' method is supported with its WNA16 scheme only ("Method:Scheme").
    assert tuple(target.rsplit(":", 1)[1] for target in QUANT_METHODS) == tuple(m.split(":")[0] for m in SUPPORTED_METHODS)


# --- the rank file's header -------------------------------------------------------------------


def test_rank_header_mismatch(awq_bundle: Path) -> None:
    s = select_bundle(LoaderOptions(), facts(awq_bundle))
    header = read_header(s.rank_file)
    with pytest.raises(BundleMismatchError, match=r"has metadata .* expected") as e:
        check_rank_header(s.manifest, s.tp_set, s.rank, dataclasses.replace(header, metadata={**header.metadata, "rank": "1"}))
    assert e.value.field == "files"
    with pytest.raises(BundleMismatchError, match=r"has metadata .* expected"):  # rank 1's file is not rank 0's
        check_rank_header(s.manifest, s.manifest.tensor_parallel_set(2), 0, header)
    name = "model.layers.0.self_attn.o_proj.scales"
    tensors = dict(header.tensors)
    bf16 = {**tensors, name: dataclasses.replace(tensors[name], dtype="BF16")}
    with pytest.raises(BundleMismatchError, match=r"tensor model.layers.0.self_attn.o_proj.scales is \('BF16'") as e:
        check_rank_header(s.manifest, s.tp_set, s.rank, dataclasses.replace(header, tensors=bf16))
    assert e.value.field == "files"
    missing = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(BundleMismatchError, match=r"lacks model.layers.0.self_attn.o_proj.scales"):
        check_rank_header(s.manifest, s.tp_set, s.rank, dataclasses.replace(header, tensors=missing))


@pytest.mark.parametrize(
    "aliases,match",
    [({"model.layers.0.self_attn.qkv_proj.qweight": "model.embed_tokens.weight"}, "tensor of the quantized layer"),
     ({"model.layers.0.mlp.down_proj.lm_head.weight": "model.embed_tokens.weight"}, "tensor of the quantized layer"),
     # names that merely end like an output head, or another architecture's head: vLLM's Llama loads only lm_head.weight
     ({"model.layers.0.mlp.lm_head.weight": "model.embed_tokens.weight"}, r"only the output head of LlamaForCausalLM \(lm_head"),
     ({"model.lm_head.weight": "model.embed_tokens.weight"}, "only the output head of LlamaForCausalLM"),
     ({"output.weight": "model.embed_tokens.weight"}, "only the output head of LlamaForCausalLM"),
     ({"language_model.lm_head.weight": "model.embed_tokens.weight"}, "only the output head of LlamaForCausalLM"),
     ({"lm_head.weight\n": "model.embed_tokens.weight"}, "is not a tensor name"),
     ({"lm_head.weight": "model.embed_tokens.weight\nx"}, "is not a tensor name"),
     ({"model.lm_head.weight": "model.layers.1.self_attn.q_proj.qweight"}, "tensor of the quantized layer")],
)
def test_bad_common_aliases_are_refused_before_the_gpu(awq_bundle: Path, damaged_copy, aliases: dict, match: str) -> None:  # type: ignore[no-untyped-def]
    """The loader (and ``check``) read the manifest through the schema, which checks every alias: no path skips it."""
    def edit(d: Path) -> None:
        path = d / "marlin-pack" / "manifest.json"
        m = json.loads(path.read_text())
        m["common_aliases"] = aliases
        path.write_text(json.dumps(m))

    model = damaged_copy(awq_bundle, edit)
    with pytest.raises(BundleMismatchError, match=rf"field common_aliases: .*{match}|common_aliases maps .*{match}") as e:
        select_bundle(LoaderOptions(), facts(model))
    assert e.value.field == "manifest" and "\n" not in str(e.value).replace("\\n", "")
    with pytest.raises(LoadRefusedError, match="common_aliases"):
        decide(LoaderOptions(), facts(model))
    assert decide(LoaderOptions(fallback=True), facts(model)).fallback
    report = preflight(model)  # `marlin-pack check`
    assert report.decision == "refuse" and report.ranks[0].field == "manifest" and "common_aliases" in report.ranks[0].message


def test_check_verify_and_the_loader_share_one_alias_rule(awq_bundle: Path, damaged_copy) -> None:  # type: ignore[no-untyped-def]
    """An alias ending like a head (issue 68, item 11): check used to pass it, only verify refused it (comparing with the
    checkpoint); now the manifest's schema refuses it for all three, with the same words."""
    from marlin_pack import verify

    def edit(d: Path) -> None:
        path = d / "marlin-pack" / "manifest.json"
        m = json.loads(path.read_text())
        m["common_aliases"] = {"model.layers.0.mlp.lm_head.weight": "model.embed_tokens.weight"}
        path.write_text(json.dumps(m))

    model = damaged_copy(awq_bundle, edit)
    why = "only the output head of LlamaForCausalLM (lm_head.weight) is stored as a copy of another tensor"
    report = verify(model / "marlin-pack")
    assert not report.ok and report.first_failure is not None and why in report.first_failure.detail
    assert why in preflight(model).ranks[0].message
    with pytest.raises(BundleMismatchError, match=re.escape(why)):
        select_bundle(LoaderOptions(), facts(model))


# --- every failure before the GPU is a refusal, or (fallback) falls back: issue 68, item 10 -------------------------


def test_an_internal_error_of_the_checks_falls_back_or_propagates(awq_bundle: Path) -> None:
    """An exception that is no refusal (a bug): ``fallback`` falls back, saying it is an internal error, in one line;
    without it, it propagates as it was (``check`` then exits 2 with it)."""
    def broken(options: LoaderOptions, f: EngineFacts) -> object:
        raise KeyError("model.layers.0.mlp.experts")

    with pytest.raises(KeyError):
        decide(LoaderOptions(), facts(awq_bundle), broken)  # type: ignore[arg-type]
    d = decide(LoaderOptions(fallback=True), facts(awq_bundle), broken)  # type: ignore[arg-type]
    assert d.fallback and d.field is MismatchField.bundle and d.reason is not None and "\n" not in d.reason
    assert d.reason.startswith("internal error KeyError: 'model.layers.0.mlp.experts' while checking the bundle; please report it")


@pytest.fixture(scope="module")
def moe_tp12(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE GPTQ checkpoint (synthetic) converted for tp 1 and 2."""
    from marlin_pack import convert
    from marlin_pack.testing.synthetic_moe import MoeShape, write_moe_checkpoint

    model = write_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", MoeShape(num_experts=4), "gptq")
    convert(model, tp=(1, 2))
    return model


@pytest.fixture(scope="module")
def deepseek_tp1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V2 GPTQ checkpoint (synthetic, n_group 1) converted for tp 1."""
    from marlin_pack import convert
    from marlin_pack.testing.synthetic_deepseek import DeepseekShape, write_deepseek_checkpoint

    model = write_deepseek_checkpoint(tmp_path_factory.mktemp("ds") / "m", DeepseekShape(), "gptq")
    convert(model)
    return model


def _rename_experts_layer(model_dir: Path, tp: int) -> None:
    """A consistent forgery: tp ``tp``'s first experts layer renamed (same length) in its manifest entry and rank
    files' headers, their sizes and digests recorded anew; the other TP size keeps the old name."""
    import struct

    from marlin_pack.io.hashing import file_digest

    path = model_dir / "marlin-pack" / "manifest.json"
    m = json.loads(path.read_text())
    s = next(s for s in m["tensor_parallel"] if s["tp_size"] == tp)
    old = s["moe_layers"][0]["name"]
    new = old[:-1] + ("z" if old[-1] != "z" else "y")
    s["moe_layers"][0]["name"] = new
    for r in s["ranks"]:
        f = model_dir / "marlin-pack" / r["file"]["path"]
        raw = bytearray(f.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        raw[8:8 + n] = raw[8:8 + n].decode().replace(f'"{old}.', f'"{new}.').encode()
        f.write_bytes(bytes(raw))
        r["file"]["blake3"] = file_digest(f)
    path.write_text(json.dumps(m))


@pytest.mark.parametrize("tp,args", [(2, dict(tp_size=2, expert_parallel=True)), (2, dict(tp_size=1, dp_size=2)),
                                     (1, dict(tp_size=2, expert_parallel=True)), (1, dict(tp_size=1, dp_size=2))])
def test_tp_sizes_naming_an_experts_layer_differently_are_refused(moe_tp12: Path, damaged_copy, tp: int, args: dict) -> None:  # type: ignore[no-untyped-def]
    """The experts of one TP size's rank files serve another's engine (EP, DP): a KeyError there used to escape fallback.
    Every TP size holds the same layers, which the manifest's schema now checks for every reader."""
    model = damaged_copy(moe_tp12, lambda d: _rename_experts_layer(d, tp))
    report = preflight(model, **args)
    assert report.decision == "refuse" and report.ranks[0].field == "manifest"
    assert "every TP size holds the same layers" in report.ranks[0].message and "\n" not in report.ranks[0].message
    assert preflight(model, fallback=True, **args).decision == "fallback"


def test_expert_share_refuses_an_experts_layer_its_source_lacks(moe_tp12: Path) -> None:
    """The share itself, given TP sets that disagree (a stage's, say): a refusal naming the layer, never a KeyError."""
    from marlin_pack.vllm_plugin.expert_share import expert_share, moe_ranks

    m = read_manifest(moe_tp12 / "marlin-pack")
    tp1, tp2 = m.tensor_parallel_set(1), m.tensor_parallel_set(2)
    renamed = tp2.model_copy(update={"moe_layers": [tp2.moe_layers[0].model_copy(update={"name": "x.experts"})]})
    header = read_header(moe_tp12 / "marlin-pack" / tp1.ranks[0].file.path)
    with pytest.raises(BundleMismatchError, match="the experts layer x.experts of tp2 is not in tp1") as e:
        expert_share(m, renamed, tp1, header, Path("rank-0"), moe_ranks(2, 0, 1, 0, True), "linear")
    assert e.value.field == "layers"


@pytest.mark.parametrize("value", [[2], {}, float("inf"), float("nan"), "2", True, 2.0, 0, -1, 10**9, {"a": 1}])
def test_n_group_of_another_json_type_is_refused_naming_it(deepseek_tp1: Path, damaged_copy, value: object) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek's n_group decides the experts' placement at EP: a list, an object, inf (``1e400``), a float, a bool..."""
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["n_group"] = value
        (d / "config.json").write_text(json.dumps(cfg))

    model = damaged_copy(deepseek_tp1, edit)
    args = dict(tp_size=1, dp_size=2, expert_parallel=True, expert_placement="round_robin")
    report = preflight(model, **args)
    assert report.decision == "refuse" and report.ranks[0].field == "source", report.to_dict()
    assert f"config.json n_group is {value!r}, expected an integer from 1 to 4096 or null" in report.ranks[0].message
    assert preflight(model, fallback=True, **args).decision == "fallback"


def test_n_group_as_transformers_config_class_holds_it() -> None:
    """Absent: the class default (DeepSeek-V3 8, so vLLM places round robin; V2 none); null: none; under text_config too."""
    from marlin_pack.errors import UnsupportedCheckpointError
    from marlin_pack.vllm_plugin.expert_share import num_expert_group

    v2, v3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
    assert num_expert_group(v3, {"model_type": "deepseek_v3"}) == 8
    assert num_expert_group(v3, {"architectures": [v3]}) == 8
    assert num_expert_group(v2, {"model_type": "deepseek_v2"}) is None
    assert num_expert_group(v3, {"model_type": "deepseek_v3", "n_group": None}) is None
    assert num_expert_group(v2, {"model_type": "deepseek_v2", "n_group": 4}) == 4
    assert num_expert_group("MixtralForCausalLM", {"n_group": [2]}) is None  # not read for the others
    with pytest.raises(UnsupportedCheckpointError, match=r"^config.json n_group is \[2\], .*; restore the checkpoint's config.json$"):
        num_expert_group(v3, {"model_type": "deepseek_v3", "n_group": [2]})


@pytest.mark.parametrize("value", [[{"a": 1}], [["LlamaForCausalLM"]], [1], [None], "LlamaForCausalLM", {"a": 1}])
def test_architectures_of_another_json_type_are_refused_naming_them(awq_bundle: Path, damaged_copy, value: object) -> None:  # type: ignore[no-untyped-def]
    """A non-string ``architectures`` entry (``unhashable type`` once): one line naming the field, at every TP/PP."""
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = value
        (d / "config.json").write_text(json.dumps(cfg))

    model = damaged_copy(awq_bundle, edit)
    report = preflight(model, tp_size=2, pp_size=2)
    assert report.decision == "refuse" and "config.json architectures is" in report.ranks[0].message, report.to_dict()
    assert preflight(model, tp_size=2, pp_size=2, fallback=True).decision == "fallback"
