"""TP=2 on two GPUs: ordinary loading, ``marlin_prepacked`` and the weight-cache daemon agree, rank by rank.

Needs two GPUs (``nvidia-h200-x2``). Tiny checkpoints, FP16, eager, ``tensor_parallel_size=2``,
bundles converted with ``--tp 2`` (and ``--tp 1``, for the refusal):

===================  =====================================================================
kind                 covers
===================  =====================================================================
awq4, gptq4, gptq8   g64, 2 KV heads: one KV head per rank
awq4-kv1             g64, 1 KV head: replicated on both ranks
gptq4-padded-tp2     g32, 6 heads / 2 KV heads, intermediate 704: aligned at TP=1, but each
                     rank's o_proj (K=192) and down_proj (K=352) need Marlin padding
===================  =====================================================================

Two module fixtures, each starting its engines side by side (subprocesses with their own
rendezvous ports and a fixed KV-cache size, see ``_harness.Cluster``) and stopping
them before the tests read the results:

- ``loader``: per kind an ordinary engine (``linear_backend="marlin"``) and a
  ``load_format="marlin_prepacked"`` engine; plus one engine offered only a TP=1 bundle.
- ``daemon``: per daemon kind a TP=2 ``marlin-pack daemon`` filled from the bundle, an ordinary
  engine and two ``ipc_cache`` engines attached with ``fallback: false``.

Every engine reports, per rank, the sha256 of every parameter's bytes: "bit-identical" below
means equal digests, dtypes and shapes. Outputs are compared like vLLM's
``check_logprobs_close`` (2 prompts x 16 greedy tokens, top-5 sample and prompt logprobs).

Run on the GPU machine (``-k loader`` / ``-k daemon`` select one half)::

    bash tests/on_gpu/device.sh tests/on_gpu/test_tp2_gpu.py
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from _harness import Cluster, Proc, attach_config, check_logprobs_close, wait_socket

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

TP = 2
KINDS = ["awq4", "gptq4", "gptq8", "awq4-kv1", "gptq4-padded-tp2"]
DAEMON_KINDS = ["awq4-kv1", "gptq4"]


def _write(kind: str, out: Path) -> Path:
    """A tiny checkpoint of ``kind`` with bundles for TP 1 and 2."""
    from marlin_pack import convert
    from marlin_pack.testing.synthetic import PRESETS, ModelShape, write_awq_checkpoint, write_gptq_checkpoint

    tiny = PRESETS["tiny"]
    if kind == "awq4":
        d = write_awq_checkpoint(out, tiny, group_size=64)
    elif kind == "gptq4":
        d = write_gptq_checkpoint(out, tiny, group_size=64)
    elif kind == "gptq8":
        d = write_gptq_checkpoint(out, tiny, bits=8, group_size=64)
    elif kind == "awq4-kv1":
        d = write_awq_checkpoint(out, ModelShape(num_key_value_heads=1), group_size=64)
    elif kind == "gptq4-padded-tp2":
        shape = ModelShape(
            hidden_size=384, intermediate_size=704, num_attention_heads=6, num_key_value_heads=2
        )
        d = write_gptq_checkpoint(out, shape, group_size=32)
    else:
        raise ValueError(kind)
    convert(d, tp=(1, TP), dtype="float16", kernel="marlin")
    return d


def _bundle_digests(model: Path, rank: int) -> dict[str, list[Any]]:
    """``[dtype, shape, sha256]`` of every tensor of this rank's TP=2 bundle file."""
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(model / "marlin-pack" / f"tp{TP}" / f"rank-{rank}.safetensors").items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(data).hexdigest()]
    return out


def _tp2_engine(cluster: Cluster, procs: dict[str, Proc], name: str, model: Path, **kwargs: Any) -> None:
    """Start a TP=2 engine that reports every parameter's digest, as ``procs[name]``."""
    procs[name] = cluster.engine(name, model, digests=True, tensor_parallel_size=TP, **kwargs)


