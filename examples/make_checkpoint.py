"""Write a random AWQ / GPTQ / compressed-tensors / unquantized checkpoint of a preset shape.

    python examples/make_checkpoint.py --format awq --preset tiny /tmp/tiny-awq
    python examples/make_checkpoint.py --format gptq --preset llama-70b --shard-size-mb 5000 \\
        --device cuda /data/llama-70b-gptq
    python examples/make_checkpoint.py --format compressed-tensors --asymmetric --dtype bfloat16 /tmp/tiny-w4a16-asym
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from marlin_pack.testing import synthetic

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--format", choices=["awq", "gptq", "compressed-tensors", "none"], default="awq",
                        help="compressed-tensors: pack-quantized, as llm-compressor saves W4A16/W8A16")
    parser.add_argument("--preset", choices=sorted(synthetic.PRESETS), default="tiny")
    parser.add_argument("--bits", type=int, default=4, help="GPTQ and compressed-tensors (AWQ is always 4-bit)")
    parser.add_argument("--asymmetric", action="store_true", help="compressed-tensors only: zero points (4-bit)")
    parser.add_argument("--group-size", type=int, default=128, help="-1: one group per column")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--shard-size-mb", type=int, default=None, help="default: one model.safetensors")
    parser.add_argument("--device", default="cpu", help="where to draw the random tensors, e.g. cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.asymmetric and args.format != "compressed-tensors":
        parser.error("--asymmetric applies to --format compressed-tensors only")

    shape, dtype, start = synthetic.PRESETS[args.preset], DTYPES[args.dtype], time.monotonic()
    shard = None if args.shard_size_mb is None else args.shard_size_mb * 1_000_000

    def progress(done: int, total: int) -> None:
        print(f"\r{done / 1e9:7.2f} / {total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)

    kw = {"group_size": args.group_size, "dtype": dtype, "seed": args.seed, "max_shard_bytes": shard,
          "device": args.device, "progress": progress}
    try:
        if args.format == "awq":
            out = synthetic.write_awq_checkpoint(args.out_dir, shape, **kw)
        elif args.format == "gptq":
            out = synthetic.write_gptq_checkpoint(args.out_dir, shape, bits=args.bits, **kw)
        elif args.format == "compressed-tensors":
            out = synthetic.write_compressed_tensors_checkpoint(
                args.out_dir, shape, bits=args.bits, symmetric=not args.asymmetric, **kw)
        else:
            out = synthetic.write_unquantized_checkpoint(args.out_dir, shape, dtype=dtype, seed=args.seed)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(file=sys.stderr)
    files = sorted(p for p in out.iterdir() if p.is_file())
    print(f"wrote {args.format} {args.preset!r} checkpoint to {out} in {time.monotonic() - start:.1f}s:")
    for p in files:
        print(f"  {p.name:40s} {p.stat().st_size:>15,d} bytes")
    print(f"  {'total':40s} {sum(p.stat().st_size for p in files):>15,d} bytes")


if __name__ == "__main__":
    main()
