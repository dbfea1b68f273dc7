"""tests/on_gpu/use_release.sh on the CPU: releases staged and switched in /tmp/site's stead, as on the GPU machine.

Fake build-carry folders (an extension .tgz cut in parts, ``b/vllm-py.tgz``, ``b/parts``) of two releases: each switch
leaves exactly the release switched to importable, the wheels' folder untouched, and a release whose parts did not
all arrive is refused with exit 3 and nothing replaced.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).with_name("use_release.sh")


def _tgz(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _carry(root: Path, release: str, parts: int = 3) -> Path:
    """A build-carry folder of ``release``: the 'extension' in ``parts`` parts (a1, a2, ...), the package in b."""
    dest = root / f".device-carry-{release}"
    ext = _tgz({"vllm/_C_stable_libtorch.abi3.so": f"extension {release}"})
    step = len(ext) // parts + 1
    for i in range(parts):
        (dest / f"a{i + 1}").mkdir(parents=True)
        (dest / f"a{i + 1}" / f"c.part.{i:02d}").write_bytes(ext[i * step:(i + 1) * step])
    (dest / "b").mkdir()
    (dest / "b" / "parts").write_text(f"{parts}\n")
    (dest / "b" / "vllm-py.tgz").write_bytes(_tgz({
        "vllm/__init__.py": f"__version__ = {release!r}\n",
        f"vllm-{release}.dist-info/METADATA": f"Name: vllm\nVersion: {release}\n",
    }))
    return dest


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MARLIN_PACK_DEVICE_SITE": str(tmp / "site"), "MARLIN_PACK_DEVICE_STAGE_ROOT": str(tmp),
           "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp, env=env, capture_output=True, text=True)


def test_releases_switch_one_after_the_other(tmp_path: Path) -> None:
    (tmp_path / "site" / "wheel_pkg").mkdir(parents=True)  # what stage b's wheels left there
    old, new = _carry(tmp_path, "0.34.0"), _carry(tmp_path, "0.31.0")
    for release, dest in (("0.34.0", old), ("0.31.0", new)):
        parts = sorted(dest.glob("a*"))
        hidden = tmp_path / "not-this-call"
        hidden.mkdir(exist_ok=True)
        for i, part in enumerate(parts):  # one call per part: only that part is in DEST during its stage
            for other in parts:
                if other != part:
                    other.rename(hidden / other.name)
            staged = _run(tmp_path, "stage", str(dest))
            assert staged.returncode == 0 and f"{i + 1} of {len(parts)} part(s)" in staged.stdout, staged
            for other in hidden.iterdir():
                other.rename(dest / other.name)
        for part in parts:  # the switching call carries b only
            for f in part.iterdir():
                f.unlink()
        (tmp_path / "vllm-cache").mkdir(exist_ok=True)
        switched = _run(tmp_path, "switch", str(dest))
        assert switched.returncode == 0, switched.stderr
        assert f"vllm {release} in" in switched.stdout
        site = tmp_path / "site"
        assert (site / "vllm" / "_C_stable_libtorch.abi3.so").read_text() == f"extension {release}"
        assert [p.name for p in site.glob("vllm-*.dist-info")] == [f"vllm-{release}.dist-info"]
        assert (site / "wheel_pkg").is_dir() and not (tmp_path / "vllm-cache").exists()


def test_a_release_with_parts_missing_is_refused_and_nothing_replaced(tmp_path: Path) -> None:
    old, new = _carry(tmp_path, "0.34.0"), _carry(tmp_path, "0.30.0", parts=4)
    assert _run(tmp_path, "switch", str(old)).returncode == 0
    for part in ("a3", "a4"):  # these calls never reached the machine
        for f in (new / part).iterdir():
            f.unlink()
    refused = _run(tmp_path, "switch", str(new))
    assert refused.returncode == 3
    assert "0.30.0: 2 of 4 extension parts staged" in refused.stderr and "send the calls again" in refused.stderr
    assert (tmp_path / "site" / "vllm" / "__init__.py").read_text() == "__version__ = '0.34.0'\n"
