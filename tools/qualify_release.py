#!/usr/bin/env python3
"""Qualify a vLLM release for marlin-pack: what changed, against a supported release, in the code that defines a
bundle's bytes and in the plugin's surface. CPU only; the wheels are read as zip files, vLLM is never imported.

Usage::

    python3 tools/qualify_release.py NEW_WHEEL [--against OLD_WHEEL_OR_VERSION] [--json] [--diff] [--no-kernels]

``NEW_WHEEL`` and ``--against`` take a wheel file or a version (``0.33.0``: the wheel ``vllm-0.33.0-*.whl`` in
``--wheels-dir``, by default ``$MARLIN_PACK_WHEELS`` or NEW_WHEEL's folder). ``--against`` defaults to the newest
release ``marlin_pack/vllm_plugin/releases.py`` serves.

One row per fingerprint (``qualify_targets.py`` lists them; the patch targets come from the plugin's catalog):

* ``same``: identical normalised AST (docstrings, comments, annotations and formatting do not count; a change of
  message text only is ``same`` with a note), or identical per-kernel PTX and SASS;
* ``changed``: it differs (``--diff`` prints the normalised code of both);
* ``moved``: not where it was: found under another module or class (by name), or now reached through a re-export;
* ``missing``: in the old wheel, nowhere in the new one; ``new``: only in the new one; ``absent``: in neither;
* ``skipped``: kernels not checked (``--no-kernels``, or cuobjdump/nvdisasm not found: the tool says how to get them).

Exit status: 0 every row same (or absent); 1 something changed, moved, went missing or is new; 2 bad arguments or
an unreadable wheel; 3 nothing changed in what was checked, but the kernels were not checked because the tools are
missing. docs/qualifying-a-release.md says what to do per row.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
for _p in (str(TOOLS), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import qualify_ast as qa  # noqa: E402
import qualify_kernels as qk  # noqa: E402
from qualify_targets import KERNELS, LAYOUT, PLUGIN_ENV, PLUGIN_READS, Item  # noqa: E402

__all__ = ["Row", "compare", "main"]

CHANGES = ("changed", "moved", "missing", "new")
AST_NORMALISER = 1  # bump with any change to qualify_ast's normalisation
SECTIONS = {
    "layout": "layout-defining Python",
    "kernels": "layout kernels (PTX/SASS)",
    "patch": "plugin patch targets (catalog)",
    "reads": "vLLM functions the plugin calls or overrides",
    "env": "vLLM environment variables the plugin reads",
    "imports": "names the plugin imports from vLLM (existence only)",
}


@dataclass
class Row:
    section: str
    group: str
    name: str
    status: str
    detail: str = ""
    old: str = ""  # where, in the old wheel (module:qualname, or kernel parts)
    new: str = ""
    diff: str = ""


# --- Python ------------------------------------------------------------------------------------------------------------


def _pick(candidates: list[qa.Found], like: qa.Found | None) -> tuple[qa.Found | None, int]:
    if not candidates:
        return None, 0
    if like is not None:
        want = qa.fingerprint(like)[0]
        for c in candidates:
            if qa.fingerprint(c)[0] == want:
                return c, len(candidates) - 1
    return candidates[0], len(candidates) - 1


def _code_note(o: qa.Found, n: qa.Found) -> tuple[bool, str]:
    """(differs, note) of two resolved names' code."""
    (os_, ol), (ns, nl) = qa.fingerprint(o), qa.fingerprint(n)
    if os_ == ns:
        return False, ""
    if ol == nl:
        return False, "message text only"
    return True, "code changed"


def _diff(o: qa.Found, n: qa.Found, old_label: str, new_label: str) -> str:
    return "".join(
        difflib.unified_diff(
            qa.normalised_source(o).splitlines(True),
            qa.normalised_source(n).splitlines(True),
            f"{old_label} {o.location}",
            f"{new_label} {n.location}",
        )
    )


