"""Bundles streamed from a bucket, against vLLM's ``runai_streamer`` from the same bucket and the local-disk start, in one
sitting (the GPU acceptance of bundles in object storage).

Runs on a GPU machine with vLLM and marlin-pack's ``s3`` extra (boto3, ``runai-model-streamer[s3]``), no network needed:

    python benchmarks/bench_remote.py --preset llama-70b --layers 40 --workdir /tmp/remote --bucket-root /dev/shm/marlin-s3

On the device machine, in one call carrying ``.device-carry-s3`` (the extra's wheels; docs/development.md says how they
are made and how long the sitting takes), after vLLM's carry is unpacked into /tmp/site:

    bash benchmarks/on_device.sh --wheels .device-carry-s3 benchmarks/bench_remote.py --preset llama-70b --layers 40 \
        --workdir /tmp/remote --bucket-root /dev/shm/marlin-s3 --deadline-s 420

In order:

1. a synthetic checkpoint (``--format``, drawn on the GPU) in ``--workdir`` (the local disk), converted
   (``convert --device cuda --kernel KERNEL``) into its bundle at its default place, ``MODEL/marlin-pack``;
2. a local S3 server over ``--bucket-root`` (:mod:`marlin_pack.testing.s3_file_server`, a process of its own: files on
   tmpfs served with ``sendfile``; moto keeps objects in memory and is too slow for tens of GB), bucket ``bench``;
   the raw checkpoint placed in it (``MODEL/checkpoint``, as ``aws s3 sync`` would leave it: a copy, or hard links
   on the same file system), the bundle published with ``marlin-pack push`` (``--push upload``: every object through
   the server, timed) or placed (``--push place``: the data objects copied in with their manifest digests as metadata,
   then ``push`` proves the bundle and writes only the manifest and the publication record);
3. engines one per process (the engine harness, :mod:`marlin_pack.testing.engine_harness`), each row vLLM's "Model
   loading took" and GB/s, the bytes the server sent meanwhile beside it:

   * ``bucket-prepacked``: ``--load-format marlin_prepacked``, ``{"bundle": "s3://bench/MODEL/bundle", "fallback":
     false}`` (MODEL_DIR local: config, tokenizer, the checkpoint it was made from);
   * ``bucket-runai``: vLLM's own ``--load-format runai_streamer`` of ``s3://bench/MODEL/checkpoint`` (the raw
     checkpoint, post-processed at load); left out, said why, where ``runai_model_streamer`` is not importable;
   * ``local-ordinary``: vLLM's default load of the checkpoint from ``--workdir``;
   * ``local-prepacked``: ``marlin_prepacked`` from the bundle in ``--workdir``.

   ``--local-cache cold`` (default) empties the page cache of the local files before each local row (a fresh node);
   ``warm`` reads them first; ``cold,warm`` runs each local row twice. The bucket is on tmpfs: served from memory, as
   a store's cache would.
4. untimed, after both prepacked loads: every parameter's digest (sha256, the harness's) of the bucket load equals the
   local load's; the sitting fails otherwise. Tokens of every engine are compared too.

The summary is a markdown table for docs/performance.md, then ``RESULT {json}``. With ``$OUT`` set, the engines' and
the server's logs go to ``$OUT/bench-remote-logs.tgz``. ``--deadline-s N`` starts no row after N seconds (those left
are named); the summary still prints.

``--dry-run`` runs all of it but the GPU engines, on the CPU (any machine, a tiny preset): the checkpoint drawn and
converted on the CPU, the server, the placement and the push, then for each row, in a process of its own, the reads its
engine's loader makes: the bundle's rank through marlin-pack's remote reader (the record, the manifest, every block
verified) and from the local files; the checkpoint through vLLM's ``runai_streamer`` calls (its config pulled, its
files listed, ``runai_safetensors_weights_iterator``) and from the local files; the digests of what each read compared
as the GPU sitting compares the engines'::

    python benchmarks/bench_remote.py --dry-run --preset tiny --kernel marlin --workdir /tmp/bench-remote-dry
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sitting_guard
from bench_load import LOAD_RE  # this folder is on sys.path when run as a script
from sitting_guard import BUNDLE_RATIO, check_room, checkpoint_bytes, same_file_system

from marlin_pack.testing.engine_harness import START_TIMEOUT_S, Cluster, Proc
from marlin_pack.testing.s3_file_server import STATS_PATH, client_env, place, place_tree

BUCKET = "bench"
ROWS = ("bucket-prepacked", "bucket-runai", "local-ordinary", "local-prepacked")
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1"}  # on top of the harness's process environment

# --dry-run: what each row's loader reads, in a process of its own; prints RESULT {seconds, bytes, digests}.
DRY_CHILD = r"""
import hashlib, json, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file
what, target = sys.argv[1:3]
def digest(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
if what == 'checkpoint-bucket':  # vLLM's own functions, imported before the clock starts (as in an engine)
    from vllm.model_executor.model_loader.weight_utils import runai_safetensors_weights_iterator
    from vllm.transformers_utils.runai_utils import ObjectStorageModel, list_safetensors
from marlin_pack.bundle.reader import read_manifest
from marlin_pack.remote.bundle import open_remote, plan_rank
from marlin_pack.remote.stream import HostSink, read_rank
digests, nbytes, lines = {}, 0, []
t0 = time.perf_counter()
if what == 'bundle-bucket':  # the loader's remote read: record, manifest, headers, this rank's blocks, each verified
    plan = plan_rank(open_remote(target), 1, 0)
    sink = HostSink(plan)
    done = read_rank(plan, sink)
    for path in done.bytes_read:
        digests.update({f'{path}:{n}': digest(t) for n, t in sink.tensors(path).items()})
    nbytes = done.total
    lines.append(f'streamed {plan.text()}: {done.blocks} blocks verified')
elif what == 'bundle-local':  # the local bundle's files of TP 1
    manifest = read_manifest(Path(target))
    for entry in [manifest.common, *(r.file for r in manifest.tensor_parallel_set(1).ranks)]:
        digests.update({f'{entry.path}:{n}': digest(t) for n, t in load_file(Path(target) / entry.path).items()})
        nbytes += entry.size
elif what == 'checkpoint-bucket':  # vLLM's runai_streamer: config pulled (ModelConfig), files listed, tensors streamed
    pulled = ObjectStorageModel(url=target)
    pulled.pull_files(target, allow_pattern=['*.model', '*.py', '*.json'])
    files = list_safetensors(path=target)
    lines.append(f'pulled {sorted(p.name for p in Path(pulled.dir).iterdir())}; streamed {len(files)} files')
    for name, t in runai_safetensors_weights_iterator(files, False):
        digests[name] = digest(t)
        nbytes += t.numel() * t.element_size()
else:  # checkpoint-local
    for f in sorted(Path(target).glob('*.safetensors')):
        digests.update({n: digest(t) for n, t in load_file(f).items()})
        nbytes += f.stat().st_size
seconds = time.perf_counter() - t0
print('RESULT ' + json.dumps({'seconds': seconds, 'bytes': nbytes, 'digests': digests, 'lines': lines}))
"""


@dataclass
class Row:
    """One start: what it loads and from where, and what it measured."""

    key: str  # "bucket-prepacked", "local-ordinary cold", ...
    model: str
    kwargs: dict[str, Any]
    env: dict[str, str]
    nbytes: int  # what the start reads: the bundle's or the checkpoint's files
    digests: bool
    dry: tuple[str, str]  # --dry-run: the reads of DRY_CHILD
    cache: str = ""  # local rows: cold or warm
    seconds: float | None = None
    fetched: int | None = None  # bytes the server sent during the row
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class Server:
    """The S3 file server in a process of its own (its log beside the engines')."""

    def __init__(self, procs: Cluster, root: Path) -> None:
        argv = [sys.executable, "-m", "marlin_pack.testing.s3_file_server", str(root), "--bucket", BUCKET]
        self.proc: Proc = procs.start("s3-file-server", argv, procs.env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"s3-file-server: (http://\S+)", self.proc.log())
            if m:
                self.endpoint = m.group(1)
                return
            if not self.proc.alive:
                break
            time.sleep(0.05)
        raise SystemExit(f"the S3 file server did not start:\n{self.proc.tail(3000)}")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.endpoint + STATS_PATH, timeout=10) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]


