"""Cold and first starts (issue 55): the disk's own rate beside every start that reads from it, in one sitting.

Runs on a GPU machine with vLLM 0.33.0 and marlin-pack installed, as root (to drop the page cache):

    python benchmarks/bench_cold.py --preset llama-70b --layers 40 --format awq --kernel machete --workdir /tmp/cold

The checkpoint and its bundle (at its default place, ``MODEL/marlin-pack``) both live under ``--workdir`` (one
disk: ``--layers`` keeps both on a 64 GiB disk; the convert rows' second conversion builds its bundle beside the first,
~79 GB at 40 layers: there, ``--skip convert-rows``). Where the disk lacks the room, the sitting says so in one line
before drawing anything; stopped (SIGTERM, SIGINT), it removes ``--workdir`` (``sitting_guard.py``). In order, it prints:

* ``disk``: plain ``O_DIRECT`` sequential reads of the checkpoint's files, cold (``--disk-reads``: readers x
  block sizes): the best is the disk's rate, the bound of every cold row;
* ``convert``: ``--device cuda`` twice, around the page cache (``MARLIN_PACK_WRITE=direct``) and by the default
  rule (through it where memory holds the bundle); then the bundle's residency;
* ``first start after convert``, then ``warm`` (the page cache as the first start left it);
* ``prepacked cold``: page cache dropped (this user's stamps from ``convert`` kept), with the physical bound (bundle
  bytes / the disk's rate);
* ``ordinary cold`` and ``ordinary warm``: vLLM's default engine from the checkpoint;
* ``daemon fill cold``: ``marlin-pack daemon`` filled from the dropped bundle;
* ``verify cold``: ``marlin-pack verify --integrity-only`` of the dropped bundle (its BLAKE3 reads), then ``verify``
  against the checkpoint (``--skip verify-source`` leaves it out: the round trip on the CPU), each with the disk's bytes
  read meanwhile against the files it verifies (about 1.0: each file read once);
* a fresh node's first start (issue 72, ``--skip first``): page cache dropped *and* an empty stamp store of its own
  (``MARLIN_PACK_STAMPS``) before each row: ``prepacked cold, no stamps, verify auto`` and ``... verify full`` (the
  bundle read once for the copy and its BLAKE3 digest), ``daemon fill cold, no stamps`` and ``check cold, no stamps``
  (``marlin-pack check`` of the cold bundle). Each of these rows also gives the bytes the disk under ``--workdir``
  read meanwhile (``/proc/diskstats``), against the bundle's size: about 1.0 is one read (a cold copy reads through the
  page cache where memory keeps the rank file, ``staged``, else ``direct``: one read either way). ``--cold-io
  '{"mode": "direct"}'`` adds a prepacked cold row read around the page cache, for a side-by-side.

Every figure is vLLM's "Model loading took" (engines) or the daemon's fill line; the table at the end gives
the goals' ratios. Nothing is asserted: the figures go to docs/performance.md.

``--reader-gb N`` measures the reader alone instead (any machine: GPU destinations where there is one, else CPU
memory), on a file of N GB under ``--workdir``, each row cold: the disk's ``O_DIRECT`` rate, then the old first start
(BLAKE3 of the file, then the ``direct`` copy) against the copies that hash what they read (``direct``, and ``staged``
through the page cache: what a host whose memory keeps the file gets), each with the disk's bytes
read meanwhile:

    python benchmarks/bench_cold.py --reader-gb 2 --workdir /var/tmp/cold

The whole GPU acceptance of issue 72 in one command (one sitting, as root, a 64 GiB disk):

    python benchmarks/bench_cold.py --preset llama-70b --layers 40 --format awq --kernel machete --workdir /tmp/cold \
        --disk-reads 4x32,8x32 --skip convert-rows
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import sitting_guard
from bench_h2d import direct_read_gbps  # this folder is on sys.path when run as a script
from bench_load import _daemon_rows, _engine
from sitting_guard import BUNDLE_RATIO, check_room, checkpoint_bytes


def drop_page_cache(paths: list[Path]) -> str:
    """Empty the page cache of ``paths``' files: the whole cache as root (``drop_caches``), else file by file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        from marlin_pack.io.residency import drop_cached

        for root in paths:
            for f in root.rglob("*"):
                if f.is_file():
                    drop_cached(f)
        return "fadvise DONTNEED per file (not root)"


