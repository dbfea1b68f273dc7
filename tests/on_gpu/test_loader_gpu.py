"""GPU tests of ``--load-format marlin_prepacked`` against stock vLLM.

For tiny AWQ-4, GPTQ-4, GPTQ-8 and padded checkpoints (FP16, eager, TP=1):

(a) ordinary loading with ``linear_backend="marlin"`` and (b) ``load_format="marlin_prepacked"``
without it must produce close outputs (two prompts, 16 greedy tokens, ``logprobs=5``,
``prompt_logprobs=5``) and bit-identical post-processed parameters, and (b) must log that
vLLM chose MarlinLinearKernel. Stale or mismatched bundles (other TP size, other dtype,
changed source file, edited tensor file) are refused naming the field, and load the
ordinary way with ``{"fallback": true}``.

Each engine runs in its own subprocess (this file run as a script) with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so ``apply_model`` runs in-process (no
serialization of the callable) and every engine starts from a clean GPU and fresh
``*_once`` logs. ``MARLIN_PACK_TEST_ATTN`` picks the attention backend (default TRITON_ATTN).

Run on the GPU machine::

    pip install -e .    # so the vllm.general_plugins entry point exists
    python -m pytest tests/on_gpu/test_loader_gpu.py -m gpu -v
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import ATTN, MAX_TOKENS, PROMPTS, ROOT, TOP

# The first engine on a fresh machine takes ~70 s (vLLM inspects the model class in a subprocess, ~25 s,
# and Triton compiles its kernels in the profile run, ~35 s); later ones ~35-40 s. A stuck engine fails
# its test with its log instead of taking the whole device call.
ENGINE_TIMEOUT_S = int(os.environ.get("MARLIN_PACK_TEST_ENGINE_TIMEOUT_S", "300"))

pytestmark = [
    pytest.mark.gpu,
    # A string: evaluated by pytest at setup, not at import. This file is also the engine
    # subprocess's script, and torch.cuda.is_available() there would poison fork for vLLM's
    # TP workers ("Cannot re-initialize CUDA in forked subprocess") without vLLM noticing.
    pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU"),
]

BASE_KWARGS: dict[str, Any] = dict(
    dtype="float16",
    enforce_eager=True,
    attention_backend=ATTN,
    gpu_memory_utilization=0.05,
    kv_cache_memory_bytes=256 << 20,  # no memory profiling: the engines of other tests may start side by side
    max_model_len=512,
    max_num_seqs=4,
    seed=0,
)
# vLLM's own KV cache sizing (memory snapshot and profile run): only where a test measures it. Its profiling fails
# when another process frees GPU memory meanwhile, so run such a test alone (not in a device.sh --parallel group).
PROFILED: dict[str, Any] = dict(gpu_memory_utilization=0.25, kv_cache_memory_bytes=None)


# --- the engine subprocess --------------------------------------------------------------------


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def _logprobs(positions: Any) -> list[dict[int, float] | None]:
    if positions is None:
        return []
    return [None if p is None else {int(k): float(v.logprob) for k, v in p.items()} for p in positions]


def _engine_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault(
        "VLLM_ALLOW_INSECURE_SERIALIZATION", "1"
    )  # only needed if an engine process is used
    if not any(e.name == "marlin_pack" for e in entry_points(group="vllm.general_plugins")):
        from marlin_pack.vllm_plugin import register  # not installed: register in this process

        register()
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], **spec["kwargs"])
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP, prompt_logprobs=TOP, seed=0)
    outputs = []
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = out.outputs[0]
        outputs.append(
            {
                "token_ids": list(c.token_ids),
                "text": c.text,
                "logprobs": _logprobs(c.logprobs),
                "prompt_token_ids": list(out.prompt_token_ids or []),
                "prompt_logprobs": _logprobs(out.prompt_logprobs),
            }
        )
    params = None
    if spec.get("params"):
        per_rank = llm.apply_model(_params)  # one dict per tensor-parallel worker
        params = per_rank if spec.get("all_ranks") else per_rank[0]
    torch.save({"outputs": outputs, "params": params}, spec["out"])
    print("MARLIN_PACK_ENGINE_OK", flush=True)


def run_engine(
    tmp: Path, model: Path, params: bool = True, all_ranks: bool = False, io: dict[str, Any] | None = None, **kwargs: Any
) -> tuple[int, str, dict | None]:
    """Run one engine in a subprocess; returns (exit code, combined log, results or None). ``io``: an I/O plan
    override (``MARLIN_PACK_IO``) for the engine."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "kwargs": {**BASE_KWARGS, **kwargs},
        "params": params,
        "all_ranks": all_ranks,
        "out": str(tmp / "out.pt"),
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MARLIN_PACK_IO", None)
    if io is not None:
        env["MARLIN_PACK_IO"] = json.dumps(io)
    try:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "engine", str(spec_path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
        )
        code, out, log = proc.returncode, proc.stdout, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # killed: its log so far, for the failing test to show
        code, out = 124, _text(e.stdout)
        log = out + _text(e.stderr) + f"\n[engine killed after {ENGINE_TIMEOUT_S} s]"
    (tmp / "engine.log").write_text(log)
    result = None
    if code == 0 and "MARLIN_PACK_ENGINE_OK" in out:
        result = torch.load(tmp / "out.pt", weights_only=False)
    return code, log, result


