"""tools/qualify_release.py on tiny synthetic wheels (zip files made here): same, changed, moved, missing, new, the
normalisation, the exit status and JSON; the kernel half's parsing on synthetic disassembly, and on a real wheel
only where one and cuobjdump/nvdisasm are at hand (slow)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import qualify_ast as qa  # noqa: E402
import qualify_kernels as qk  # noqa: E402
import qualify_release as qr  # noqa: E402
from qualify_targets import KERNELS, LAYOUT, PLUGIN_READS, Item  # noqa: E402

OLD = {
    "vllm/__init__.py": "",
    "vllm/layout.py": '''
        """The layout helpers."""
        from copy import deepcopy

        SIZES = [-1, 32, 64, 128]
        KERNELS = {Platform.CUDA: [Machete, Marlin], Platform.ROCM: [Triton]}


        def unchanged(x: int, scale: float = 1.0) -> int:
            """Doubles."""
            # a comment
            y: int = x * 2
            return y


        def changed(x):
            return x + 1


        def messages(x):
            assert x > 0, "x must be positive"
            if x > 10:
                raise ValueError(f"too big: {x}")
            logger.warning("x is %d", x)
            return x


        def moving(x):
            return x - 1


        def moving_and_changing(x):
            return x - 2


        def leaving(x):
            return x


        class Base:
            def flag(self):
                return False


        class Method(Base):
            def create(self, layer):
                return layer
    ''',
    "vllm/reexport.py": "from vllm.layout import unchanged\n",
    "vllm/envs.py": '''
        environment_variables = {"VLLM_A": lambda: 1, "VLLM_B": lambda: 2, "VLLM_D": lambda: 3}
    ''',
}

NEW = {
    "vllm/__init__.py": "",
    "vllm/layout.py": '''
        from copy import deepcopy

        SIZES = [-1, 32, 64, 128]
        KERNELS = {Platform.CUDA: [Machete, Marlin], Platform.ROCM: [Triton, Exllama]}


        def unchanged(x: "int", scale: "float | None" = 1.0) -> "int":
            y = (x *
                 2)
            return y


        def changed(x):
            return x + 2


        def messages(x):
            assert x > 0, "x must be > 0"
            if x > 10:
                raise ValueError("x is too big")
            logger.warning("x=%d", x)
            return x


        def arriving(x):
            return x


        class Base:
            def flag(self):
                return False


        class Method(Base):
            def create(self, layer):
                return layer

            def flag(self):
                return True
    ''',
    "vllm/elsewhere.py": '''
        def moving(x):
            """Moved here, code as it was."""
            return x - 1


        def moving_and_changing(x):
            return x - 3
    ''',
    "vllm/reexport.py": "from vllm.layout import unchanged\n",
    "vllm/envs.py": '''
        removed_environment_variables = {"VLLM_B": "gone"}
        environment_variables = {"VLLM_A": lambda: 1, "VLLM_C": lambda: 4, "VLLM_D": lambda: 30}
    ''',
}


def make_wheel(folder: Path, version: str, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, textwrap.dedent(text))
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return path


@pytest.fixture
def wheels(tmp_path: Path) -> tuple[Path, Path]:
    return make_wheel(tmp_path / "w", "0.1.0", OLD), make_wheel(tmp_path / "w", "0.2.0", NEW)


def _row(wheels: tuple[Path, Path], target: str, **kw: object) -> qr.Row:
    old, new = qa.Wheel(wheels[0]), qa.Wheel(wheels[1])
    return qr.compare_python(old, new, target, "layout", "test", **kw)


@pytest.mark.parametrize(
    ("target", "status", "detail"),
    [
        ("vllm.layout:unchanged", "same", ""),  # docstring, comment, annotations, formatting only
        ("vllm.layout:changed", "changed", "code changed"),
        ("vllm.layout:messages", "same", "message text only"),
        ("vllm.layout:SIZES", "same", ""),
        ("vllm.layout:KERNELS[Platform.CUDA]", "same", ""),
        ("vllm.layout:KERNELS[Platform.ROCM]", "changed", "code changed"),
        ("vllm.layout:Method.create", "same", ""),
        ("vllm.layout:leaving", "missing", "not found in 0.2.0"),
        ("vllm.layout:arriving", "new", "not in 0.1.0"),
        ("vllm.layout:nowhere", "absent", "in neither 0.1.0 nor 0.2.0"),
        ("vllm.layout:deepcopy", "same", ""),  # a binding from outside vllm
        ("vllm.reexport:unchanged", "same", ""),  # followed to its definer
    ],
)
def test_python_rows(wheels: tuple[Path, Path], target: str, status: str, detail: str) -> None:
    row = _row(wheels, target)
    assert (row.status, row.detail) == (status, detail)


def test_a_moved_function_is_found_by_name(wheels: tuple[Path, Path]) -> None:
    row = _row(wheels, "vllm.layout:moving")
    assert row.status == "moved"
    assert row.detail == "vllm.layout:moving -> vllm.elsewhere:moving; code same"
    assert (row.old, row.new) == ("vllm.layout:moving", "vllm.elsewhere:moving")
    changing = _row(wheels, "vllm.layout:moving_and_changing", want_diff=True)
    assert changing.status == "moved" and changing.detail.endswith("; code changed")


def test_a_method_now_defined_on_the_class_is_a_change(wheels: tuple[Path, Path]) -> None:
    row = _row(wheels, "vllm.layout:Method.flag")
    assert row.status == "changed"
    assert row.detail == "defined by vllm.layout:Method.flag (was vllm.layout:Base.flag)"


def test_diff_shows_the_normalised_code(wheels: tuple[Path, Path]) -> None:
    row = _row(wheels, "vllm.layout:changed", want_diff=True)
    assert "-    return x + 1\n+    return x + 2\n" in row.diff
    assert _row(wheels, "vllm.layout:unchanged", want_diff=True).diff == ""


def test_existence_only_rows_ignore_the_code(wheels: tuple[Path, Path]) -> None:
    assert _row(wheels, "vllm.layout:changed", existence_only=True).status == "same"
    assert _row(wheels, "vllm.layout:moving", existence_only=True).status == "moved"


def test_env_rows(wheels: tuple[Path, Path]) -> None:
    old, new = qa.Wheel(wheels[0]), qa.Wheel(wheels[1])
    got = {n: (r.status, r.detail) for n in ("VLLM_A", "VLLM_B", "VLLM_C", "VLLM_D", "VLLM_E") for r in [qr.compare_env(old, new, n)]}
    assert got == {
        "VLLM_A": ("same", ""),
        "VLLM_B": ("missing", "moved to removed_environment_variables"),
        "VLLM_C": ("new", "absent in 0.1.0"),
        "VLLM_D": ("changed", "its definition changed"),
        "VLLM_E": ("absent", "absent in 0.1.0, absent in 0.2.0"),
    }


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("def f(x):\n    '''doc'''\n    return x", "def f(x):\n    return x  # note", True),
        ("def f(x: int) -> int:\n    y: int = x\n    return y", "def f(x):\n    y = x\n    return y", True),
        ("def f(x):\n    return x", "def f(x):\n    return -x", False),
        ("def f(x):\n    return getattr(x, 'qzeros')", "def f(x):\n    return getattr(x, 'w_zp')", False),
        ("def f(x=1):\n    return x", "def f(x=2):\n    return x", False),
        ("def f(x):\n    return x", "@cache\ndef f(x):\n    return x", False),
        ("class C:\n    a: int = 1", "class C:\n    a: float = 1", False),  # a dataclass field's type counts
    ],
)
def test_normalisation(a: str, b: str, same: bool) -> None:
    def prints(src: str) -> tuple[str, str]:
        node = __import__("ast").parse(src).body[0]
        return qa.fingerprint(qa.Found("m", "f", node))

    assert (prints(a)[0] == prints(b)[0]) is same


def test_message_text_changes_only_the_strict_hash() -> None:
    import ast

    a = ast.parse("def f(x):\n    assert x, 'a'\n    raise E('b')\n    logger.info('c')\n    return x").body[0]
    b = ast.parse("def f(x):\n    assert x, 'A'\n    raise E('B', 1)\n    logger.info('C %s', x)\n    return x").body[0]
    c = ast.parse("def f(x):\n    assert not x, 'a'\n    raise E('b')\n    logger.info('c')\n    return x").body[0]
    pa, pb, pc = (qa.fingerprint(qa.Found("m", "f", n)) for n in (a, b, c))
    assert pa[0] != pb[0] and pa[1] == pb[1]
    assert pa[1] != pc[1]


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = qr.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_main_json_and_exit_status(wheels: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qr, "LAYOUT", (Item("vllm.layout:unchanged", "t"), Item("vllm.layout:changed", "t")))
    code, out, _ = _main(capsys, str(wheels[1]), "--against", str(wheels[0]), "--no-kernels", "--json")
    report = json.loads(out)
    assert code == 1 and report["exit"] == 1
    assert (report["old"]["version"], report["new"]["version"]) == ("0.1.0", "0.2.0")
    assert report["kernels_checked"] is False
    assert {r["status"] for r in report["rows"] if r["section"] == "kernels"} == {"skipped"}
    layout = {r["name"]: r["status"] for r in report["rows"] if r["section"] == "layout"}
    assert layout == {"vllm.layout:unchanged": "same", "vllm.layout:changed": "changed"}
    assert report["summary"]["changed"] == 1


def test_identical_wheels_exit_0_and_versions_are_looked_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_wheel(tmp_path, "0.1.0", OLD)
    make_wheel(tmp_path, "0.1.1", OLD)
    code, out, _ = _main(capsys, "0.1.1", "--against", "0.1.0", "--wheels-dir", str(tmp_path), "--no-kernels", "--json")
    report = json.loads(out)
    assert code == 0 and report["exit"] == 0
    assert report["new"]["wheel"].endswith("vllm-0.1.1-cp38-abi3-manylinux_2_28_x86_64.whl")
    # the real lists: every layout row is there (absent from these synthetic wheels)
    assert {r["name"] for r in report["rows"] if r["section"] == "layout"} == {i.target for i in LAYOUT}
    assert set(report["summary"]) <= {"same", "absent", "skipped"}


def test_a_table_row_per_fingerprint(wheels: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    old, new = qa.Wheel(wheels[0]), qa.Wheel(wheels[1])
    items = tuple(Item(f"vllm.layout:{n}", "test") for n in ("unchanged", "changed", "moving", "leaving", "arriving"))
    rows = qr.compare(old, new, kernels=None, layout=items, reads=(), patch=[], env=("VLLM_B",), imports=[])
    table = qr.render(rows, old, new)
    for status, name in [("same", "unchanged"), ("changed", "changed"), ("moved", "moving"), ("missing", "leaving"), ("new", "arriving")]:
        assert any(line.split()[:2] == [status, f"vllm.layout:{name}"] for line in table.splitlines()), table
    assert "summary: 1 same, 1 changed, 1 moved, 2 missing, 1 new, 3 skipped" in table
    changes_only = qr.render(rows, old, new, only_changes=True)
    assert "vllm.layout:leaving" in changes_only and "vllm.layout:unchanged" not in changes_only
    assert qr.exit_status(rows, tools_missing=False) == 1
    same = [r for r in rows if r.status == "same"]
    assert qr.exit_status(same, tools_missing=False) == 0 and qr.exit_status(same, tools_missing=True) == 3


def test_missing_tools_say_how_to_get_them(wheels: tuple[Path, Path], capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qk, "find_tools", lambda: None)
    code, out, err = _main(capsys, str(wheels[0]), "--against", str(wheels[0]))
    assert code == 3
    assert "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm" in err
    assert "(kernels not checked)" in out


def test_an_unknown_version_says_how_to_download_it(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"pip download vllm==9\.9\.9 --no-deps"):
        qr.find_wheel("9.9.9", tmp_path)
    with pytest.raises(SystemExit, match="no such wheel file"):
        qr.find_wheel(str(tmp_path / "nope.whl"), tmp_path)


def test_a_broken_wheel_is_refused(tmp_path: Path, wheels: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "vllm-0.0.1-x.whl"
    bad.write_bytes(b"not a zip")
    code, _, err = _main(capsys, str(bad), "--against", str(wheels[0]), "--no-kernels")
    assert code == 2 and "cannot read a wheel" in err


def test_the_plugins_surface_is_read_from_the_repository() -> None:
    targets = qr.catalog_targets()
    assert targets and all(t.startswith("vllm.") and ":" in t for t, _ in targets)
    imports = qr.plugin_imports()
    assert "vllm.model_executor.utils:is_weights_pre_processed" in imports
    assert all(i.startswith("vllm.") for i in imports)
    assert all(i.target.count(":") == 1 for i in (*LAYOUT, *PLUGIN_READS))


# --- kernels ---------------------------------------------------------------------------------------------------------

GPTQ, AWQ, MACHETE = KERNELS
_MACHETE_NAME = (
    "_ZN7machete16prepack_B_kernelILi128ENS_24PrepackedLayoutBTemplateIN7cutlass{act}E{b}S3_fNS2_6layout11ColumnMajorENS2_"
    "4gemm35KernelTmaWarpSpecializedCooperativeENS_16IlvBlkLayoutAutoEEEN4cute6TensorINSA_10ViewEngineIPKhEENSA_6Layout"
    "INSA_5tupleIJmmmEEESI_EEEEhEEvT1_PT2_"
)


@pytest.mark.parametrize(
    ("family", "mangled", "key"),
    [
        (GPTQ, "_ZN6marlin25gptq_marlin_repack_kernelILi256ELi4ELb0EEEvPKjPjii", "marlin::gptq_marlin_repack_kernel<256, 4>"),
        (GPTQ, "_ZN6marlin25gptq_marlin_repack_kernelILi256ELi4EEEvPKjPjii", "marlin::gptq_marlin_repack_kernel<256, 4>"),
        (GPTQ, "_ZN6marlin25gptq_marlin_repack_kernelILi256ELi8ELb1EEEvPKjPjii", None),  # 8-bit activations
        (AWQ, "_ZN6marlin24awq_marlin_repack_kernelILi256ELi8ELb0EEEvPKjPjii", "marlin::awq_marlin_repack_kernel<256, 8>"),
        (MACHETE, _MACHETE_NAME.format(act="6half_t", b="h"), "machete::prepack_B_kernel<128, fp16, u8>"),
        (MACHETE, _MACHETE_NAME.format(act="10bfloat16_t", b="NS2_15integer_subbyteILi4ELb0EEE"),
         "machete::prepack_B_kernel<128, bf16, u4>"),
        (MACHETE, "_ZN7machete16prepack_B_kernelIunknown", "_ZN7machete16prepack_B_kernelIunknown"),  # kept whole
    ],
)
def test_kernel_keys(family: qk.KernelFamily, mangled: str, key: str | None) -> None:
    assert qk.kernel_key(family, mangled) == key


def _sass(name: str, labels: tuple[int, int], op: str = "IADD3 R1, R1, -0x20, RZ ;", base: int = 0) -> str:
    a, b = labels
    return textwrap.dedent(f"""\
        //--------------------- .text.{name} --------------------------
        \t.section\t.text.{name},"ax",@progbits
        \t.sectioninfo\t@"SHI_REGISTERS=30"
                .global         {name}
                .size           {name},(.L_x_{b} - {name})
        {name}:
        .text.{name}:
                /*{base:04x}*/                   {op}
                /*{base + 16:04x}*/               @P0 BRA `(.L_x_{a}) ;
        .L_x_{a}:
                /*{base + 32:04x}*/                   EXIT ;
        .L_x_{b}:
    """)


def test_sass_is_compared_without_offsets_label_numbers_or_names() -> None:
    first = qk.sass_functions(_sass("_Z1fILb0EEvv", (3, 4)) + _sass("_Z1gv", (5, 6)))
    second = qk.sass_functions(_sass("_Z1fEvv", (17, 18), base=0x400))
    changed = qk.sass_functions(_sass("_Z1fEvv", (3, 4), op="IADD3 R1, R1, -0x40, RZ ;"))
    assert set(first) == {"_Z1fILb0EEvv", "_Z1gv"}
    assert first["_Z1fILb0EEvv"] == second["_Z1fEvv"] != changed["_Z1fEvv"]
    assert second["_Z1fEvv"].splitlines() == ["IADD3 R1, R1, -0x20, RZ ;", "@P0 BRA `(.L0) ;", ".L0:", "EXIT ;", ".L1:"]


