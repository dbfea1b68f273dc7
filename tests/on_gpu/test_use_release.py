"""tests/on_gpu/use_release.sh and site_check.py on the CPU: releases staged and switched in /tmp/site's stead, as on
the GPU machine, every call carrying only its folders of the carry.

Fake build-carry folders (an extension .tgz cut in parts ``a*``, a tiny wheel in ``w1``, ``b/vllm-py.tgz`` with a
RECORD whose sha256s match, ``b/parts``): the first release installs on a bare machine (its wheel too); each switch
leaves exactly the release switched to, its extension replaced, the wheels kept; a release whose parts or wheels did
not arrive is refused with one line, exit 3, nothing replaced. ``site_check.py`` passes a whole site and refuses, with
one line and exit 3, a mismatched, unlisted or missing extension and two releases' files (the 0.31-extension-under-
0.34-Python incident); ``device.sh`` and ``benchmarks/on_device.sh`` stop on it before running anything.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SCRIPT, SITE_CHECK = HERE / "use_release.sh", HERE / "site_check.py"
REPO = HERE.parents[1]
EXT, MOE = "vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so"


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _tgz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _wheel(folder: Path) -> None:
    """A tiny pure-Python wheel, ``fakedep`` 1.0 (one of the carry's dependency wheels)."""
    files = {"fakedep/__init__.py": b"VALUE = 1\n",
             "fakedep-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: fakedep\nVersion: 1.0\n",
             "fakedep-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},{_digest(d)},{len(d)}\n" for n, d in files.items()) + "fakedep-1.0.dist-info/RECORD,,\n"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "fakedep-1.0-py3-none-any.whl", "w") as z:
        for name, data in {**files, "fakedep-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(name, data)


def _carry(root: Path, release: str, parts: int = 3, only: str | None = None) -> Path:
    """A build-carry folder of ``release`` as the CPU machine has it: the extensions in ``parts`` parts (a1, a2, ...),
    a wheel (w1), the package in b with its RECORD (a flash-attention extension it lists is not carried); ``only``:
    one more extension file in the package, of this release alone."""
    dest = root / "carry" / f".device-carry-{release}"
    ext = {EXT: f"extension {release}".encode(), MOE: f"moe {release}".encode()}
    py = {"vllm/__init__.py": f"__version__ = {release!r}\n".encode(), "vllm/cumem_allocator.abi3.so": f"cumem {release}".encode()}
    if only:
        py[f"vllm/{only}"] = f"{only} {release}".encode()
    info = f"vllm-{release}.dist-info"
    record = "".join(f"{n},{_digest(d)},{len(d)}\n" for n, d in {**ext, **py}.items())
    record += f"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so,{_digest(b'not carried')},11\n{info}/RECORD,,\n"
    py |= {f"{info}/METADATA": f"Name: vllm\nVersion: {release}\n".encode(), f"{info}/RECORD": record.encode()}
    tgz = _tgz(ext)
    step = len(tgz) // parts + 1
    for i in range(parts):
        (dest / f"a{i + 1}").mkdir(parents=True)
        (dest / f"a{i + 1}" / f"c.part.{i:02d}").write_bytes(tgz[i * step:(i + 1) * step])
    _wheel(dest / "w1")
    (dest / "b").mkdir()
    (dest / "b" / "parts").write_text(f"{parts}\n")
    (dest / "b" / "vllm-py.tgz").write_bytes(_tgz(py))
    return dest


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "MARLIN_PACK_DEVICE_SITE": str(tmp / "site"), "MARLIN_PACK_DEVICE_STAGE_ROOT": str(tmp / "stage"),
            "MARLIN_PACK_DEVICE_WHEELS": str(tmp / "wheels"), "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _call(tmp: Path, action: str, dest: Path, *folders: str) -> subprocess.CompletedProcess[str]:
    """One device call: a tree carrying only ``folders`` of ``dest`` runs ``use_release.sh ACTION DEST``."""
    tree = tmp / f"call-{len(list(tmp.glob('call-*')))}"
    for folder in folders:
        shutil.copytree(dest / folder, tree / dest.name / folder)
    tree.mkdir(exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), action, dest.name], cwd=tree, env=_env(tmp), capture_output=True, text=True)


def _install(tmp: Path, dest: Path, *, wheels: bool = True) -> subprocess.CompletedProcess[str]:
    """The recipe: one staging call per a* part (the wheels with the first), then the switch carrying b."""
    parts = sorted(p.name for p in dest.glob("a*"))
    for i, part in enumerate(parts):
        staged = _call(tmp, "stage", dest, part, *(["w1"] if wheels and i == 0 else []))
        assert staged.returncode == 0 and f"{i + 1} of ? part(s)" in staged.stdout, staged  # b: not this call's
    return _call(tmp, "switch", dest, "b")


def _site_check(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SITE_CHECK), str(site)], capture_output=True, text=True)


def _one_line(text: str) -> str:
    assert text.count("\n") == 1, text
    return text


def test_the_first_release_installs_on_a_bare_machine(tmp_path: Path) -> None:
    switched = _install(tmp_path, _carry(tmp_path, "0.34.0"))
    assert switched.returncode == 0, switched.stderr
    site = tmp_path / "site"
    assert "0.34.0: 1 wheel(s) installed" in switched.stdout
    assert f"vllm 0.34.0 in {site}: 3 extension files match its RECORD (1 more it lists are not carried)" in switched.stdout
    assert switched.stdout.rstrip().endswith(f"vllm 0.34.0 in {site / 'vllm'}")
    assert (site / EXT).read_text() == "extension 0.34.0" and (site / "fakedep" / "__init__.py").is_file()


