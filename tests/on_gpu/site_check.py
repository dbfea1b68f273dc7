"""Is the vLLM unpacked in a site folder (the GPU machine's /tmp/site) one release, whole?

    python3 tests/on_gpu/site_check.py [SITE]      (default: $MARLIN_PACK_DEVICE_SITE, else /tmp/site)

Every ``vllm/**.so`` that the site's ``vllm-X.Y.Z.dist-info/RECORD`` lists and that is there must match its sha256
(urlsafe base64 without padding, as a wheel's RECORD writes it); every ``.so`` under ``vllm/`` must be listed; the
CUDA extensions every engine loads (``vllm/_C*.so``, ``vllm/_moe_C*.so``: the carry's ``a*`` parts) must be there.
Extensions the carry leaves out (flash-attention, DeepGEMM, FlashMLA's ``_flashmla_C``, ...) may be missing: they
are counted, not refused. Prints ``vllm X.Y.Z in SITE: N extension files match its RECORD``, exit 0; or one line naming
the file at fault and what to do, exit 3. Why: ``install.sh b`` once kept vLLM 0.31.0's extension under 0.34.0's
Python files; every later test ran on that mix (one engine failed on an op's missing argument, the others passed).
Run by ``use_release.sh switch`` and at the start of ``device.sh`` and ``benchmarks/on_device.sh``. Stdlib only.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import re
import sys
from pathlib import Path

FIX = "install it again with tests/on_gpu/use_release.sh stage/switch (docs/development.md)"
# The extensions the carry's a* parts hold: _C (every engine) and _moe_C (every engine with fused-MoE layers).
REQUIRED = re.compile(r"vllm/_(moe_)?C[._][^/]*\.so")


def record_digest(path: Path) -> str:
    """``sha256=...`` of a file as a wheel's RECORD writes it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def check(site: Path) -> tuple[bool, str]:
    """``(whole, the line to print)`` for the vLLM in ``site``."""
    infos = sorted(p.name for p in site.glob("vllm-*.dist-info"))
    if not (site / "vllm").is_dir() or not infos:
        return False, f"no vLLM unpacked in {site} (vllm/ or vllm-*.dist-info missing): {FIX}"
    if len(infos) > 1:
        return False, f"{site} holds the files of {len(infos)} vLLM releases ({', '.join(infos)}): a mixed install; {FIX}"
    version = infos[0][len("vllm-"):-len(".dist-info")]
    where = f"vllm {version} in {site}"
    record = site / infos[0] / "RECORD"
    if not record.is_file():
        return False, f"{where}: {record.name} missing from {infos[0]}: {FIX}"
    with open(record, newline="") as f:
        listed = {row[0]: row[1] for row in csv.reader(f) if len(row) > 1 and row[0].startswith("vllm/")
                  and row[0].endswith(".so")}
    matched = left_out = 0
    for rel, want in sorted(listed.items()):
        path = site / rel
        if not path.is_file():
            if REQUIRED.fullmatch(rel):
                return False, f"{where}: {rel} is missing (its RECORD lists it, every engine loads it): {FIX}"
            left_out += 1
            continue
        if record_digest(path) != want:
            return False, f"{where}: {rel} does not match its RECORD (another release's extension?): {FIX}"
        matched += 1
    for path in sorted((site / "vllm").rglob("*.so")):
        rel = path.relative_to(site).as_posix()
        if rel not in listed:
            return False, f"{where}: {rel} is not in its RECORD (left by another release?): {FIX}"
    if not matched:
        return False, f"{where}: none of the extension files its RECORD lists is here: {FIX}"
    return True, f"{where}: {matched} extension files match its RECORD" + (
        f" ({left_out} more it lists are not carried)" if left_out else "")


def main(argv: list[str]) -> int:
    if len(argv) > 1 or argv[:1] in (["-h"], ["--help"]):
        print("usage: python3 tests/on_gpu/site_check.py [SITE]", file=sys.stderr)
        return 2
    site = Path(argv[0] if argv else os.environ.get("MARLIN_PACK_DEVICE_SITE", "/tmp/site"))
    whole, line = check(site)
    print(line, file=sys.stdout if whole else sys.stderr)
    return 0 if whole else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