def compare_python(old: qa.Wheel, new: qa.Wheel, target: str, section: str, group: str, *, existence_only: bool = False,
                   want_diff: bool = False) -> Row:
    """One row for ``module:qualname``: same / changed / moved / missing / new / absent."""
    module, qualname = target.split(":", 1)
    o, n = qa.resolve(old, module, qualname), qa.resolve(new, module, qualname)
    o_extra = n_extra = 0
    oo, nn = o, n
    if o is None:
        oo, o_extra = _pick(qa.find_elsewhere(old, qualname, exclude=module), None)
    if n is None:
        nn, n_extra = _pick(qa.find_elsewhere(new, qualname, exclude=module), oo)
    row = Row(section, group, target, "absent", old=oo.location if oo else "", new=nn.location if nn else "")
    if oo is None and nn is None:
        row.detail = f"in neither {old.version} nor {new.version}"
        return row
    if oo is None:
        row.status = "new"
        row.detail = f"not in {old.version}" + (f"; in {new.version} at {nn.location}" if n is None else "")
        return row
    if nn is None:
        row.status = "missing"
        row.detail = f"not found in {new.version}" + (f" (was at {oo.location})" if o is None else "")
        return row
    differs, note = (False, "") if existence_only else _code_note(oo, nn)
    if oo.location != nn.location:
        if o is not None and n is not None and (o.inherited or n.inherited):
            row.status = "changed"
            row.detail = f"defined by {nn.location} (was {oo.location})"
        else:
            row.status = "moved"
            where = f"{oo.location} -> {nn.location}"
            if o is not None and n is not None:
                where += f" (still reached as {target})"
            row.detail = where + (f"; {note}" if note else "; code same" if not existence_only else "")
        if n_extra or o_extra:
            row.detail += f"; {max(n_extra, o_extra)} other candidate(s)"
    elif differs:
        row.status = "changed"
        row.detail = note
    else:
        row.status = "same"
        row.detail = note
        if nn.inherited:
            row.detail = "; ".join(filter(None, [note, nn.via[0]]))
    if want_diff and (differs or row.status == "changed") and not existence_only:
        row.diff = _diff(oo, nn, old.version, new.version)
    return row


def compare_env(old: qa.Wheel, new: qa.Wheel, name: str) -> Row:
    (os_, ov), (ns, nv) = qa.env_entry(old, name), qa.env_entry(new, name)
    row = Row("env", "plugin", name, "same", old=os_, new=ns)
    if os_ == "defined" and ns == "defined":
        if ast.dump(ov) != ast.dump(nv):
            row.status, row.detail = "changed", "its definition changed"
    elif os_ == "defined":
        row.status = "missing"
        row.detail = "moved to removed_environment_variables" if ns == "removed" else "no longer defined"
    elif ns == "defined":
        row.status, row.detail = "new", f"{os_} in {old.version}"
    else:
        row.status, row.detail = "absent", f"{os_} in {old.version}, {ns} in {new.version}"
    return row


# --- kernels -----------------------------------------------------------------------------------------------------------


def compare_kernels(old: dict[str, qk.KernelPrint], new: dict[str, qk.KernelPrint], old_v: str, new_v: str) -> list[Row]:
    rows = []
    for family in KERNELS:
        keys = sorted({k for k, p in [*old.items(), *new.items()] if p.family == family.name})
        if not keys:
            rows.append(Row("kernels", family.group, family.name, "absent", f"no 16-bit-activation instantiation in {old_v} or {new_v}"))
        for key in keys:
            o, n = old.get(key), new.get(key)
            row = Row("kernels", family.group, key, "same")
            if o is not None:
                row.old = " ".join(f"{p}={h}" for p, h in sorted(o.parts.items()))
            if n is not None:
                row.new = " ".join(f"{p}={h}" for p, h in sorted(n.parts.items()))
            if o is None:
                row.status, row.detail = "new", f"not in {old_v}"
            elif n is None:
                row.status, row.detail = "missing", f"not in {new_v}"
            else:
                differ = sorted(p for p in o.parts.keys() & n.parts.keys() if o.parts[p] != n.parts[p])
                gone, added = sorted(o.parts.keys() - n.parts.keys()), sorted(n.parts.keys() - o.parts.keys())
                notes = [f"differs: {', '.join(differ)}"] if differ else []
                notes += [f"no longer shipped: {', '.join(gone)}"] if gone else []
                notes += [f"added: {', '.join(added)}"] if added else []
                if notes:
                    row.status, row.detail = "changed", "; ".join(notes)
                else:
                    row.detail = ", ".join(sorted(n.parts))
                if o.libraries != n.libraries:
                    row.detail += f"; library {', '.join(sorted(o.libraries))} -> {', '.join(sorted(n.libraries))}"
            rows.append(row)
    return rows