def _ptx(entries: list[tuple[str, int, str]]) -> str:
    out = ".version 9.0\n.target sm_80\n.address_size 64\n"
    for name, index, op in entries:
        out += textwrap.dedent(f"""
            .visible .entry {name}(
            .param .u64 {name}_param_0
            )
            {{
            .reg .b32 %r<4>;
            .loc 1 {index + 40} 3
            ld.param.u64 %rd1, [{name}_param_0];  // the pointer
            @%p1 bra $L__BB{index}_2;
            {{ // inline asm
            {op}
            }}
            $L__BB{index}_2:
            ret;
            }}
        """)
    return out


def test_ptx_is_compared_per_entry_without_its_index_or_name() -> None:
    arch, a = qk.ptx_entries(_ptx([("_Z1gv", 0, "mov.u32 %r1, 1;"), ("_Z1fILb0EEvv", 1, "mov.u32 %r1, 2;")]))
    _, b = qk.ptx_entries(_ptx([("_Z1fEvv", 0, "mov.u32 %r1, 2;")]))
    _, c = qk.ptx_entries(_ptx([("_Z1fEvv", 0, "mov.u32 %r1, 3;")]))
    assert arch == "compute_80" and set(a) == {"_Z1gv", "_Z1fILb0EEvv"}
    assert a["_Z1fILb0EEvv"] == b["_Z1fEvv"] != c["_Z1fEvv"]
    assert a["_Z1gv"] != a["_Z1fILb0EEvv"]