def _size(n: float) -> str:
    """Bytes as GB (MB below 0.1 GB: the dry run's tiny files)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _rate(n: float, seconds: float) -> str:
    return _size(n / seconds) + "/s" if seconds > 0 else "-"


def _files_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def _loader_lines(log: str) -> list[str]:
    """The loaders' own lines of an engine's log: marlin-pack's (decision, copy or stream) and Run:ai's streamer's."""
    out = []
    for line in log.splitlines():
        for mark in ("marlin-pack: ", "[RunAI Streamer]"):
            if mark in line and "Traceback" not in line:
                out.append(line[line.index(mark):][:400])
    return out


def _cache(paths: list[Path], how: str) -> str:
    """Empty (``cold``) or fill (``warm``) the page cache of ``paths``' files; the cached fraction after."""
    from marlin_pack.io.residency import cached_fraction, drop_cached

    for p in paths:
        if how == "cold":
            drop_cached(p)  # this file only (fadvise): the machine's other files keep their pages
        else:
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass
    total = _files_bytes(paths) or 1
    cached = sum((cached_fraction(p) or 0.0) * p.stat().st_size for p in paths) / total
    return f"{cached:.0%} of its files in the page cache"


def _run_engine(row: Row, procs: Cluster, name: str, timeout: float) -> None:
    proc = procs.engine(name, row.model, digests=row.digests, env={**ENV, **row.env}, **row.kwargs)  # type: ignore[arg-type]
    try:
        result = proc.result(timeout=timeout)
    finally:
        procs.stop()
    log = proc.log()
    if result is None:
        sys.stderr.write(proc.tail(6000))
        raise RuntimeError(f"{row.key} engine failed (log {proc.log_path})")
    m = re.search(LOAD_RE, log)
    if m is None:
        raise RuntimeError(f"{row.key}: no 'Model loading took' line in the engine's log ({proc.log_path})")
    row.seconds = float(m.group(2))
    row.result = {
        "tokens": [o["token_ids"] for o in result["outputs"]],
        "kernel": sorted({k["kernel"] for k in result["layers"]["kernels"].values()}),
        "digests": result["layers"].get("digests"),
        "lines": _loader_lines(log),
        "start_s": result["start_s"],
    }
    if row.kwargs.get("load_format") == "marlin_prepacked":
        want = "marlin-pack: streamed" if row.key.startswith("bucket") else "prepacked layers"
        if want not in log:
            raise RuntimeError(f"{row.key}: the engine's log has no {want!r} line: not loaded from where it was told "
                               f"(log {proc.log_path})")