# --- the plugin's surface ---------------------------------------------------------------------------------------------


def catalog_targets() -> list[tuple[str, str]]:
    """(target, purpose and release range) of every row of the plugin's patch catalog."""
    from marlin_pack.vllm_plugin.patches import catalog

    out = []
    for row in catalog.ROWS:
        first, last, needs = (getattr(row, a, None) for a in ("first", "last", "needs"))
        span = f" {first or ''}..{last or ''}" if (first or last) else ""
        out.append((row.target, f"{row.purpose}{span}{f' needs {needs}' if needs else ''}"))
    return out


def plugin_imports(root: Path = ROOT) -> list[str]:
    """``module:name`` of every ``from vllm... import name`` in the plugin's source."""
    found: dict[str, None] = {}
    for path in sorted((root / "marlin_pack" / "vllm_plugin").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                for alias in node.names:
                    found[f"{node.module}:{alias.name}"] = None
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm" and alias.name != "vllm":
                        found[f"{alias.name}:*"] = None
    return list(found)


# --- the report -------------------------------------------------------------------------------------------------------


def compare(old: qa.Wheel, new: qa.Wheel, *, kernels: tuple[dict, dict] | None, want_diff: bool = False,
            layout: tuple[Item, ...] | None = None, reads: tuple[Item, ...] | None = None,
            patch: list[tuple[str, str]] | None = None, env: tuple[str, ...] | None = None,
            imports: list[str] | None = None) -> list[Row]:
    """Every row. ``kernels``: (old prints, new prints), or None where the kernels were not checked; the lists
    default to :mod:`qualify_targets`' and the plugin's own."""
    layout = LAYOUT if layout is None else layout
    reads = PLUGIN_READS if reads is None else reads
    env = PLUGIN_ENV if env is None else env
    rows = [compare_python(old, new, i.target, "layout", i.group, want_diff=want_diff) for i in layout]
    if kernels is None:
        rows += [Row("kernels", f.group, f.name, "skipped", "kernels not checked") for f in KERNELS]
    else:
        rows += compare_kernels(kernels[0], kernels[1], old.version, new.version)
    seen = {i.target for i in layout}
    for target, purpose in catalog_targets() if patch is None else patch:
        rows.append(compare_python(old, new, target, "patch", purpose, want_diff=want_diff))
        seen.add(target)
    for item in reads:
        if item.target not in seen:
            rows.append(compare_python(old, new, item.target, "reads", item.group, want_diff=want_diff))
            seen.add(item.target)
    rows += [compare_env(old, new, name) for name in env]
    for target in plugin_imports() if imports is None else imports:
        if target not in seen:
            rows.append(compare_python(old, new, target, "imports", "plugin", existence_only=True))
    return rows


def exit_status(rows: list[Row], tools_missing: bool) -> int:
    if any(r.status in CHANGES for r in rows):
        return 1
    return 3 if tools_missing else 0


# Shorter module paths in the table (the JSON has them whole).
ABBREVIATIONS = (
    ("vllm.model_executor.layers.quantization.", "q."),
    ("vllm.model_executor.kernels.linear.mixed_precision.", "mp."),
    ("vllm.model_executor.layers.fused_moe.oracle.", "oracle."),
    ("vllm.model_executor.", "me."),
)


def short(text: str) -> str:
    for long, abbreviation in ABBREVIATIONS:
        text = re.sub(rf"(?<![\w.]){re.escape(long)}", abbreviation, text)
    return text


def render(rows: list[Row], old: qa.Wheel, new: qa.Wheel, *, only_changes: bool = False) -> str:
    lines = [f"vLLM {new.version} ({new.path.name}) against {old.version} ({old.path.name})",
             "modules: " + ", ".join(f"{a} = {long}" for long, a in ABBREVIATIONS), ""]
    width = min(max([len(short(r.name)) for r in rows] + [10]), 90)
    for section, title in SECTIONS.items():
        shown = [r for r in rows if r.section == section and (not only_changes or r.status in CHANGES)]
        if not shown:
            continue
        lines.append(f"== {title}")
        for r in shown:
            name = short(r.name)
            name = name if len(name) <= width else "..." + name[-(width - 3):]
            detail = f"  {short(r.detail)}" if r.detail else ""
            lines.append(f"  {r.status:<8} {name:<{width}}  {r.group}{detail}".rstrip())
        lines.append("")
    counts = {s: sum(r.status == s for r in rows) for s in ("same", *CHANGES, "absent", "skipped")}
    lines.append("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return "\n".join(lines)


def find_wheel(arg: str, wheels_dir: Path | None) -> Path:
    """A wheel file, or the wheel of a version in ``wheels_dir``.

    Raises:
        SystemExit: neither (with the pip command that downloads it).
    """
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    if re.fullmatch(r"\d+(\.\d+)+\S*", arg):
        folder = wheels_dir or Path.cwd()
        hits = sorted(folder.glob(f"vllm-{arg}-*.whl"))
        if hits:
            return hits[0]
        raise SystemExit(
            f"qualify_release: no wheel of vLLM {arg} in {folder}; download it (no install, no dependencies):\n"
            f"  python3 -m pip download vllm=={arg} --no-deps --only-binary=:all: -d {folder}"
        )
    raise SystemExit(f"qualify_release: {arg}: no such wheel file (give a .whl path or a version such as 0.33.0)")


def default_against() -> str:
    from marlin_pack.vllm_plugin import releases

    return releases.supported()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qualify_release.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("new", metavar="NEW_WHEEL", help="the new release's wheel (file or version)")
    parser.add_argument("--against", metavar="OLD_WHEEL_OR_VERSION", help="default: the newest release served")
    parser.add_argument("--wheels-dir", type=Path, help="where versions are looked up (default: $MARLIN_PACK_WHEELS, "
                        "else NEW_WHEEL's folder)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--diff", action="store_true", help="print the normalised code of changed functions, as a diff")
    parser.add_argument("--only-changes", action="store_true", help="table rows that are not same/absent only")
    parser.add_argument("--no-kernels", action="store_true", help="skip the PTX/SASS part (the AST part still runs)")
    args = parser.parse_args(argv)

    wheels_dir = args.wheels_dir or (Path(os.environ["MARLIN_PACK_WHEELS"]) if os.environ.get("MARLIN_PACK_WHEELS") else None)
    new_path = find_wheel(args.new, wheels_dir)
    old_path = find_wheel(args.against or default_against(), wheels_dir or new_path.parent)
    try:
        old, new = qa.Wheel(old_path), qa.Wheel(new_path)
    except (OSError, zipfile.BadZipFile) as e:
        print(f"qualify_release: cannot read a wheel: {e}", file=sys.stderr)
        return 2

    timings: dict[str, float] = {}
    tools = None if args.no_kernels else qk.find_tools()
    if tools is None and not args.no_kernels:
        print(qk.HOW_TO_GET, file=sys.stderr)
    kernels = None
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = None
        if tools is not None:
            start_k = time.monotonic()
            futures = [pool.submit(qk.kernel_fingerprints, w.path, tools, KERNELS) for w in (old, new)]
        start = time.monotonic()
        rows = compare(old, new, kernels=None, want_diff=args.diff)
        timings["python_s"] = round(time.monotonic() - start, 2)
        if futures is not None:
            kernels = (futures[0].result(), futures[1].result())
            timings["kernels_s"] = round(time.monotonic() - start_k, 2)
            rows = [r for r in rows if r.section != "kernels"] + compare_kernels(*kernels, old.version, new.version)
            order = list(SECTIONS)
            rows.sort(key=lambda r: order.index(r.section))
    status = exit_status(rows, tools_missing=tools is None and not args.no_kernels)

    if args.json:
        print(json.dumps({
            "new": {"wheel": str(new.path), "version": new.version},
            "old": {"wheel": str(old.path), "version": old.version},
            "kernels_checked": kernels is not None,
            "normaliser": {"ast": AST_NORMALISER, "kernels": qk.NORMALISER},
            "rows": [asdict(r) for r in rows],
            "summary": {s: sum(r.status == s for r in rows) for s in sorted({r.status for r in rows})},
            "timings": timings,
            "exit": status,
        }, indent=2, sort_keys=True))
    else:
        print(render(rows, old, new, only_changes=args.only_changes))
        print("timings: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in timings.items())
              + ("" if kernels is not None else "  (kernels not checked)"))
        if args.diff:
            for r in rows:
                if r.diff:
                    print(f"\n--- {r.status}: {r.name}\n{r.diff}", end="")
    return status


if __name__ == "__main__":
    sys.exit(main())
