"""``marlin-pack verify``'s reads (CPU): each file's bytes read against its size, and the bytes kept meanwhile.

    python benchmarks/bench_verify.py [--preset llama-70b] [--scale 16] [--shard-gb 5,10,0] [--held-gib 2]
        [--format awq] [--tp 1] [--workdir .bench]

For each ``--shard-gb`` (0: one file), writes a random checkpoint of the preset with every dimension but the layer and
head counts divided by ``--scale`` (the names, the layer count and each file's order of tensors as the full model's;
sizes divided by ``scale**2``, files of ``shard-gb / scale**2``), converts it, and runs ``verify`` in this process with
every ``pread`` and safetensors header read counted per file, and the digests' limit (``io.hashing.HELD``) divided as
the sizes are: the bytes read against the bytes of bundle and checkpoint (1.0: each byte once; verify before its
digests came from its comparisons' reads: 2.0), the bytes read twice, the most bytes kept for the digests, and
``verify``'s seconds. Bytes read twice and kept are given at full scale (times ``scale**2``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-70b")
    ap.add_argument("--scale", type=int, default=16, help="divide every dimension but layer and head counts by this")
    ap.add_argument("--shard-gb", default="5,10,0", help="checkpoint file sizes at full scale, GB (0: one file)")
    ap.add_argument("--held-gib", type=float, default=None, help="the digests' limit at full scale (default: HELD)")
    ap.add_argument("--format", default="awq", choices=("awq", "gptq"))
    ap.add_argument("--tp", default="1")
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = ap.parse_args()

    from marlin_pack import convert, verify
    from marlin_pack.io import hashing, safetensors_io
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint, write_gptq_checkpoint

    s, area = args.scale, args.scale**2
    full = PRESETS[args.preset]
    shape = dataclasses.replace(full, hidden_size=full.hidden_size // s, intermediate_size=full.intermediate_size // s,
                                vocab_size=full.vocab_size // s, head_dim=full.resolved_head_dim // s)
    held = int((args.held_gib * 2**30 if args.held_gib is not None else hashing.HELD) / area)
    tp = tuple(int(t) for t in args.tp.split(","))

    reads: dict[str, int] = defaultdict(int)  # preadv, per file
    headers: dict[str, int] = defaultdict(int)  # safetensors header reads, per file (a few KB each)
    lock = threading.Lock()
    preadv, header = os.preadv, safetensors_io._read_header_bytes

    def counted(fd: int, bufs: list, offset: int) -> int:
        n = preadv(fd, bufs, offset)
        with lock:
            reads[os.readlink(f"/proc/self/fd/{fd}")] += n
        return n

    def header_read(path: Path) -> tuple[bytes, int]:
        raw, size = header(path)
        with lock:
            headers[os.path.realpath(path)] += len(raw)
        return raw, size

    peak = [0]
    room = hashing.HeldBytes._room

    def watched(self: hashing.HeldBytes, n: int, distance: int) -> bool:
        ok = room(self, n, distance)
        peak[0] = max(peak[0], self.held)
        return ok

    print(f"{args.preset} / {s} ({shape.num_hidden_layers} layers, hidden {shape.hidden_size}), {args.format}, TP {args.tp}; "
          f"digests' limit {held * area / 2**30:.2f} GiB at full scale; {os.cpu_count()} cores", flush=True)
    for shard_gb in (float(x) for x in args.shard_gb.split(",")):
        model = args.workdir / f"verify-{args.preset}-s{s}-{args.format}-{shard_gb:g}gb"
        if not (model / "marlin-pack" / "manifest.json").is_file():
            write = write_awq_checkpoint if args.format == "awq" else write_gptq_checkpoint
            write(model, shape, max_shard_bytes=int(shard_gb * 1e9 / area) or None, tokenizer=False)
            convert(model, tp=tp, force=True, kernel="marlin")
        files = sorted(model.rglob("*.safetensors"))
        reads.clear()
        headers.clear()
        peak[0] = 0
        os.preadv, safetensors_io._read_header_bytes, hashing.HeldBytes._room = counted, header_read, watched
        hashing.HELD = held
        try:
            t = time.perf_counter()
            report = verify(model / "marlin-pack")
            seconds = time.perf_counter() - t
        finally:
            os.preadv, safetensors_io._read_header_bytes, hashing.HeldBytes._room = preadv, header, room
        assert report.ok, report.first_failure
        got = {p: reads[str(p.resolve())] for p in files}
        ckpt = [p for p in files if p.parent == model]
        for what, group in (("checkpoint", ckpt), ("bundle", [p for p in files if p not in ckpt])):
            size = sum(p.stat().st_size for p in group)
            read = sum(got[p] + headers[str(p.resolve())] for p in group)
            again = sum(max(0, got[p] - p.stat().st_size) for p in group)
            print(f"  {shard_gb:g} GB files ({len(ckpt)}): {what:10} {len(group):2} files {size / 1e6:9.1f} MB, read "
                  f"{read / size:.3f}x, headers included; read twice {again * area / 1e9:.2f} GB at full scale")
        print(f"  {shard_gb:g} GB files: kept at most {peak[0] * area / 1e9:.2f} GB at full scale; verify {seconds:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