def test_releases_switch_one_after_the_other(tmp_path: Path) -> None:
    first, second = _carry(tmp_path, "0.34.0", only="_flashmla_extension_C.abi3.so"), _carry(tmp_path, "0.31.0")
    assert _install(tmp_path, first).returncode == 0
    wheel = tmp_path / "site" / "fakedep" / "__init__.py"
    wheel.write_text("VALUE = 'kept'\n")  # a wheel installed once stays: the later switches install none
    for release, dest, wheels in (("0.31.0", second, False), ("0.34.0", first, False)):
        (tmp_path / "vllm-cache").mkdir(exist_ok=True)
        # 0.34.0 again: its parts are still staged, the switching call alone brings it back
        switched = _install(tmp_path, dest, wheels=wheels) if release == "0.31.0" else _call(tmp_path, "switch", dest, "b")
        assert switched.returncode == 0, switched.stderr
        assert "wheel(s) installed" not in switched.stdout and f"vllm {release} in" in switched.stdout
        site = tmp_path / "site"
        assert (site / EXT).read_text() == f"extension {release}" and (site / MOE).read_text() == f"moe {release}"
        assert [p.name for p in site.glob("vllm-*.dist-info")] == [f"vllm-{release}.dist-info"]
        assert (site / "vllm" / "_flashmla_extension_C.abi3.so").exists() == (release == "0.34.0")
        assert wheel.read_text() == "VALUE = 'kept'\n" and not (tmp_path / "vllm-cache").exists()


def test_a_release_with_parts_missing_is_refused_and_nothing_replaced(tmp_path: Path) -> None:
    old, new = _carry(tmp_path, "0.34.0"), _carry(tmp_path, "0.30.0", parts=4)
    assert _install(tmp_path, old).returncode == 0
    for part in ("a1", "a2"):  # a3 and a4's calls never reached the machine
        assert _call(tmp_path, "stage", new, part).returncode == 0
    refused = _call(tmp_path, "switch", new, "b")
    assert refused.returncode == 3 and refused.stdout == ""
    assert "0.30.0: 2 of 4 extension parts staged" in _one_line(refused.stderr) and "send the calls again" in refused.stderr
    assert (tmp_path / "site" / "vllm" / "__init__.py").read_text() == "__version__ = '0.34.0'\n"
    assert _site_check(tmp_path / "site").returncode == 0


def test_a_bare_machine_without_wheels_is_refused(tmp_path: Path) -> None:
    refused = _install(tmp_path, _carry(tmp_path, "0.34.0"), wheels=False)
    assert refused.returncode == 3 and "no wheels staged" in _one_line(refused.stderr)
    assert not (tmp_path / "site" / "vllm").exists()


def _mixed(site: Path, how: str) -> str:
    """``site`` (a whole 0.34.0) spoiled as ``how`` says; the file the refusal names."""
    if how == "0.31 extension under 0.34 Python":  # what install.sh b did, its extension kept
        (site / EXT).write_text("extension 0.31.0")
        return EXT
    if how == "a file of another release":
        (site / "vllm" / "_qutlass_C.abi3.so").write_text("0.31.0's")
        return "vllm/_qutlass_C.abi3.so"
    if how == "two releases' dist-info":
        (site / "vllm-0.31.0.dist-info").mkdir()
        return "vllm-0.31.0.dist-info"
    (site / MOE).unlink()
    return MOE


@pytest.mark.parametrize("how", ["0.31 extension under 0.34 Python", "a file of another release", "two releases' dist-info",
                                 "_moe_C missing"])
def test_site_check_passes_a_whole_release_and_refuses_a_mixed_one(tmp_path: Path, how: str) -> None:
    assert _install(tmp_path, _carry(tmp_path, "0.34.0")).returncode == 0
    site = tmp_path / "site"
    whole = _site_check(site)
    assert whole.returncode == 0 and whole.stderr == ""
    assert _one_line(whole.stdout).startswith(f"vllm 0.34.0 in {site}: 3 extension files match its RECORD")
    named = _mixed(site, how)
    refused = _site_check(site)
    assert refused.returncode == 3 and refused.stdout == ""
    assert named in _one_line(refused.stderr) and "use_release.sh stage/switch" in refused.stderr


def test_site_check_refuses_a_bare_site(tmp_path: Path) -> None:
    refused = _site_check(tmp_path)
    assert refused.returncode == 3 and "no vLLM unpacked" in _one_line(refused.stderr)


@pytest.mark.parametrize("script", ["tests/on_gpu/device.sh", "benchmarks/on_device.sh"])
def test_the_device_scripts_stop_on_a_mixed_install_before_anything_runs(tmp_path: Path, script: str) -> None:
    assert _install(tmp_path, _carry(tmp_path, "0.34.0")).returncode == 0
    _mixed(tmp_path / "site", "0.31 extension under 0.34 Python")
    # run from an empty folder: were the check to let it through, the scripts' `pip install .` would find no project
    (tmp_path / "cwd").mkdir()
    args = ["tests/on_gpu/test_nothing.py"] if script.startswith("tests") else [str(REPO / "benchmarks" / "bench_check.py")]
    done = subprocess.run(["bash", str(REPO / script), *args], cwd=tmp_path / "cwd", capture_output=True, text=True,
                          env={**_env(tmp_path), "OUT": str(tmp_path / "out")}, timeout=60)
    assert done.returncode == 3 and done.stdout == ""
    assert EXT in _one_line(done.stderr) and "use_release.sh stage/switch" in done.stderr
    assert not (tmp_path / "out").exists()  # no pytest, no benchmark, no log