def assert_ranks_identical(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    """Both engines have TP ranks, and every parameter of every rank is bit-identical."""
    assert len(ref["ranks"]) == len(got["ranks"]) == TP, what
    for rank in range(TP):
        a, b = ref["ranks"][rank]["digests"], got["ranks"][rank]["digests"]
        assert a.keys() == b.keys(), (what, rank, sorted(a.keys() ^ b.keys()))
        differ = sorted(n for n in a if a[n] != b[n])
        assert not differ, f"{what}: rank {rank} parameters differ: {differ}"


@dataclass
class Started:
    procs: dict[str, Proc]
    results: dict[str, dict[str, Any]]
    models: dict[str, Path]


def _collect(procs: dict[str, Proc], wait: list[str]) -> dict[str, dict[str, Any]]:
    results = {}
    for key in wait:
        res = procs[key].result()
        assert res is not None, procs[key].tail()
        results[key] = res
    return results


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp2-models")
    return {kind: _write(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def loader(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Started]:
    workdir = tmp_path_factory.mktemp("tp2-loader")
    cluster = Cluster(workdir, logs="tp2-loader-logs", port=21000)
    tp1_only = workdir / "tp1-bundle"
    from marlin_pack import convert

    convert(models["awq4"], tp1_only, tp=(1,), dtype="float16", kernel="marlin")
    try:
        procs: dict[str, Proc] = {}
        for kind, model in models.items():
            _tp2_engine(cluster, procs, f"{kind}-ordinary", model, linear_backend="marlin")
            _tp2_engine(cluster, procs, f"{kind}-prepacked", model, load_format="marlin_prepacked")
        procs["refused"] = cluster.engine(
            "tp1-bundle-tp2-engine",
            models["awq4"],
            tensor_parallel_size=TP,
            load_format="marlin_prepacked",
            model_loader_extra_config={"bundle": str(tp1_only)},
        )
        results = _collect(procs, [k for k in procs if k != "refused"])
        procs["refused"].wait_exit()
        yield Started(procs, results, models)
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Started]:
    workdir = tmp_path_factory.mktemp("tp2-daemon")
    cluster = Cluster(workdir, logs="tp2-daemon-logs", port=23000)
    try:
        procs: dict[str, Proc] = {}
        sdirs = {kind: cluster.socket_dir() for kind in DAEMON_KINDS}
        for kind in DAEMON_KINDS:
            model = models[kind]
            procs[f"{kind}-daemon"] = cluster.daemon(
                f"{kind}-daemon", model, sdirs[kind], "--tensor-parallel-size", str(TP)
            )
            _tp2_engine(cluster, procs, f"{kind}-ordinary", model, linear_backend="marlin")
            for start in ("attach1", "attach2"):
                _tp2_engine(
                    cluster,
                    procs,
                    f"{kind}-{start}",
                    model,
                    load_format="ipc_cache",
                    model_loader_extra_config=attach_config(sdirs[kind]),
                )
        for kind in DAEMON_KINDS:
            assert wait_socket(procs[f"{kind}-daemon"], sdirs[kind]), procs[f"{kind}-daemon"].tail()
        results = _collect(procs, [k for k in procs if not k.endswith("-daemon")])
        yield Started(procs, results, models)
    finally:
        cluster.stop()


# --- loader ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_loader_tp2_prepacked_matches_ordinary(loader: Started, kind: str) -> None:
    ref, got = loader.results[f"{kind}-ordinary"], loader.results[f"{kind}-prepacked"]
    log = loader.procs[f"{kind}-prepacked"].log()
    assert "Using MarlinLinearKernel" in loader.procs[f"{kind}-ordinary"].log()
    assert "Using MarlinLinearKernel" in log and "marlin-pack: validate" in log, loader.procs[
        f"{kind}-prepacked"
    ].tail()
    check_logprobs_close(ref["outputs"], got["outputs"], "ordinary", "marlin_prepacked")
    assert_ranks_identical(ref, got, kind)
    exact = ref["outputs"] == got["outputs"]
    n = sum(len(r["digests"]) for r in got["ranks"])
    print(f"{kind}: TP=2, {n} parameters on 2 ranks bit-identical; outputs and logprobs identical: {exact}")


@pytest.mark.parametrize("kind", KINDS)
def test_loader_tp2_bundle_equals_stock_vllm_per_rank(loader: Started, kind: str) -> None:
    ref = loader.results[f"{kind}-ordinary"]
    total = 0
    bundles = [_bundle_digests(loader.models[kind], rank) for rank in range(TP)]
    for rank, bundle in enumerate(bundles):
        engine = ref["ranks"][rank]["digests"]
        assert bundle, rank
        for name, want in bundle.items():
            assert name in engine, f"rank {rank}: {name} not held by vLLM"
            assert engine[name] == want, f"rank {rank}: {name} differs from stock vLLM"
        quantized = {n.rsplit(".", 1)[0] for n in engine if n.endswith(".qweight")}
        assert quantized == {n.rsplit(".", 1)[0] for n in bundle if n.endswith(".qweight")}
        total += len(bundle)
    assert bundles[0] != bundles[1]  # each rank holds its own shard
    print(f"{kind}: {total} bundle tensors (2 ranks) bit-identical to stock vLLM at TP=2")


def test_loader_tp1_bundle_refused_by_tp2_engine(loader: Started) -> None:
    proc = loader.procs["refused"]
    log = proc.log()
    assert proc.popen.returncode not in (None, 0), proc.tail()
    assert "marlin-pack cannot serve" in log and "[tp_size]" in log, proc.tail()
    assert "tensor_parallel_size=2" in log, proc.tail()
    line = next(ln for ln in log.splitlines() if "[tp_size]" in ln)
    print(f"refused: {line.strip()[:300]}")


# --- daemon ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", DAEMON_KINDS)
def test_daemon_tp2_attached_engines_match_ordinary(daemon: Started, kind: str) -> None:
    ref = daemon.results[f"{kind}-ordinary"]
    for start in ("attach1", "attach2"):
        proc, got = daemon.procs[f"{kind}-{start}"], daemon.results[f"{kind}-{start}"]
        log = proc.log()
        assert "from the weight cache daemon (zero_copy mode)" in log and "falling back" not in log, (
            proc.tail()
        )
        check_logprobs_close(ref["outputs"], got["outputs"], "ordinary", start)
        assert_ranks_identical(ref, got, f"{kind} {start}")
        for rank, info in enumerate(got["ranks"]):  # every weight mapped from the daemon, none allocated
            assert info["params_in_own_memory"] == 0 and info["params"] > 0, (start, rank, info["params"])
    exact = all(daemon.results[f"{kind}-{s}"]["outputs"] == ref["outputs"] for s in ("attach1", "attach2"))
    print(
        f"{kind}: TP=2 daemon, two ipc_cache engines bit-identical to ordinary on both ranks; "
        f"outputs identical: {exact}"
    )


@pytest.mark.parametrize("kind", DAEMON_KINDS)
def test_daemon_tp2_filled_from_the_bundle(daemon: Started, kind: str) -> None:
    proc = daemon.procs[f"{kind}-daemon"]
    log = proc.log()
    assert "not using the bundle" not in log, proc.tail()
    for rank in range(TP):
        assert f"daemon rank {rank} filled its model in" in log, proc.tail()
        assert f"rank-{rank}.safetensors for tp {TP} rank {rank}" in log, proc.tail()
