"""The CUDA half of ``tools/qualify_release.py``: per-kernel PTX and SASS fingerprints of a wheel's shared objects,
on the CPU, with ``cuobjdump`` and ``nvdisasm`` (PyPI ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm``).

For each library the wheel ships (``qualify_targets.KERNEL_LIBRARIES``): ``cuobjdump -res-usage`` says which embedded
cubins hold a kernel of a family, only those are extracted (``-xelf``) and disassembled (``nvdisasm -c``); all PTX
is extracted (``-xptx all``) and the ``.entry`` of each kernel cut out. Before hashing, per kernel:

* the kernel's own mangled name becomes ``@SELF`` (parameter names include it);
* SASS: instruction offsets (``/*0a40*/``) are dropped (``nvdisasm`` prints no encodings without ``-hex``), and so
  are the section directives; branch labels ``.L_x_N`` are renumbered in order of first use within the kernel
  (their numbers count every kernel of the cubin);
* PTX: comments, blank lines, ``.loc``/``.file`` (source lines) are dropped; block labels ``$L__BBn_m`` lose the
  kernel's index ``n`` in the file, ``__local_depotN`` its number;
* both: the per-build hashes in internal-linkage names (``_INTERNAL_4b186f60_``, ``_cu_3c2e504b``) are blanked.

An instantiation's key comes from its mangled name (``marlin::gptq_marlin_repack_kernel<256, 4>``): the
is_a_8bit template flag some releases carry is dropped when false, and instantiations for 8-bit activations are
not fingerprinted (a bundle holds 16-bit-activation layouts only).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from qualify_targets import KERNEL_LIBRARIES, KernelFamily

__all__ = ["Tools", "find_tools", "HOW_TO_GET", "kernel_key", "kernel_fingerprints", "sass_functions", "ptx_entries"]

NORMALISER = 1  # bump when the normalisation below changes (fingerprints of different versions do not compare)
TOOL_VENV = Path.home() / ".cache" / "marlin-pack" / "qualify-venv"
HOW_TO_GET = (
    "cuobjdump and nvdisasm not found: kernels not checked. They run on the CPU; get them from PyPI into a tool venv:\n"
    f"  python3 -m venv {TOOL_VENV}\n"
    f"  {TOOL_VENV}/bin/pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm\n"
    "(searched: $MARLIN_PACK_CUDA_BIN, PATH, that venv, this interpreter's nvidia/*/bin)"
)


@dataclass(frozen=True)
class Tools:
    cuobjdump: str
    nvdisasm: str


def find_tools() -> Tools | None:
    """cuobjdump and nvdisasm from $MARLIN_PACK_CUDA_BIN, PATH, the tool venv or this interpreter's site-packages."""
    dirs: list[str] = []
    if os.environ.get("MARLIN_PACK_CUDA_BIN"):
        dirs.append(os.environ["MARLIN_PACK_CUDA_BIN"])
    dirs += os.environ.get("PATH", "").split(os.pathsep)
    dirs += sorted(glob.glob(str(TOOL_VENV / "lib" / "python*" / "site-packages" / "nvidia" / "*" / "bin")))
    for entry in sys.path:
        dirs += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "bin")))
        dirs += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_*", "bin")))
    found: dict[str, str] = {}
    for d in dirs:
        for tool in ("cuobjdump", "nvdisasm"):
            p = os.path.join(d, tool)
            if tool not in found and os.path.isfile(p) and os.access(p, os.X_OK):
                found[tool] = p
    if len(found) < 2:
        return None
    return Tools(found["cuobjdump"], found["nvdisasm"])


# --- keys ------------------------------------------------------------------------------------------------------------


def _marlin_repack_key(family: KernelFamily, mangled: str) -> str | None:
    m = re.search(r"marlin_repack_kernelI((?:L[ib]n?\d+E)*)E", mangled)
    if m is None:
        return mangled
    args = re.findall(r"L([ib])(n?\d+)E", m.group(1))
    if any(kind == "b" and value != "0" for kind, value in args):
        return None  # an instantiation for 8-bit activations (is_a_8bit)
    ints = [value.replace("n", "-") for kind, value in args if kind == "i"]
    return f"{family.name}<{', '.join(ints)}>"


_ACT = {"N7cutlass6half_tE": "fp16", "N7cutlass10bfloat16_tE": "bf16"}


