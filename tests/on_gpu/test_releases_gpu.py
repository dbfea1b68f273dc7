"""GPU: on whichever supported vLLM release runs, vLLM's default engine and ``marlin_prepacked`` hold bit-identical
parameters and generate the same tokens and logprobs; and one bundle, converted once, serves every release.

The cases cover Machete and Marlin layers (vLLM's own choice on SM90: Machete where it can, Marlin for group size 32)
and AWQ, GPTQ 8-bit and compressed-tensors asymmetric checkpoints; ``test_moe_gpu.py`` covers experts.

``MARLIN_PACK_XREL_DIR``: a folder kept between runs on several releases (the device machine's /tmp while it stays
warm). The first run writes each checkpoint and converts it there; later runs, on other releases, load that same
bundle without converting, and compare the parameters they load with every earlier release's (the digests are kept
there as ``CASE.digests-RELEASE.json``). Without it each run converts into its own temporary folder.

Run on the GPU machine: ``bash tests/on_gpu/device.sh tests/on_gpu/test_releases_gpu.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _harness import assert_engines_identical, ordinary_and_prepacked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYER = "model.layers.0.self_attn.qkv_proj"
MACHETE, MARLIN = "MacheteLinearKernel", "MarlinLinearKernel"
# case -> (format, bits, group size, the bundle's kernel, the kernel vLLM's default picks for LAYER on SM90)
CASES = {
    "awq4-g128": ("awq", 4, 128, "machete", MACHETE),
    "gptq8-g128": ("gptq", 8, 128, "machete", MACHETE),
    "ct4-asym-g64": ("ct-asym", 4, 64, "machete", MACHETE),
    "gptq4-g32": ("gptq", 4, 32, "machete", MARLIN),  # Machete takes group sizes -1/64/128 only: Marlin layers
}


def _release() -> str:
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    return vllm_version()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    kept = os.environ.get("MARLIN_PACK_XREL_DIR")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
        return Path(kept)
    return tmp_path_factory.mktemp("releases-gpu")


def _checkpoint_and_bundle(workdir: Path, case: str) -> tuple[Path, bool]:
    """The case's checkpoint with its bundle; True when both were made by an earlier run (on another release)."""
    import marlin_pack
    from marlin_pack.testing.synthetic import (
        PRESETS,
        write_awq_checkpoint,
        write_compressed_tensors_checkpoint,
        write_gptq_checkpoint,
    )

    fmt, bits, group, kernel, _ = CASES[case]
    out = workdir / case
    if (out / "marlin-pack" / "manifest.json").is_file():
        return out, True
    if fmt == "awq":
        write_awq_checkpoint(out, PRESETS["tiny"], group_size=group)
    elif fmt.startswith("ct"):
        write_compressed_tensors_checkpoint(out, PRESETS["tiny"], bits=bits, group_size=group, symmetric=fmt == "ct")
    else:
        write_gptq_checkpoint(out, PRESETS["tiny"], bits=bits, group_size=group)
    marlin_pack.convert(out, tp=(1,), kernel=kernel)
    return out, False


def _bundle_layers(model: Path) -> set[str]:
    from marlin_pack.bundle.reader import read_manifest

    return {e.name for e in read_manifest(model / "marlin-pack").tensor_parallel[0].layers}


@pytest.mark.parametrize("case", list(CASES))
def test_default_engine_and_prepacked_agree_and_one_bundle_serves_every_release(workdir: Path, case: str) -> None:
    from marlin_pack.bundle.reader import read_manifest

    model, reused = _checkpoint_and_bundle(workdir, case)
    manifest_bytes = (model / "marlin-pack" / "manifest.json").read_bytes()
    kernel = CASES[case][-1]
    dtype = read_manifest(model / "marlin-pack").serving_dtype.value
    a, b = ordinary_and_prepacked(workdir, f"{case}-{_release()}", model, LAYER, vllm_default=True, dtype=dtype)
    n = assert_engines_identical(a, b, LAYER, kernel)
    assert (model / "marlin-pack" / "manifest.json").read_bytes() == manifest_bytes  # loading never rewrites it
    digests = b["layers"]["digests"]
    (workdir / f"{case}.digests-{_release()}.json").write_text(json.dumps(digests, sort_keys=True))
    others = {p.name.split(".digests-")[1][: -len(".json")]: json.loads(p.read_text())
              for p in workdir.glob(f"{case}.digests-*.json") if not p.name.endswith(f"-{_release()}.json")}
    bundle_params = {n for n in digests if n.rsplit(".", 1)[0] in _bundle_layers(model)
                     and n.rsplit(".", 1)[1] in ("qweight", "weight_packed", "scales", "weight_scale")}
    assert bundle_params, "no prepacked layer among the parameters"
    for release, theirs in others.items():
        # vLLM's own parameters may come and go between releases (attention scales, leaves a release retires): the
        # bundle's layers must be in both, and every parameter both hold must hold the same bytes
        assert bundle_params <= theirs.keys(), f"vLLM {release} lacks {sorted(bundle_params - theirs.keys())[:4]}"
        common = digests.keys() & theirs.keys()
        assert [k for k in common if digests[k] != theirs[k]] == [], f"vLLM {release} loaded other bytes"
        if common != digests.keys() | theirs.keys():
            print(f"{case}: parameters of vLLM {_release()} only: {sorted(digests.keys() - theirs.keys())}; "
                  f"of vLLM {release} only: {sorted(theirs.keys() - digests.keys())}")
    print(f"{case} on vLLM {_release()}: {n} parameters bit-identical to vLLM's default engine ({LAYER} on {kernel}), "
          f"tokens and logprobs equal; bundle {'converted by an earlier run, reused' if reused else 'converted here'}; "
          f"same parameters as on vLLM {', '.join(sorted(others)) or '(no other release yet)'}; "
          f"start {a['start_s']:.1f} s default vs {b['start_s']:.1f} s prepacked")