def residency(root: Path) -> float:
    """The cached fraction of ``root``'s safetensors bytes."""
    from marlin_pack.io.residency import cached_fraction

    files = [f for f in root.rglob("*.safetensors")]
    total = sum(f.stat().st_size for f in files) or 1
    return sum((cached_fraction(f) or 0.0) * f.stat().st_size for f in files) / total


def disk_read_bytes(path: Path) -> int | None:
    """Bytes the block device holding ``path`` has read since boot (``/proc/diskstats``, sectors of 512 bytes); None
    where it cannot be told (no such line: an overlay, a network file system)."""
    dev = os.stat(path).st_dev
    try:
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if len(f) > 5 and (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
                return int(f[5]) * 512
    except (OSError, ValueError):
        return None
    return None


def _first_start_rows(
    rows: dict[str, float | None], errors: dict[str, str], notes: list[str], model: Path, bundle: Path, workdir: Path,
    attn: str, bundle_gb: float,
) -> None:
    """Issue 72: each row cold (page cache dropped) with an empty stamp store of its own; the disk's reads beside it."""

    def fresh_store(name: str) -> str:
        store = workdir / f"stamps-{name}"
        shutil.rmtree(store, ignore_errors=True)  # marlin-pack creates it 0700
        return str(store)

    at_load_end: dict[str, int] = {}  # row -> the disk's bytes read when the engine's load returned

    def prepacked(verify: str) -> float | None:
        env = {"MARLIN_PACK_STAMPS": fresh_store(f"prepacked-{verify}"), "MARLIN_PACK_BENCH_DISK_OF": str(workdir)}
        result = _engine(model, "prepacked", attn, {"verify": verify}, env=env)
        if "disk_read_bytes_at_load_end" in result:
            at_load_end[f"prepacked cold, no stamps, verify {verify}"] = result["disk_read_bytes_at_load_end"]
        for line in result["marlin_pack_log"]:
            if "as it was copied" in line or "hashed" in line or "I/O plan" in line:
                print(f"    {line}", flush=True)
        return result["model_loading_s"]

    def daemon() -> float | None:
        io = json.dumps({"verify": "auto", "env:MARLIN_PACK_STAMPS": fresh_store("daemon")})
        return _daemon_rows(model, bundle, attn, False, workdir, io=io, attach=False)["fill_s"]

    def check() -> float:
        env = {"MARLIN_PACK_STAMPS": fresh_store("check")}
        return _timed([sys.executable, "-m", "marlin_pack.cli", "check", str(model)], env)

    for key, measure in (
        ("prepacked cold, no stamps, verify auto", lambda: prepacked("auto")),
        ("prepacked cold, no stamps, verify full", lambda: prepacked("full")),
        ("daemon fill cold, no stamps", daemon),
        ("check cold, no stamps s", check),
    ):
        how = drop_page_cache([model])
        before = disk_read_bytes(workdir)
        _row(rows, errors, key, measure)
        after = disk_read_bytes(workdir)
        if before is not None and after is not None and bundle_gb:
            read_gb = (after - before) / 1e9
            notes.append(f"{key}: the disk read {read_gb:.1f} GB meanwhile, {read_gb / bundle_gb:.2f} of the bundle ({how})")
            if key in at_load_end:  # the page-cache fill for the next start, after a cold copy, comes after the load
                load_gb = (at_load_end[key] - before) / 1e9
                notes[-1] += f"; by the end of its load {load_gb:.1f} GB, {load_gb / bundle_gb:.2f} of the bundle"
            print(notes[-1], flush=True)


def _verify_rows(
    rows: dict[str, float | None], errors: dict[str, str], notes: list[str], model: Path, bundle: Path, workdir: Path,
    bundle_gb: float, ckpt_gb: float, with_source: bool,
) -> None:
    """``marlin-pack verify`` of the cold bundle, ``--integrity-only`` (the bundle's BLAKE3 reads), then against its
    checkpoint (the round trip, whose reads give the digests); each with the disk's bytes read meanwhile against the bytes
    of the files it verifies: about 1.0 is one read of each."""
    verify = [sys.executable, "-m", "marlin_pack.cli", "verify", str(bundle)]
    for key, argv, files_gb in (("verify cold s", [*verify, "--integrity-only"], bundle_gb),
                                ("verify cold, with its checkpoint s", verify, bundle_gb + ckpt_gb)):
        if argv is verify and not with_source:
            continue
        how = drop_page_cache([model])
        before = disk_read_bytes(workdir)
        _row(rows, errors, key, lambda argv=argv: _timed(argv))
        after = disk_read_bytes(workdir)
        if before is not None and after is not None and files_gb:
            read_gb = (after - before) / 1e9
            notes.append(f"{key}: the disk read {read_gb:.1f} GB meanwhile, {read_gb / files_gb:.2f} of the {files_gb:.1f} GB "
                         f"it verifies ({how})")
            print(notes[-1], flush=True)


def reader_rows(workdir: Path, gb: float) -> None:
    """``--reader-gb``: one cold file, hashed before its ``direct`` copy and hashed by it (``direct``, ``staged``), with the
    disk's reads."""
    import torch

    from marlin_pack.gpu.plan import IoFacts, IoPlan, plan_io
    from marlin_pack.gpu.reader import CopyItem, ParallelReader
    from marlin_pack.io.hashing import hash_file
    from marlin_pack.io.residency import cached_fraction, drop_cached

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "rank-0.safetensors"
    size = int(gb * 1e9) // 4096 * 4096
    if not path.is_file() or path.stat().st_size != size:
        with open(path, "wb") as f:
            for _ in range(size // (64 << 20)):
                f.write(os.urandom(64 << 20))
            f.write(os.urandom(size % (64 << 20)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    items = [CopyItem(lo, min(64 << 20, size - lo), dst[lo : lo + (64 << 20)]) for lo in range(0, size, 64 << 20)]
    plan = plan_io(IoFacts(cached=0.0, direct_reads=True), environ={})  # the cold plan: direct
    want = None

    def old_way() -> str:
        digest = hash_file(path).digest
        if device == "cuda":
            with ParallelReader(plan) as r:
                r.copy(path, items)
        else:  # CPU destinations are read through the page cache: the GPU's direct copy is O_DIRECT reads of the file
            direct_read_gbps([path], plan.threads, plan.window, size)
        return digest

    def one_read(how: IoPlan = plan) -> str:
        with ParallelReader(how) as r:
            r.copy_files([(path, items)], hashed=[path])
            return r.digests[str(path)].digest  # type: ignore[union-attr]

    # The plan of a host whose memory keeps the file: the same one read, through the page cache (left cached)
    staged = plan_io(IoFacts(cached=0.0, direct_reads=True, cache_room=True), environ={})

    print(f"reader alone: {size / 1e9:.2f} GB file in {workdir}, {device} destination, plan {plan.mode} "
          f"{plan.threads} x {plan.window >> 20} MiB, {os.cpu_count()} cores", flush=True)
    drop_cached(path)  # this file only (fadvise): the rest of a shared machine's page cache stays
    gbps, _ = direct_read_gbps([path], 8, 32 << 20, size)
    print(f"  disk O_DIRECT 8 x 32 MiB: {gbps:.2f} GB/s; bound {size / 1e9 / gbps:.2f} s", flush=True)
    rows = (("hash, then the direct copy (before issue 72)", old_way), ("the direct copy that hashes (one read)", one_read),
            ("the staged copy that hashes (through the cache)", lambda: one_read(staged)))
    for name, run in rows * 2:
        drop_cached(path)
        cached = cached_fraction(path) or 0.0
        before = disk_read_bytes(workdir)
        t = time.perf_counter()
        digest = run()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        after = disk_read_bytes(workdir)
        want = want or digest  # the first row's is hash_file's: every row must agree with it
        read = "?" if before is None or after is None else f"{(after - before) / size:.2f}"
        print(f"  {name:48} {seconds:7.2f} s  {size / 1e9 / seconds:5.2f} GB/s  disk read {read} x the file ({cached:.0%} cached "
              f"before, {cached_fraction(path) or 0.0:.0%} after)" + ("" if digest == want else "  DIGEST DIFFERS"), flush=True)


def _timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def _row(rows: dict[str, float | None], errors: dict[str, str], key: str, measure: Callable[[], float | None]) -> None:
    """``rows[key] = measure()``; a row that fails is reported and left out, the sitting goes on."""
    try:
        rows[key] = measure()
        print(f"  {key}: {rows[key]}", flush=True)  # as it comes: a sitting cut short still shows its figures
    except (Exception, SystemExit) as e:  # noqa: BLE001 - _engine and _daemon_rows end a failed process with SystemExit
        rows[key] = None
        errors[key] = f"{type(e).__name__}: {e}"
        print(f"  {key}: failed: {errors[key]}", flush=True)


def main() -> None:  # run by sitting_guard.run: SIGTERM (a `timeout`) and SIGINT go through the finally blocks
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b")
    ap.add_argument("--layers", type=int, default=40, help="layers of the preset (40: ~24 GB each, both on a 64 GiB disk)")
    ap.add_argument("--format", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--kernel", default="machete", help="the bundle's layout (convert --kernel): what the GPU's vLLM picks")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cold"))
    ap.add_argument("--disk-reads", default="4x32,8x32,16x32",
                    help="O_DIRECT reads of the cold checkpoint, STREAMSxMIB,...: the best is the disk's rate")
    ap.add_argument("--cold-io", default="", help="more prepacked cold rows, each with this $MARLIN_PACK_IO (';'-separated JSON objects)")
    ap.add_argument("--attention-backend", default=os.environ.get("MARLIN_PACK_TEST_ATTN", "TRITON_ATTN"))
    ap.add_argument("--skip", default="", help="rows to leave out (comma-separated): convert-rows (the convert, first-start-"
                    "after-convert and warm rows), prepacked, ordinary, daemon, verify, verify-source (verify against the checkpoint), "
                    "first (no stamps)")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoint and bundle in --workdir for a second part")
    ap.add_argument("--reuse", action="store_true",
                    help="a second part: the checkpoint and bundle --keep left (no generation, no convert rows)")
    ap.add_argument("--reader-gb", type=float, default=0.0,
                    help="measure the reader alone on a file of this many GB (any machine), nothing else")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    if args.reader_gb:
        if not (args.workdir / "rank-0.safetensors").is_file():
            check_room("bench_cold", [(args.workdir, args.reader_gb * 1e9, "the file read")], "a smaller --reader-gb or "
                       "another --workdir")
        reader_rows(args.workdir, args.reader_gb)
        return

    import dataclasses

    import torch

    from marlin_pack.sources.hub import BUNDLE_DIRNAME
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    shape = dataclasses.replace(PRESETS[args.preset], num_hidden_layers=args.layers)
    # The bundle at its default place (MODEL/marlin-pack): the daemon and its engines find it there, as a user's would.
    model = args.workdir / f"{args.preset}-{args.layers}-{args.format}"
    bundle = model / BUNDLE_DIRNAME
    reuse = args.reuse and (bundle / "manifest.json").is_file()
    if not reuse:
        shutil.rmtree(args.workdir, ignore_errors=True)
        # Both on one disk; the convert rows convert twice, the second (--force) beside the first bundle, then swapped in
        ckpt = checkpoint_bytes(shape)
        bundles = 1 if "convert-rows" in skip else 2
        check_room("bench_cold", [(args.workdir, ckpt, "checkpoint"), (args.workdir, bundles * BUNDLE_RATIO * ckpt,
                   f"{bundles} bundle(s)")], "fewer --layers, --skip convert-rows (one conversion) or another --workdir")
        args.workdir.mkdir(parents=True)
    rows: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    notes: list[str] = []
    ckpt_gb = bundle_gb = 0.0
    try:
        t = time.perf_counter()
        if not reuse:
            (write_awq_checkpoint if args.format == "awq" else write_gptq_checkpoint)(
                model, shape, group_size=128, max_shard_bytes=5 << 30, device="cuda")
            torch.cuda.empty_cache()
        files = sorted(model.glob("*.safetensors"))
        ckpt_gb = sum(f.stat().st_size for f in files) / 1e9
        notes.append(f"checkpoint {ckpt_gb:.1f} GB " + ("kept from a first part" if reuse else
                                                       f"generated in {time.perf_counter() - t:.1f} s"))
        for spec in args.disk_reads.split(","):
            streams, mib = (int(x) for x in spec.split("x"))
            how = drop_page_cache([model])
            gbps, read_gb = direct_read_gbps(files, streams, mib << 20, 8 << 30)
            rows[f"disk O_DIRECT {spec} GB/s"] = gbps
            notes.append(f"O_DIRECT sequential read of the cold checkpoint, {streams} x {mib} MiB: {gbps:.2f} GB/s "
                         f"({read_gb:.1f} GB; {how})")
            print(notes[-1], flush=True)

        if reuse:
            bundle_gb = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e9
        convert = [sys.executable, "-m", "marlin_pack.cli", "convert", str(model), "--device", "cuda", "--tp", "1",
                   "--kernel", args.kernel, "--dtype", "float16", "--force"]
        if not reuse and "convert-rows" in skip:  # one conversion (around the page cache: a cold bundle), no rows of it
            _timed(convert, {"MARLIN_PACK_WRITE": "direct"})
            bundle_gb = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e9
        elif not reuse:
            _row(rows, errors, "convert around the page cache s", lambda: _timed(convert, {"MARLIN_PACK_WRITE": "direct"}))
            notes.append(f"convert around the page cache (MARLIN_PACK_WRITE=direct): {rows['convert around the page cache s']} s; "
                         f"bundle {residency(bundle):.0%} cached")
            print(notes[-1], flush=True)
            _row(rows, errors, "convert (default) s", lambda: _timed(convert))
            bundle_gb = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) / 1e9
            notes.append(f"convert (default rule): {rows['convert (default) s']} s; "
                         f"bundle {bundle_gb:.1f} GB, {residency(bundle):.0%} cached")
            print(notes[-1], flush=True)

        attn = args.attention_backend
        prepacked = lambda env=None: _engine(model, "prepacked", attn, {}, env=env)["model_loading_s"]  # noqa: E731
        if "prepacked" not in skip:
            if not reuse and "convert-rows" not in skip:
                _row(rows, errors, "first start after convert", prepacked)
            if "convert-rows" not in skip:
                _row(rows, errors, "prepacked warm", prepacked)
            drop_page_cache([model])
            _row(rows, errors, "prepacked cold", prepacked)
            for io in filter(None, (s.strip() for s in args.cold_io.split(";"))):
                drop_page_cache([model])
                _row(rows, errors, f"prepacked cold, MARLIN_PACK_IO={io}", lambda io=io: prepacked({"MARLIN_PACK_IO": io}))
        if "ordinary" not in skip:
            drop_page_cache([model])
            _row(rows, errors, "ordinary cold", lambda: _engine(model, "default", attn)["model_loading_s"])
            _row(rows, errors, "ordinary warm", lambda: _engine(model, "default", attn)["model_loading_s"])
        if "daemon" not in skip:
            drop_page_cache([model])
            _row(rows, errors, "daemon fill cold",
                 lambda: _daemon_rows(model, bundle, attn, False, args.workdir, attach=False)["fill_s"])
        if "verify" not in skip:
            _verify_rows(rows, errors, notes, model, bundle, args.workdir, bundle_gb, ckpt_gb, "verify-source" not in skip)
        if "first" not in skip:
            _first_start_rows(rows, errors, notes, model, bundle, args.workdir, attn, bundle_gb)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    # The summary last, whole: a tail of the output is what comes back from a device run.
    disk = max((v for k, v in rows.items() if k.startswith("disk ") and v), default=0.0)
    bound = bundle_gb / disk if disk else float("nan")
    print(f"\n{args.preset} ({args.layers} layers) {args.format} --kernel {args.kernel}, TP=1; checkpoint {ckpt_gb:.1f} GB and "
          f"bundle {bundle_gb:.1f} GB on one disk; best O_DIRECT read {disk:.2f} GB/s; bound {bound:.2f} s")
    for line in notes:
        print(f"  {line}")
    for key, value in rows.items():
        if key.startswith("disk "):
            continue
        if value is None:
            print(f"  {key:40} failed: {errors.get(key, 'no figure in its log')}")
            continue
        note = ""
        if key.startswith(("prepacked cold", "daemon fill cold, no stamps")):
            note = f"  {value / bound:.2f} of the bound (goal <= 1.10 x + 1 s: {1.1 * bound + 1:.2f} s)"
            if rows.get("ordinary cold"):
                note += f"; {value / rows['ordinary cold']:.2f} of ordinary cold"  # type: ignore[operator]
        elif key == "first start after convert" and rows.get("prepacked warm"):
            note = f"  {value / rows['prepacked warm']:.2f} of warm (goal <= 1.5)"  # type: ignore[operator]
        elif key == "daemon fill cold":
            note = f"  {value / bound:.2f} of the bound"
        print(f"  {key:40} {value:8.2f} s{note}")
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    sitting_guard.run(main, "bench_cold")