def _text(part: str | bytes | None) -> str:
    """A timed-out run's captured output (bytes even with ``text=True``)."""
    if part is None:
        return ""
    return part.decode(errors="replace") if isinstance(part, bytes) else part


# --- comparison (like vLLM's tests/models/utils.py::check_logprobs_close) ----------------------


def check_logprobs_close(outputs_0: list[dict], outputs_1: list[dict], name_0: str, name_1: str) -> None:
    """Greedy outputs agree until the first differing token, and there each engine's token
    is among the other's top logprobs; the same for the prompt's top-1 tokens."""
    assert len(outputs_0) == len(outputs_1) == len(PROMPTS)
    for i, (o0, o1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        assert o0["prompt_token_ids"] == o1["prompt_token_ids"]
        for idx, (t0, t1) in enumerate(zip(o0["token_ids"], o1["token_ids"], strict=False)):
            if t0 != t1:
                msg = (
                    f"prompt {i}: matched tokens {o0['token_ids'][:idx]}\n"
                    f"{name_0}: {o0['text']!r} {o0['logprobs'][idx]}\n"
                    f"{name_1}: {o1['text']!r} {o1['logprobs'][idx]}"
                )
                assert t0 in o1["logprobs"][idx], msg
                assert t1 in o0["logprobs"][idx], msg
                break
        for pos, (p0, p1) in enumerate(zip(o0["prompt_logprobs"], o1["prompt_logprobs"], strict=True)):
            if p0 is None or p1 is None:
                assert p0 is None and p1 is None
                continue
            top0, top1 = max(p0, key=p0.get), max(p1, key=p1.get)
            assert top0 in p1 and top1 in p0, f"prompt {i} position {pos}: {name_0} {p0} vs {name_1} {p1}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_params_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (bitwise, so NaN payloads count too)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, (
            name,
            a[name].shape,
            b[name].shape,
        )
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), name


# --- checkpoints --------------------------------------------------------------------------------


def _write(kind: str, out: Path) -> Path:
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    if kind == "awq4":
        return write_awq_checkpoint(out, PRESETS["tiny"])
    if kind == "gptq4":
        return write_gptq_checkpoint(out, PRESETS["tiny"])
    if kind == "gptq8":
        return write_gptq_checkpoint(out, PRESETS["tiny"], bits=8)
    if kind == "awq4-padded":
        return write_awq_checkpoint(out, PRESETS["tiny-padded"], group_size=32)
    if kind == "gptq4-vocab":  # embedding and head of 20.5 MB each: large common tensors (common_tensors.LARGE_COMMON)
        return write_gptq_checkpoint(out, PRESETS["tiny-vocab"])
    raise ValueError(kind)


KINDS = ["awq4", "gptq4", "gptq8", "awq4-padded"]
CHECKPOINTS = [*KINDS, "gptq4-vocab"]  # the last one only for the tests that name it


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("marlin-pack-gpu")


@pytest.fixture(scope="module")
def checkpoints(workdir: Path) -> dict[str, Path]:
    import marlin_pack

    out = {}
    for kind in CHECKPOINTS:
        d = _write(kind, workdir / kind)
        marlin_pack.convert(d, tp=(1,), dtype="float16", kernel="marlin")
        out[kind] = d
    return out


@pytest.fixture(scope="module")
def ordinary(workdir: Path, checkpoints: dict[str, Path]) -> Callable[[str], dict]:
    """Engine (a) results (ordinary loading, ``linear_backend="marlin"``) per checkpoint, run on first use."""
    cache: dict[str, dict] = {}

    def get(kind: str) -> dict:
        if kind not in cache:
            code, log, result = run_engine(workdir / f"a-{kind}", checkpoints[kind], linear_backend="marlin")
            assert code == 0 and result is not None, log[-4000:]
            assert "Using MarlinLinearKernel" in log, "the reference engine did not use Marlin"
            cache[kind] = result
        return cache[kind]

    return get