def _machete_prepack_key(family: KernelFamily, mangled: str) -> str | None:
    m = re.search(r"prepack_B_kernelILi(\d+)ENS_24PrepackedLayoutBTemplateI(.*)$", mangled)
    if m is None:
        return mangled
    threads, rest = m.groups()
    act = next((name for prefix, name in _ACT.items() if rest.startswith(prefix)), None)
    if act is None:
        return None if re.match(r"N7cutlass\d+float_e[45]m[23]_tE|a|h", rest) else mangled  # 8-bit activations
    rest = rest[len(next(p for p, n in _ACT.items() if n == act)):]
    if rest.startswith("h"):
        weight = "u8"
    elif rest.startswith("a"):
        weight = "s8"
    elif sub := re.match(r"N\w*?vllm_biased_integer_subbyteILi(\d+)ELi(\d+)ELb[01]EEE", rest):
        weight = f"u{sub.group(1)}b{sub.group(2)}"
    elif sub := re.match(r"N\w*?integer_subbyteILi(\d+)ELb([01])EEE", rest):
        weight = f"{'s' if sub.group(2) == '1' else 'u'}{sub.group(1)}"
    else:
        return mangled
    return f"{family.name}<{threads}, {act}, {weight}>"


_PARSERS = {"marlin_repack": _marlin_repack_key, "machete_prepack": _machete_prepack_key}


def kernel_key(family: KernelFamily, mangled: str) -> str | None:
    """The stable key of one instantiation, or None where it is not for 16-bit activations."""
    return _PARSERS[family.parser](family, mangled)


# --- normalisation ---------------------------------------------------------------------------------------------------


def _blank_build_hashes(text: str) -> str:
    text = re.sub(r"_INTERNAL_[0-9a-f]{8}_", "_INTERNAL_h_", text)
    text = re.sub(r"__N__[0-9a-f]{8}_", "__N__h_", text)
    return re.sub(r"_cu_[0-9a-f]{8}", "_cu_h", text)


def _renumber(text: str, pattern: str, stem: str) -> str:
    seen: dict[str, str] = {}

    def sub(m: re.Match[str]) -> str:
        return seen.setdefault(m.group(0), f"{stem}{len(seen)}")

    return re.sub(pattern, sub, text)


def sass_functions(disassembly: str) -> dict[str, str]:
    """``nvdisasm -c`` output -> {mangled name: normalised SASS} for each function section."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in disassembly.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        if current is None:
            continue
        stripped = line.strip()
        is_label = re.match(r"\.L_x_\d+:", stripped) is not None
        if (not stripped or stripped.startswith(("//", "."))) and not is_label:
            continue
        if stripped in (f"{current}:", f".text.{current}:"):
            continue
        stripped = re.sub(r"^/\*[0-9a-f]+\*/\s*", "", stripped)
        stripped = re.sub(r"/\*\s*0x[0-9a-f]+\s*\*/", "", stripped)
        out[current].append(re.sub(r"\s+", " ", stripped).strip())
    return {
        name: _blank_build_hashes(_renumber("\n".join(lines).replace(name, "@SELF"), r"\.L_x_\d+", ".L"))
        for name, lines in out.items()
    }


def ptx_entries(ptx: str) -> tuple[str, dict[str, str]]:
    """A PTX file -> (its ``.target``, {mangled name: normalised body} for each ``.entry``)."""
    target = re.search(r"^\s*\.target\s+(\w+)", ptx, re.M)
    arch = target.group(1) if target else "unknown"
    out: dict[str, str] = {}
    lines = ptx.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$]+)", lines[i])
        if not m:
            i += 1
            continue
        name, body, depth, opened = m.group(1), [], 0, False
        while i < len(lines):
            line = re.sub(r"//.*", "", lines[i]).strip()
            i += 1
            if line and not line.startswith((".loc", ".file")):
                body.append(re.sub(r"\s+", " ", line))
            depth += line.count("{") - line.count("}")
            opened = opened or "{" in line
            if opened and depth <= 0:
                break
        text = "\n".join(body).replace(name, "@SELF")
        text = re.sub(r"\$L__BB\d+_", "$L__BB_", text)
        text = re.sub(r"__local_depot\d+", "__local_depot", text)
        out[name] = _blank_build_hashes(text)
    return arch.replace("sm_", "compute_"), out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- extraction ------------------------------------------------------------------------------------------------------


@dataclass
class KernelPrint:
    """One instantiation's fingerprint: part ("ptx:compute_80", "sass:sm_90a") -> hash, where it was found."""

    family: str
    key: str
    group: str
    parts: dict[str, str] = field(default_factory=dict)
    symbols: set[str] = field(default_factory=set)
    libraries: set[str] = field(default_factory=set)


def _run(args: list[str], cwd: str | None = None) -> str:
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True, errors="replace").stdout


