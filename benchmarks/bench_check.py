"""What a start's pre-GPU check costs with and without this user's stamps, side by side in one run.

    python benchmarks/bench_check.py [--preset llama-1gb] [--rounds 3] [--workdir .bench]

Writes a random AWQ checkpoint of the preset, converts it, then times ``preflight`` (the
loader's own decision, as ``marlin-pack check``) per round: ``verify: full`` (what every start
of a read-only bundle cost while stamps lived in the bundle), ``auto`` with an empty stamp store
(the first start of a user), ``auto`` with the stamps that run left (every later start), and
``size``. Files are in the page cache after the first round: the figures are hashing, not disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-1gb")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = ap.parse_args()

    from marlin_pack import convert
    from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint
    from marlin_pack.vllm_plugin.preflight import preflight

    model = args.workdir / f"check-{args.preset}-awq"
    if not (model / "marlin-pack" / "manifest.json").is_file():
        write_awq_checkpoint(model, PRESETS[args.preset], tokenizer=False)
        convert(model, force=True, kernel="marlin")
    size = sum(p.stat().st_size for p in model.rglob("*.safetensors"))

    def timed(verify: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        report = preflight(model, verify=verify)
        assert report.decision == "load", report.to_dict()
        return time.perf_counter() - t0, report.hashed.files

    rows: dict[str, list[float]] = {"full": [], "auto, no stamps": [], "auto, stamped": [], "size": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as store:
            os.environ["MARLIN_PACK_STAMPS"] = store
            rows["full"].append(timed("full")[0])
            os.environ["MARLIN_PACK_STAMPS"] = os.path.join(store, "fresh")
            rows["auto, no stamps"].append(timed("auto")[0])
            seconds, hashed = timed("auto")
            assert hashed == 0, "the second auto check hashed again"
            rows["auto, stamped"].append(seconds)
            rows["size"].append(timed("size")[0])
    base = statistics.median(rows["full"])
    print(f"{args.preset}: checkpoint + bundle {size / 1e9:.2f} GB, {args.rounds} rounds, {os.cpu_count()} cores")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"  {name:16s} median {med:7.3f} s  (best {min(times):.3f})  {med / base:6.3f}x of full")


if __name__ == "__main__":
    main()