def test_kernel_rows(wheels: tuple[Path, Path]) -> None:
    def kp(key: str, **parts: str) -> qk.KernelPrint:
        return qk.KernelPrint(GPTQ.name, key, GPTQ.group, dict(parts), libraries={"vllm/_C.so"})

    k4, k8, k2, k1 = (f"{GPTQ.name}<256, {b}>" for b in (4, 8, 2, 1))
    old = {k4: kp(k4, ptx="a", sass="b"), k8: kp(k8, ptx="c", sass="d"), k2: kp(k2, ptx="e")}
    new = {k4: kp(k4, ptx="a", sass="b"), k8: kp(k8, ptx="c", sass="x"), k1: kp(k1, ptx="f")}
    rows = {r.name: (r.status, r.detail) for r in qr.compare_kernels(old, new, "0.1.0", "0.2.0")}
    assert rows[k4] == ("same", "ptx, sass")
    assert rows[k8] == ("changed", "differs: sass")
    assert rows[k2] == ("missing", "not in 0.2.0") and rows[k1] == ("new", "not in 0.1.0")
    assert rows[AWQ.name][0] == rows[MACHETE.name][0] == "absent"


def _real_wheel() -> Path | None:
    folder = os.environ.get("MARLIN_PACK_WHEELS")
    hits = sorted(Path(folder).glob("vllm-0.3[0-4].0-*.whl")) if folder else []
    return hits[-1] if hits else None


@pytest.mark.slow
@pytest.mark.skipif(qk.find_tools() is None, reason="cuobjdump/nvdisasm absent (see tools/qualify_kernels.py)")
@pytest.mark.skipif(_real_wheel() is None, reason="no vLLM 0.30-0.34 wheel in $MARLIN_PACK_WHEELS")
def test_kernel_fingerprints_of_a_real_wheel() -> None:
    prints = qk.kernel_fingerprints(_real_wheel(), qk.find_tools(), KERNELS)
    repack = {f"marlin::{k}_marlin_repack_kernel<256, {b}>" for k in ("gptq", "awq") for b in (4, 8)}
    prepack = {f"machete::prepack_B_kernel<128, {a}, {w}>" for a in ("fp16", "bf16") for w in ("u4", "u8")}
    assert set(prints) == repack | prepack
    for key in repack:
        assert set(prints[key].parts) == {"ptx:compute_80", "sass:sm_75", "sass:sm_80"}
    for key in prepack:
        assert "sass:sm_90a" in prints[key].parts
    # the 8-bit-activation instantiations 0.30-0.33 also ship are left out, under their own names
    assert all("Lb1E" not in s for p in prints.values() for s in p.symbols)