def _cubins_with(tools: Tools, lib: str, symbols: Iterable[str]) -> dict[int, str]:
    """1-based ELF index -> arch of the embedded cubins that define a kernel whose name holds one of ``symbols``."""
    hits: dict[int, str] = {}
    index, arch = 0, "?"
    for line in _run([tools.cuobjdump, "-res-usage", lib]).splitlines():
        if line.startswith("Fatbin elf code"):
            index += 1
        elif m := re.match(r"arch = (\S+)", line):
            arch = m.group(1)
        elif (m := re.match(r"\s*Function (\S+):", line)) and any(s in m.group(1) for s in symbols):
            hits[index] = arch
    return hits


def _library_prints(
    tools: Tools, lib: str, label: str, families: tuple[KernelFamily, ...], into: dict[str, KernelPrint], workdir: str
) -> None:
    symbols = [f.symbol for f in families]
    encoded = [s.encode() for s in symbols]
    wanted = _cubins_with(tools, lib, symbols)
    stem = os.path.basename(lib).removesuffix(".so")
    chosen = [f"{stem}.{i}.{arch}.cubin" for i, arch in sorted(wanted.items())]  # cuobjdump -lelf's names
    elf_dir = tempfile.mkdtemp(dir=workdir)
    cubins: list[str] = []
    if chosen:
        _run([tools.cuobjdump, "-xelf", ",".join(chosen), lib], cwd=elf_dir)
        cubins = [os.path.join(elf_dir, n) for n in chosen if os.path.exists(os.path.join(elf_dir, n))]
        if len(cubins) != len(chosen) or not all(any(s in Path(c).read_bytes() for s in encoded) for c in cubins):
            # the names or the -res-usage order did not match the ELF list: take every cubin, keep those naming a kernel
            shutil.rmtree(elf_dir)
            elf_dir = tempfile.mkdtemp(dir=workdir)
            _run([tools.cuobjdump, "-xelf", "all", lib], cwd=elf_dir)
            cubins = [str(p) for p in sorted(Path(elf_dir).iterdir()) if any(s in p.read_bytes() for s in encoded)]

    def disassemble(cubin: str) -> tuple[str, str]:
        arch = re.search(r"\.(sm_\w+)\.cubin$", cubin)
        return (arch.group(1) if arch else "sm_?"), _run([tools.nvdisasm, "-c", "-ndf", cubin])

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for arch, text in pool.map(disassemble, cubins):
            for name, code in sass_functions(text).items():
                _add(into, families, name, f"sass:{arch}", code, label)
    shutil.rmtree(elf_dir, ignore_errors=True)

    ptx_dir = tempfile.mkdtemp(dir=workdir)
    _run([tools.cuobjdump, "-xptx", "all", lib], cwd=ptx_dir)
    for path in sorted(Path(ptx_dir).iterdir()):
        data = path.read_bytes()
        if any(s in data for s in encoded):
            arch, entries = ptx_entries(data.decode("utf-8", errors="replace"))
            for name, code in entries.items():
                _add(into, families, name, f"ptx:{arch}", code, label)
        path.unlink()
    shutil.rmtree(ptx_dir, ignore_errors=True)


def _add(into: dict[str, KernelPrint], families: tuple[KernelFamily, ...], name: str, part: str, code: str, lib: str) -> None:
    family = next((f for f in families if f.symbol in name), None)
    if family is None:
        return
    key = kernel_key(family, name)
    if key is None:
        return
    kp = into.setdefault(key, KernelPrint(family.name, key, family.group))
    digest = _digest(code)
    previous = kp.parts.get(part)
    kp.parts[part] = digest if previous in (None, digest) else "+".join(sorted({*previous.split("+"), digest}))
    kp.symbols.add(name)
    kp.libraries.add(lib)


def kernel_fingerprints(wheel_path: str | Path, tools: Tools, families: tuple[KernelFamily, ...]) -> dict[str, KernelPrint]:
    """key -> :class:`KernelPrint` of every 16-bit-activation instantiation of ``families`` in the wheel's libraries."""
    import zipfile

    out: dict[str, KernelPrint] = {}
    encoded = [f.symbol.encode() for f in families]
    with zipfile.ZipFile(wheel_path) as zf, tempfile.TemporaryDirectory(prefix="qualify-") as work:
        libs: dict[str, str] = {}
        for member in sorted(n for n in zf.namelist() if re.match(KERNEL_LIBRARIES, n)):
            libs[member] = os.path.join(work, os.path.basename(member))
            with zf.open(member) as src, open(libs[member], "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        # A library that launches a kernel registers it by its mangled name (host-side string): read only those,
        # or every library where none names one.
        named = [m for m, lib in libs.items() if _names_any(lib, encoded)]
        for member in named or list(libs):
            _library_prints(tools, libs[member], member, families, out, work)
    return out


def _names_any(path: str, needles: list[bytes]) -> bool:
    overlap = max(len(n) for n in needles)
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            block = tail + chunk
            if any(n in block for n in needles):
                return True
            tail = block[-overlap:]
    return False