def _run_dry(row: Row, procs: Cluster, name: str, timeout: float) -> None:
    what, target = row.dry
    proc = procs.start(name, [sys.executable, "-c", DRY_CHILD, what, target], procs.env({**ENV, **row.env}))
    try:
        code = proc.wait_exit(timeout)
    finally:
        procs.stop()
    line = next((x for x in proc.log().splitlines() if x.startswith("RESULT ")), None)
    if code or line is None:
        sys.stderr.write(proc.tail(6000))
        raise RuntimeError(f"{row.key} dry read failed (exit {code}, log {proc.log_path})")
    got = json.loads(line[len("RESULT "):])
    row.seconds, row.nbytes = got["seconds"], got["bytes"]
    row.result = {"digests": got["digests"], "lines": got["lines"], "tokens": None, "kernel": ["(dry run: no engine)"]}


def _rows(args: argparse.Namespace, model: Path, bundle: Path, endpoint: str) -> list[Row]:
    prefix = f"s3://{BUCKET}/{model.name}"
    bucket_env = client_env(endpoint)
    ckpt_bytes = _files_bytes(sorted(model.glob("*.safetensors")))
    from marlin_pack.bundle.reader import read_manifest

    manifest = read_manifest(bundle)
    bundle_bytes = manifest.common.size + sum(r.file.size for r in manifest.tensor_parallel_set(1).ranks)
    prepacked = {"load_format": "marlin_prepacked", "attention_backend": args.attention_backend}
    skip = set(args.skip.split(","))
    rows: list[Row] = []
    if "bucket-prepacked" not in skip:
        rows.append(Row("bucket-prepacked", str(model), {**prepacked, "model_loader_extra_config": {
            "bundle": f"{prefix}/bundle", "fallback": False}}, bucket_env, bundle_bytes, True, ("bundle-bucket", f"{prefix}/bundle")))
    if "bucket-runai" not in skip:
        runai = {"load_format": "runai_streamer", "attention_backend": args.attention_backend}
        rows.append(Row("bucket-runai", f"{prefix}/checkpoint", runai, bucket_env, ckpt_bytes, False,
                        ("checkpoint-bucket", f"{prefix}/checkpoint")))
    for i, cache in enumerate(c for c in args.local_cache.split(",") if c):
        if "local-ordinary" not in skip:
            rows.append(Row(f"local-ordinary {cache}", str(model), {"attention_backend": args.attention_backend}, {}, ckpt_bytes,
                            False, ("checkpoint-local", str(model)), cache))
        if "local-prepacked" not in skip:
            rows.append(Row(f"local-prepacked {cache}", str(model), {**prepacked, "model_loader_extra_config": {
                "bundle": str(bundle), "fallback": False}}, {}, bundle_bytes, i == 0, ("bundle-local", str(bundle)), cache))
    return rows