# --- tests --------------------------------------------------------------------------------------


def test_entry_point_installed() -> None:
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "marlin_pack"]
    assert eps, "marlin-pack is not installed: run `pip install -e .` so vLLM finds the plugin"
    from marlin_pack.vllm_plugin import register

    assert eps[0].load() is register


@pytest.mark.parametrize("kind", KINDS)
def test_prepacked_matches_ordinary_loading(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict], kind: str
) -> None:
    reference = ordinary(kind)
    code, log, result = run_engine(workdir / f"b-{kind}", checkpoints[kind], load_format="marlin_prepacked")
    assert code == 0 and result is not None, log[-4000:]
    # vLLM itself chose Marlin, without linear_backend being passed; and the loader reports it.
    assert "Using MarlinLinearKernel for mixed-precision linear" in log, log[-4000:]
    assert "quantized layers use MarlinLinearKernel" in log and "marlin-pack: validate" in log, log[-4000:]
    check_logprobs_close(reference["outputs"], result["outputs"], "ordinary", "marlin_prepacked")
    assert_params_identical(reference["params"], result["params"])


def test_a_start_without_stamps_hashes_once_says_so_and_writes_nothing_into_the_bundle(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose user has no stamps for the files it checks (another user converted them, a fresh host)
    hashes them and logs one WARNING line saying how much and how long; the next engine of the same user,
    stamped, hashes nothing. Neither writes into the bundle (a read-only volume is fine); both load the
    parameters ordinary loading holds, bit for bit."""
    import time

    kind = "awq4"
    reference = ordinary(kind)
    model = workdir / "stamps-awq4"
    shutil.copytree(checkpoints[kind], model)  # new inodes: no stamp vouches for any of them
    time.sleep(1.1)  # files changed within the last second are hashed but not stamped (coarse file-system clocks)
    monkeypatch.setenv("MARLIN_PACK_STAMPS", str(workdir / "stamps-store"))
    bundle = model / "marlin-pack"
    before = {p.relative_to(bundle).as_posix(): p.stat().st_mtime_ns for p in bundle.rglob("*")}
    logs = []
    for i in range(2):
        code, log, result = run_engine(workdir / f"stamps-{i}", model, load_format="marlin_prepacked")
        assert code == 0 and result is not None, log[-4000:]
        assert_params_identical(reference["params"], result["params"])
        logs.append([ln for ln in log.splitlines() if "marlin-pack: rank 0 hashed" in ln])
    print("first start:", logs[0])
    # the rank file and the common file hashed (the checkpoint is sampled)
    assert len(logs[0]) == 1 and "WARNING" in logs[0][0].split("marlin-pack:")[0] and "(2 files)" in logs[0][0], logs[0]
    assert "stamped in " + str(workdir / "stamps-store") in logs[0][0], logs[0]
    assert logs[1] == [], logs[1]
    assert {p.relative_to(bundle).as_posix(): p.stat().st_mtime_ns for p in bundle.rglob("*")} == before


def test_preload_page_locks_ahead_and_sizes_the_kv_cache_as_without(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict]
) -> None:
    """``preload`` (the default): the worker starts copy helpers as it sets up, they page-lock the bundle before
    the copy and the loader takes them; the same parameters as ordinary loading, and the KV cache vLLM sizes
    from its memory snapshot and profile run is the one an engine gets with the option off (the helpers'
    contexts are in both measurements, then they are stopped)."""
    import re

    kind = "gptq4-vocab"
    reference = ordinary(kind)
    kv: dict[bool, float] = {}
    for on in (True, False):
        code, log, result = run_engine(
            workdir / f"engine-preload-{on}", checkpoints[kind], load_format="marlin_prepacked",
            model_loader_extra_config={"preload": on}, io={"mode": "helpers", "preload": on},  # helpers, wherever /tmp is
            **PROFILED,
        )
        assert code == 0 and result is not None, log[-4000:]
        assert ("while vLLM sets up its GPU worker" in log) is on, log[-4000:]
        assert (re.search(r"[0-9.]+ [GM]B of the bundle page-locked in 4 copy helpers", log) is not None) is on, log[-4000:]
        assert ("let go of this process's memory and the pages" in log) is on, log[-4000:]
        assert "did not start" not in log and "no copy helper started" not in log, log[-4000:]
        found = re.search(r"Available KV cache memory: ([0-9.]+) GiB", log)
        assert found is not None, log[-4000:]
        kv[on] = float(found.group(1))
        check_logprobs_close(reference["outputs"], result["outputs"], "ordinary", f"marlin_prepacked preload {on}")
        assert_params_identical(reference["params"], result["params"])
    # Four helper contexts are ~2 GiB: counted at one measurement and not the other, the KV cache would differ by that.
    assert abs(kv[True] - kv[False]) < 0.25, kv


def test_the_machines_plan_is_logged_and_matches_ordinary_loading(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict]
) -> None:
    """No override: the loader logs the plan it made from the machine, and loads the same parameters."""
    kind = "awq4-padded"
    reference = ordinary(kind)
    code, log, result = run_engine(workdir / "io-default", checkpoints[kind], load_format="marlin_prepacked")
    assert code == 0 and result is not None, log[-4000:]
    assert "marlin-pack: I/O plan " in log, log[-4000:]
    check_logprobs_close(reference["outputs"], result["outputs"], "ordinary", "marlin_prepacked, the machine's plan")
    assert_params_identical(reference["params"], result["params"])


@pytest.mark.parametrize(
    "io",
    [
        {"mode": "helpers", "helpers": 2, "preload": False},  # the loader's own helpers
        {"mode": "helpers", "helpers": 2, "defer_unregister": True, "preload": False},
        {"mode": "registered"},
        {"mode": "staged"},
    ],
    ids=["helpers", "helpers-deferred", "registered", "staged"],
)
def test_prepacked_io_plans_match_ordinary_loading(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict], io: dict[str, Any]
) -> None:
    """Each way of the I/O plan inside an engine: the same parameters, bit for bit; with helpers they copied
    everything (nothing was left to the engine's process)."""
    kind = "awq4-padded"
    reference = ordinary(kind)
    code, log, result = run_engine(
        workdir / f"io-{'-'.join(map(str, io.values()))}", checkpoints[kind], load_format="marlin_prepacked", io=io
    )
    assert code == 0 and result is not None, log[-4000:]
    assert f"I/O plan {io['mode']}:" in log and f", io {io['mode']}," in log, log[-4000:]  # not "helpers/registered"
    assert "copy helpers:" not in log and "no copy helper started" not in log, log[-4000:]
    check_logprobs_close(reference["outputs"], result["outputs"], "ordinary", f"marlin_prepacked {io}")
    assert_params_identical(reference["params"], result["params"])


@pytest.mark.parametrize(
    "io",
    # In this process (the rank file, then the common tensors, on its reader threads), by helpers (one job per
    # helper holding both files), the same with deferred unregistering (the pages of both kept until the reply).
    [
        {"common_during_build": True, "mode": "staged"},
        {"common_during_build": True, "mode": "helpers", "helpers": 2, "preload": False},
        {"common_during_build": True, "mode": "helpers", "helpers": 2, "defer_unregister": True, "preload": False},
    ],
    ids=["staged", "helpers", "helpers-deferred"],
)
def test_common_tensors_copied_beside_the_construction_match_ordinary_loading(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict], io: dict[str, Any]
) -> None:
    """Common tensors beside the construction (a daemon fill's plan): the embedding and the head are copied
    beside vLLM's construction (into tensors their parameters are then pointed at); the engine holds the same
    parameters, bit for bit."""
    kind = "gptq4-vocab"
    reference = ordinary(kind)
    code, log, result = run_engine(
        workdir / f"common-{'-'.join(map(str, io.values()))}", checkpoints[kind], load_format="marlin_prepacked", io=io
    )
    assert code == 0 and result is not None, log[-4000:]
    assert "(2 of its names copied beside the construction)" in log, log[-4000:]
    check_logprobs_close(reference["outputs"], result["outputs"], "ordinary", f"marlin_prepacked {io}")
    assert_params_identical(reference["params"], result["params"])


@pytest.mark.parametrize("kind", KINDS)
def test_bundle_equals_stock_vllm_after_loading(
    checkpoints: dict[str, Path], ordinary: Callable[[str], dict], kind: str
) -> None:
    """Issue acceptance: every tensor of the TP=1 bundle equals what stock vLLM holds after loading
    the same checkpoint with linear_backend="marlin", bit for bit (read in-process via apply_model)."""
    from safetensors.torch import load_file

    params = ordinary(kind)["params"]
    bundle = load_file(checkpoints[kind] / "marlin-pack" / "tp1" / "rank-0.safetensors")
    for name, t in bundle.items():
        assert name in params, f"{name} not held by vLLM"
        p = params[name]
        assert p.dtype == t.dtype and p.shape == t.shape, (name, p.shape, t.shape)
        assert torch.equal(_bytes(p), _bytes(t)), f"{name} differs from stock vLLM"
    engine_quantized = {n.rsplit(".", 1)[0] for n in params if n.endswith(".qweight")}
    assert engine_quantized == {n.rsplit(".", 1)[0] for n in bundle if n.endswith(".qweight")}
    from marlin_pack.vllm_plugin import releases
    from marlin_pack.vllm_plugin.version_guard import vllm_version

    if kind.startswith("gptq"):  # Marlin's empty zero points: qzeros up to 0.33, w_zp from 0.34 (qzeros retired)
        empty = "w_zp" if releases.release(vllm_version()).finish == "w_zp" else "qzeros"  # type: ignore[union-attr]
        assert all(params[f"{layer}.{empty}"].numel() == 0 for layer in engine_quantized)
    print(f"{kind}: {len(bundle)} bundle tensors bit-identical to stock vLLM {vllm_version()}")


def _flip_sampled_byte(path: Path) -> None:
    """Change one byte a start samples (marlin_pack.io.sampling), like another quantization of the model would."""
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.io.sampling import sample_spans

    offset, length = sample_spans(read_header(path))[0]
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        b = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _flip_qweight_byte(path: Path) -> None:
    """Change one byte inside a packed-weight tensor (any int32 word is valid data), like an edit would."""
    from marlin_pack.io.safetensors_io import read_header

    info = next(i for n, i in sorted(read_header(path).tensors.items()) if n.endswith(".qweight"))
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(info.start + info.nbytes // 2)
        b = f.read(1)
        f.seek(info.start + info.nbytes // 2)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _mismatch(case: str, src: Path, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint (copy) whose bundle does not fit the engine, and the engine kwargs."""
    import marlin_pack

    model = Path(shutil.copytree(src, tmp / "ckpt", copy_function=shutil.copy2))
    if case == "tp_size":
        marlin_pack.convert(model, tmp / "bundle-tp2", tp=(2,), dtype="float16", kernel="marlin")
        return model, {"model_loader_extra_config": {"bundle": str(tmp / "bundle-tp2")}}
    if case == "serving_dtype":
        return model, {"dtype": "bfloat16"}
    if case == "source.sample":  # a checkpoint whose tensors hold other bytes: its samples differ
        _flip_sampled_byte(model / "model.safetensors")
        return model, {}
    if case == "files":
        _flip_qweight_byte(model / "marlin-pack" / "tp1" / "rank-0.safetensors")
        return model, {}
    raise ValueError(case)


MISMATCHES = ["tp_size", "serving_dtype", "source.sample", "files"]


@pytest.mark.parametrize("case", MISMATCHES)
def test_mismatched_bundle_is_refused(workdir: Path, checkpoints: dict[str, Path], case: str) -> None:
    tmp = workdir / f"refuse-{case}"
    model, kwargs = _mismatch(case, checkpoints["awq4"], tmp)
    code, log, _ = run_engine(tmp / "engine", model, params=False, load_format="marlin_prepacked", **kwargs)
    assert code != 0, log[-4000:]
    assert "marlin-pack cannot serve" in log and f"[{case}]" in log, log[-4000:]
    assert '"fallback": true' in log


@pytest.mark.parametrize("case", ["tp_size", "source.sample"])  # the same code path for every field
def test_mismatched_bundle_falls_back(
    workdir: Path, checkpoints: dict[str, Path], ordinary: Callable[[str], dict], case: str
) -> None:
    tmp = workdir / f"fallback-{case}"
    model, kwargs = _mismatch(case, checkpoints["awq4"], tmp)
    extra = {**kwargs.pop("model_loader_extra_config", {}), "fallback": True}
    code, log, result = run_engine(
        tmp / "engine",
        model,
        params=False,
        load_format="marlin_prepacked",
        model_loader_extra_config=extra,
        **kwargs,
    )
    assert code == 0 and result is not None, log[-4000:]
    assert "marlin-pack: not using the bundle" in log and f"[{case}]" in log, log[-4000:]
    assert "marlin-pack: validate" not in log  # nothing was placed from the bundle
    assert all(len(o["token_ids"]) == MAX_TOKENS for o in result["outputs"])
    if case in ("tp_size", "files"):  # same checkpoint and dtype as the reference: same answers
        check_logprobs_close(ordinary("awq4")["outputs"], result["outputs"], "ordinary", f"fallback-{case}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        _engine_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} engine SPEC.json")