def _compare(rows: list[Row], a: str, b: str) -> str:
    """``a``'s digests against ``b``'s (the first row of each kind that has them): one line; raises if they differ."""
    ra = next((r for r in rows if r.key.startswith(a) and r.result.get("digests")), None)
    rb = next((r for r in rows if r.key.startswith(b) and r.result.get("digests")), None)
    if ra is None or rb is None:
        return f"digests of {a} and {b}: not compared ({'no ' + a if ra is None else 'no ' + b} row with digests)"
    da, db = ra.result["digests"], rb.result["digests"]
    differ = sorted(n for n in da.keys() & db.keys() if da[n] != db[n])
    missing = sorted(da.keys() ^ db.keys())
    if differ or missing or not da:
        raise AssertionError(f"{ra.key} and {rb.key} differ: {len(differ)} tensors differ (e.g. {differ[:3]}), "
                             f"{len(missing)} held by one only (e.g. {missing[:3]})")
    return f"{ra.key} and {rb.key}: all {len(da)} tensors bit-identical (sha256 of each)"


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[2:5])} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - t, done.stdout


def _summary(args: argparse.Namespace, rows: list[Row], facts: dict[str, Any], notes: list[str]) -> None:
    where = {"bucket-prepacked": ("marlin_prepacked", "bucket"), "bucket-runai": ("runai_streamer, raw checkpoint", "bucket"),
             "local-ordinary": ("vLLM's default, raw checkpoint", "local disk"), "local-prepacked": ("marlin_prepacked", "local disk")}
    print(f"\n{args.preset} ({facts['layers']} layers) {args.format} --kernel {args.kernel}, TP=1; checkpoint "
          f"{_size(facts['ckpt_gb'] * 1e9)}, bundle {_size(facts['bundle_gb'] * 1e9)}; bucket: the S3 file server over {args.bucket_root} "
          f"({facts['bucket_fs']}), local: {args.workdir}{' (DRY RUN: reads, no engines)' if args.dry_run else ''}")
    took = "read (dry run)" if args.dry_run else "Model loading took"
    print(f"\n| start | from | {took} | read | rate | sent by the server | kernel |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kind, place_ = where[r.key.split(" ")[0]]
        place_ += f", {r.cache}" if r.cache else ""
        if r.seconds is None:
            why = r.error if r.error.startswith("skipped") else f"failed: {r.error or 'no Model loading took in its log'}"
            print(f"| {kind} | {place_} | {why[:160]} | | | | |")
            continue
        fetched = _size(r.fetched) if r.fetched is not None else "-"
        print(f"| {kind} | {place_} | {r.seconds:.2f} s | {_size(r.nbytes)} | {_rate(r.nbytes, r.seconds)} | {fetched} | "
              f"{', '.join(r.result.get('kernel') or [])} |")
    print()
    for line in notes:
        print(f"- {line}")
    for r in rows:
        for line in r.result.get("lines", [])[-4:]:
            print(f"  {r.key}: {line}")
    print("RESULT " + json.dumps({**facts, "rows": {r.key: {"seconds": r.seconds, "bytes": r.nbytes, "fetched": r.fetched,
                                                            "error": r.error or None} for r in rows}}))


def main() -> None:
    # Run by sitting_guard.run: a `timeout`'s SIGTERM (or ^C) exits through the finally blocks (engines, the server,
    # the workdir and the tmpfs bucket emptied).
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b", help="a marlin_pack.testing.synthetic preset (tiny for --dry-run)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the preset (llama-70b: 40 keeps the checkpoint and "
                    "bundle at ~22 GB each, both on a 64 GiB disk and both again in a 64 GB /dev/shm)")
    ap.add_argument("--format", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--kernel", default="machete", help="the bundle's layout (convert --kernel): what the GPU's vLLM picks")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/remote"), help="the local disk: checkpoint and bundle")
    ap.add_argument("--bucket-root", type=Path, default=None,
                    help="the server's folder (default /dev/shm/marlin-s3; --dry-run: WORKDIR/bucket)")
    ap.add_argument("--push", default="upload", choices=("upload", "place"),
                    help="upload: marlin-pack push sends every object through the server (timed); place: the data objects "
                         "copied into the bucket with their digests as metadata, push writes the manifest and record")
    ap.add_argument("--local-cache", default="cold", help="cold, warm or cold,warm: the page cache of the local files "
                    "before each local row")
    ap.add_argument("--skip", default="", help=f"rows to leave out (comma-separated): {', '.join(ROWS)}")
    ap.add_argument("--attention-backend", default=os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN"))
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no row after this many seconds (0: none)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoint, bundle and bucket in place")
    ap.add_argument("--dry-run", action="store_true", help="everything but the GPU engines, on the CPU (see above)")
    args = ap.parse_args()
    if args.bucket_root is None:
        args.bucket_root = args.workdir / "bucket" if args.dry_run else Path("/dev/shm/marlin-s3")
    t_start = time.monotonic()
    for name in ("boto3",):
        if importlib.util.find_spec(name) is None:
            raise SystemExit(f"{name} is not importable: install marlin-pack's s3 extra (on the GPU machine: the wheels in "
                             ".device-carry-s3, docs/development.md)")
    runai = importlib.util.find_spec("runai_model_streamer") is not None and importlib.util.find_spec("runai_model_streamer_s3")
    rows: list[Row] = []
    notes: list[str] = []
    facts: dict[str, Any] = {}
    import dataclasses

    from marlin_pack.sources.hub import BUNDLE_DIRNAME
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    shape = PRESETS[args.preset]
    if args.layers:
        shape = dataclasses.replace(shape, num_hidden_layers=args.layers)
    shutil.rmtree(args.workdir, ignore_errors=True)
    shutil.rmtree(args.bucket_root, ignore_errors=True)
    _check_room(args, checkpoint_bytes(shape))
    args.workdir.mkdir(parents=True)
    logs = args.workdir / "logs"
    logs.mkdir()
    server_procs = Cluster(logs, logs=None, cwd=Path.cwd(), stop_timeout_s=30)
    failed: Exception | None = None
    try:
        device = "cpu" if args.dry_run else "cuda"
        model = args.workdir / f"{args.preset}-{shape.num_hidden_layers}-{args.format}"
        bundle = model / BUNDLE_DIRNAME
        t = time.perf_counter()
        (write_awq_checkpoint if args.format == "awq" else write_gptq_checkpoint)(
            model, shape, group_size=128 if shape.hidden_size % 128 == shape.intermediate_size % 128 == 0 else 32,
            max_shard_bytes=5 << 30, device=device)
        if device == "cuda":
            import torch

            torch.cuda.empty_cache()
        ckpt_files = sorted(model.glob("*.safetensors"))
        facts.update(layers=shape.num_hidden_layers, ckpt_gb=_files_bytes(ckpt_files) / 1e9)
        notes.append(f"checkpoint {_size(facts['ckpt_gb'] * 1e9)} drawn on the {device} in {time.perf_counter() - t:.1f} s")
        print(notes[-1], flush=True)
        seconds, _ = _timed([sys.executable, "-m", "marlin_pack.cli", "convert", str(model), "--device", device, "--tp", "1",
                             "--kernel", args.kernel, "--dtype", "float16", "--force"], {})
        bundle_files = sorted(f for f in bundle.rglob("*") if f.is_file())
        facts["bundle_gb"] = _files_bytes(bundle_files) / 1e9
        notes.append(f"convert --device {device} --kernel {args.kernel}: {seconds:.1f} s, bundle {_size(facts['bundle_gb'] * 1e9)}")
        print(notes[-1], flush=True)

        server = Server(server_procs, args.bucket_root)
        facts["bucket_fs"] = _fs_type(args.bucket_root)
        env = client_env(server.endpoint)
        t = time.perf_counter()
        placed = place_tree(args.bucket_root, BUCKET, f"{model.name}/checkpoint", model, exclude=(BUNDLE_DIRNAME,))
        notes.append(f"raw checkpoint placed in s3://{BUCKET}/{model.name}/checkpoint: {_size(placed)} in "
                     f"{time.perf_counter() - t:.1f} s")
        print(notes[-1], flush=True)
        url = f"s3://{BUCKET}/{model.name}/bundle"
        if args.push == "place":
            from marlin_pack.bundle.reader import read_manifest

            t = time.perf_counter()
            for entry in read_manifest(bundle).files():
                place(args.bucket_root, BUCKET, f"{model.name}/bundle/{entry.path}", bundle / entry.path,
                      metadata={"blake3": entry.blake3})
            notes.append(f"bundle's data objects placed: {time.perf_counter() - t:.1f} s")
            print(notes[-1], flush=True)
        before = server.stats()
        seconds, out = _timed([sys.executable, "-m", "marlin_pack.cli", "push", str(bundle), url, "--json"], env)
        pushed = json.loads(out)
        sent = server.stats()["bytes_received"] - before["bytes_received"]
        facts["push_s"] = seconds
        notes.append(f"marlin-pack push ({args.push}) to {url}: {seconds:.1f} s, {len(pushed['uploaded'])} objects uploaded "
                     f"({_size(sent)} through the server, {_rate(sent, seconds)} over the push), "
                     f"{len(pushed['kept'])} kept")
        print(notes[-1], flush=True)

        rows = _rows(args, model, bundle, server.endpoint)
        for i, row in enumerate(rows):
            if row.key == "bucket-runai" and not runai:
                row.error = "skipped: runai_model_streamer (and its s3 package) is not importable here"
                print(f"  {row.key}: {row.error}", flush=True)
                continue
            if args.deadline_s and time.monotonic() - t_start > args.deadline_s:
                row.error = f"skipped: past --deadline-s {args.deadline_s:.0f}"
                print(f"  {row.key}: {row.error}", flush=True)
                continue
            if row.cache:
                state = _cache(ckpt_files if "ordinary" in row.key else bundle_files, row.cache)
                print(f"  {row.key}: {state}", flush=True)
            procs = Cluster(logs, logs=None, cwd=Path.cwd(), stop_timeout_s=60)
            before = server.stats()
            name = f"{i + 1}-{row.key.replace(' ', '-')}"
            # An engine that hangs is given up in time for the summary: 150 s past the deadline, at most
            timeout = START_TIMEOUT_S if not args.deadline_s else max(60.0, args.deadline_s + 150 - (time.monotonic() - t_start))
            try:
                (_run_dry if args.dry_run else _run_engine)(row, procs, name, min(timeout, START_TIMEOUT_S))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a failed row is reported, the sitting goes on
                row.error = f"{type(e).__name__}: {e}"
            after = server.stats()
            row.fetched = after["bytes_sent"] - before["bytes_sent"]
            if row.error:
                print(f"  {row.key}: failed: {row.error}", flush=True)
                continue
            took = "read in" if args.dry_run else "Model loading took"
            print(f"  {row.key}: {took} {row.seconds:.2f} s; {_size(row.nbytes)} read ({_rate(row.nbytes, row.seconds)}), "
                  f"{_size(row.fetched)} sent by the server; {' | '.join(row.result['lines'][-1:])}", flush=True)
        tokens = {r.key: r.result["tokens"] for r in rows if r.result.get("tokens") is not None}
        if tokens:
            same = len({json.dumps(v) for v in tokens.values()}) == 1
            notes.append(f"greedy tokens of {len(tokens)} engines: {'all the same' if same else 'DIFFER: ' + json.dumps(tokens)[:600]}")
        try:
            notes.append(_compare(rows, "bucket-prepacked", "local-prepacked"))
            if args.dry_run:
                notes.append(_compare(rows, "bucket-runai", "local-ordinary"))
        except AssertionError as e:
            failed = e
            notes.append(f"DIGESTS DIFFER: {e}")
    finally:
        server_procs.stop()
        _pack_logs(logs)
        if not args.keep:
            shutil.rmtree(args.bucket_root, ignore_errors=True)  # tmpfs: memory until removed
            shutil.rmtree(args.workdir, ignore_errors=True)
    _summary(args, rows, facts, notes)
    if failed is not None:
        raise SystemExit(f"bench_remote: {failed}")
    bad = [r.key for r in rows if r.error and not r.error.startswith("skipped")]
    if bad:
        raise SystemExit(f"bench_remote: rows failed: {', '.join(bad)}")


def _check_room(args: argparse.Namespace, ckpt: int) -> None:
    """Refused in one line, before anything is drawn, where the workdir's or the bucket's file system lacks the room:
    the checkpoint and its bundle in the workdir; in the bucket the raw checkpoint (hard links on the workdir's file
    system, else a copy) and the pushed bundle (``--push place``: hard links there too)."""
    bundle = BUNDLE_RATIO * ckpt
    apart = not same_file_system(args.workdir, args.bucket_root)
    check_room("bench_remote", [
        (args.workdir, ckpt + bundle, "checkpoint and bundle"),
        (args.bucket_root, (ckpt if apart else 0) + (bundle if apart or args.push == "upload" else 0), "the bucket's copies"),
    ], "fewer --layers, another --workdir or --bucket-root, or --push place")


def _fs_type(path: Path) -> str:
    """The file system type of ``path`` (from /proc/mounts: the longest mount point above it)."""
    best, kind = "", "?"
    real = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            f = line.split()
            if len(f) > 2 and (real == f[1] or real.startswith(f[1].rstrip("/") + "/")) and len(f[1]) >= len(best):
                best, kind = f[1], f[2]
    except OSError:
        pass
    return kind


def _pack_logs(logs: Path) -> None:
    """Every log of the sitting (engines, server, children) into ``$OUT/bench-remote-logs.tgz`` (a device call brings back
    at most 8 files)."""
    out = os.environ.get("OUT")
    if not out or not logs.is_dir():
        return
    with tarfile.open(Path(out) / "bench-remote-logs.tgz", "w:gz") as tar:
        for f in sorted(logs.glob("*.log")):
            tar.add(f, arcname=f.name)


if __name__ == "__main__":
    sitting_guard.run(main, "bench_remote")
