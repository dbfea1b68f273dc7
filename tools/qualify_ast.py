"""The Python half of ``tools/qualify_release.py``: find a function in a wheel (read as a zip, never imported) and
fingerprint its normalised AST.

Normalisation (why each step is there):

* docstrings and every other bare string statement are dropped: they never run;
* comments and formatting are gone by construction (the AST has neither; line and column numbers are not dumped);
* type annotations of arguments, returns and local variables are dropped: nothing in these functions reads them at
  run time, so ``Optional[int]`` -> ``int | None`` is not a change (class-level annotated fields are kept: they
  define dataclass fields);
* a second, looser hash also drops message text: ``assert`` messages, the arguments of a raised exception, logger
  and ``warnings.warn`` calls. A function whose strict hash moved but whose loose hash did not is reported
  ``same`` with "message text only" (the static study counted message-only changes as unchanged, too).

Names, decorators, defaults, string constants used as values (attribute and parameter names) all count.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Wheel", "Found", "resolve", "find_elsewhere", "fingerprint", "normalised_source", "env_entry"]

_LOG_NAMES = {"logger", "log", "logging", "_logger", "LOGGER"}
_LOG_METHODS = {"debug", "info", "warning", "warning_once", "info_once", "debug_once", "error", "exception", "critical", "warn"}


class Wheel:
    """A vLLM wheel (or any zip holding ``vllm/**/*.py``) read lazily; nothing is extracted or imported."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)
        self.names = set(self.zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}
        self._sources: dict[str, str] = {}
        self._definers: dict[str, list[str]] = {}
        self.version = _version_of(self.path, self.zip)

    def close(self) -> None:
        self.zip.close()

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self.names:
                return name
        return None

    def source(self, name: str) -> str:
        if name not in self._sources:
            self._sources[name] = self.zip.read(name).decode("utf-8", errors="replace")
        return self._sources[name]

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            name = self.module_file(module)
            try:
                self._trees[module] = ast.parse(self.source(name)) if name else None
            except SyntaxError:
                self._trees[module] = None
        return self._trees[module]

    def definers(self, name: str) -> list[str]:
        """The modules with a line that defines or assigns ``name`` (searched once per name)."""
        if name not in self._definers:
            pattern = re.compile(rf"^[ \t]*(?:(?:async[ \t]+)?def|class)[ \t]+{re.escape(name)}\b|^[ \t]*{re.escape(name)}[ \t]*[:=]", re.M)
            self._definers[name] = [
                mod for mod, file in self.python_modules() if name in self.source(file) and pattern.search(self.source(file))
            ]
        return self._definers[name]

    def python_modules(self) -> list[tuple[str, str]]:
        """(module, file name) of every ``.py`` file under ``vllm/``."""
        out = []
        for name in sorted(self.names):
            if name.startswith("vllm/") and name.endswith(".py"):
                mod = name[:-3].replace("/", ".")
                out.append((mod.removesuffix(".__init__"), name))
        return out


def _version_of(path: Path, zf: zipfile.ZipFile) -> str:
    for name in zf.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in zf.read(name).decode("utf-8", errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    m = re.match(r"[^-]+-([^-]+)-", path.name)
    return m.group(1) if m else path.name


@dataclass
class Found:
    """Where a name resolved: the module and qualname that define it, and its node (or an outside binding)."""

    module: str
    qualname: str
    node: ast.AST | None  # None for a binding outside vllm (``external``)
    external: str | None = None  # "copy.deepcopy" for ``from copy import deepcopy``
    via: list[str] = field(default_factory=list)  # re-exports and base classes passed through
    prints: tuple[str, str] | None = None  # (strict, loose) fingerprint, once computed

    @property
    def location(self) -> str:
        return self.external if self.external is not None else f"{self.module}:{self.qualname}"

    @property
    def inherited(self) -> bool:
        return any(v.startswith("inherited ") for v in self.via)


def _split_qualname(qualname: str) -> tuple[list[str], str | None]:
    """``A.b[Enum.X]`` -> (["A", "b"], "Enum.X")."""
    key = None
    m = re.fullmatch(r"(.*?)\[(.+)\]", qualname)
    if m:
        qualname, key = m.group(1), m.group(2)
    return qualname.split("."), key


def _bindings(body: list[ast.stmt]) -> list[tuple[str, ast.stmt]]:
    """(name, statement) of every binding at this level, in source order (looking into if/try blocks)."""
    out: list[tuple[str, ast.stmt]] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((stmt.name, stmt))
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    out.append((t.id, stmt))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append((stmt.target.id, stmt))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                out.append((bound, stmt))
        elif isinstance(stmt, ast.If):
            if not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                out.extend(_bindings(stmt.body) + _bindings(stmt.orelse))
        elif isinstance(stmt, ast.Try):
            out.extend(_bindings(stmt.body))
            for h in stmt.handlers:
                out.extend(_bindings(h.body))
            out.extend(_bindings(stmt.orelse) + _bindings(stmt.finalbody))
    return out


def _lookup(body: list[ast.stmt], name: str) -> ast.stmt | None:
    hits = [stmt for bound, stmt in _bindings(body) if bound == name]
    return hits[-1] if hits else None  # the last binding wins, as at run time


def _absolute(module: str, stmt: ast.ImportFrom, is_package: bool) -> str:
    if not stmt.level:
        return stmt.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (stmt.level - 1)]
    return ".".join(base + ([stmt.module] if stmt.module else []))


def resolve(wheel: Wheel, module: str, qualname: str, *, follow_imports: bool = True, _depth: int = 0) -> Found | None:
    """Find ``module:qualname`` in ``wheel`` as Python would, following re-exports and base classes."""
    if _depth > 12:
        return None
    tree = wheel.tree(module)
    if tree is None:
        return None
    if qualname == "*":
        return Found(module, "*", tree)
    parts, key = _split_qualname(qualname)
    stmt = _lookup(tree.body, parts[0])
    if stmt is None:
        return _unbound(wheel, module, tree, qualname, parts, follow_imports, _depth)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        if not follow_imports:
            return None
        return _follow_import(wheel, module, stmt, parts, key, _depth)
    found = _descend(wheel, module, stmt, parts, _depth)
    if found is None:
        return None
    if key is not None:
        value = getattr(found.node, "value", None)
        if not isinstance(value, ast.Dict):
            return None
        for k, v in zip(value.keys, value.values, strict=True):
            if k is not None and ast.unparse(k) == key:
                return Found(found.module, f"{found.qualname}[{key}]", v, via=found.via)
        return None
    return found


def _unbound(wheel: Wheel, module: str, tree: ast.Module, qualname: str, parts: list[str], follow_imports: bool,
             depth: int) -> Found | None:
    """A name the module does not bind itself: a star import, a submodule, or the module's ``__getattr__``."""
    if not follow_imports:
        return None
    own = wheel.module_file(module) or ""
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names) and not parts[0].startswith("_"):
            source = _absolute(module, stmt, own.endswith("__init__.py"))
            if source.split(".")[0] == "vllm":
                hit = resolve(wheel, source, qualname, _depth=depth + 1)
                if hit is not None:
                    hit.via.insert(0, f"re-exported by {module} (import *)")
                    return hit
    sub = f"{module}.{parts[0]}"
    if own.endswith("__init__.py") and wheel.tree(sub) is not None:
        rest = ".".join(parts[1:]) or "*"
        return resolve(wheel, sub, rest, _depth=depth + 1)
    getattr_fn = _lookup(tree.body, "__getattr__")
    if isinstance(getattr_fn, ast.FunctionDef) and len(parts) == 1:
        names = {n.value for n in ast.walk(getattr_fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if parts[0] in names:
            return Found(module, "__getattr__", getattr_fn, via=[f"made by {module}.__getattr__"])
    return None


def _follow_import(wheel: Wheel, module: str, stmt: ast.stmt, parts: list[str], key: str | None, depth: int) -> Found | None:
    rest = ".".join(parts[1:])
    suffix = f"[{key}]" if key else ""
    if isinstance(stmt, ast.ImportFrom):
        alias = next(a for a in stmt.names if (a.asname or a.name) == parts[0])
        own = wheel.module_file(module) or ""
        source = _absolute(module, stmt, own.endswith("__init__.py"))
        if source.split(".")[0] != "vllm":
            return Found(module, ".".join(parts), None, external=f"{source}.{alias.name}" + (f".{rest}" if rest else ""))
        target = alias.name + (f".{rest}" if rest else "") + suffix
        hit = resolve(wheel, source, target, _depth=depth + 1)
        if hit is None and not rest:  # ``from pkg import submodule``
            sub = f"{source}.{alias.name}"
            if wheel.tree(sub) is not None:
                return Found(sub, "*", wheel.tree(sub), via=[f"re-exported by {module}"])
        if hit is not None:
            hit.via.insert(0, f"re-exported by {module}")
        return hit
    # ``import a.b as c``: the rest of the name is inside module a.b
    alias = next(a for a in stmt.names if (a.asname or a.name.split(".")[0]) == parts[0])
    target_module = alias.name if alias.asname else alias.name.split(".")[0]
    if target_module.split(".")[0] != "vllm":
        return Found(module, ".".join(parts), None, external=f"{target_module}" + (f".{rest}" if rest else ""))
    if not rest:
        tree = wheel.tree(target_module)
        return Found(target_module, "*", tree) if tree is not None else None
    # ``import vllm.x`` then ``vllm.x.y.f``: try the longest module prefix
    names = rest.split(".")
    for i in range(len(names), 0, -1):
        mod = ".".join([target_module, *names[:i - 1]]) if i > 1 else target_module
        if wheel.tree(mod) is not None:
            return resolve(wheel, mod, ".".join(names[i - 1:]) + suffix, _depth=depth + 1)
    return None


def _descend(wheel: Wheel, module: str, stmt: ast.stmt, parts: list[str], depth: int) -> Found | None:
    node: ast.stmt = stmt
    done = [parts[0]]
    for i, part in enumerate(parts[1:], start=1):
        if not isinstance(node, ast.ClassDef):
            return None
        inner = _lookup(node.body, part)
        if inner is None:
            # not in the class body: look in its bases, as attribute lookup would
            for base in node.bases:
                base_found = _resolve_expr(wheel, module, base, depth)
                if base_found is None or base_found.node is None:
                    continue
                hit = resolve(wheel, base_found.module, ".".join([base_found.qualname, *parts[i:]]), _depth=depth + 1)
                if hit is not None:
                    hit.via.insert(0, f"inherited from {base_found.location}")
                    return hit
            return None
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
            return None
        node = inner
        done.append(part)
    return Found(module, ".".join(done), node)


def _resolve_expr(wheel: Wheel, module: str, expr: ast.expr, depth: int) -> Found | None:
    """A base class expression (``Name`` or dotted ``Attribute``) resolved from ``module``."""
    dotted = ast.unparse(expr)
    if not re.fullmatch(r"[A-Za-z_][\w.]*", dotted):
        return None
    return resolve(wheel, module, dotted, _depth=depth + 1)


def find_elsewhere(wheel: Wheel, qualname: str, exclude: str | None = None) -> list[Found]:
    """Every module of ``wheel`` that itself defines ``qualname`` (not through an import): where a moved name went."""
    if qualname == "*":
        return []
    parts, _ = _split_qualname(qualname)
    out = []
    for mod in wheel.definers(parts[0]):
        if mod == exclude:
            continue
        hit = resolve(wheel, mod, qualname, follow_imports=False)
        if hit is not None and hit.node is not None:
            out.append(hit)
    return out


# --- normalisation ------------------------------------------------------------------------------------------------


def _is_string_stmt(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


class _Strip(ast.NodeTransformer):
    """Docstrings, bare strings and annotations out (see the module docstring); ``messages`` also drops message text."""

    def __init__(self, messages: bool) -> None:
        self.messages = messages
        self.in_function = 0

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        kept = [s for s in body if not _is_string_stmt(s)]
        if self.messages:
            kept = [s for s in kept if not _is_message_call(s)]
        return kept or [ast.Pass()]

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("body", "orelse", "finalbody"):
            value = getattr(node, name, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, name, self._body(value))
        return super().generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.returns = None
        node.type_comment = None
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
            if arg is not None:
                arg.annotation = None
                arg.type_comment = None
        if hasattr(node, "type_params"):
            node.type_params = []
        self.in_function += 1
        try:
            return self.generic_visit(node)
        finally:
            self.in_function -= 1

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        if not self.in_function:
            return self.generic_visit(node)
        if node.value is None:
            return None  # a bare local annotation does nothing
        return self.generic_visit(ast.Assign(targets=[node.target], value=node.value, lineno=0))

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        if self.messages:
            node.msg = None
        return self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        if self.messages and isinstance(node.exc, ast.Call):
            node.exc.args, node.exc.keywords = [], []
        return self.generic_visit(node)


def _is_message_call(stmt: ast.stmt) -> bool:
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    if isinstance(func, ast.Attribute):
        owner = ast.unparse(func.value)
        if func.attr in _LOG_METHODS and (owner in _LOG_NAMES or owner.endswith("logger")):
            return True
        if owner == "warnings" and func.attr == "warn":
            return True
    return isinstance(func, ast.Name) and func.id in {"print"}


def normalise(node: ast.AST, *, messages: bool = False) -> ast.AST:
    """A normalised copy of ``node`` (the input is not changed)."""
    out = _Strip(messages).visit(copy.deepcopy(node))
    return ast.fix_missing_locations(out) if out is not None else ast.Pass()


def _target_node(node: ast.AST) -> ast.AST:
    """What a fingerprint covers: a function or class whole, an assignment's value, a dict entry's value."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        return node.value if node.value is not None else ast.Constant(None)
    return node


def fingerprint(found: Found) -> tuple[str, str]:
    """(strict, loose) hashes of a resolved name: docstrings and annotations out; loose also without messages."""
    if found.prints is None:
        if found.node is None:
            digest = hashlib.sha256(f"external {found.external}".encode()).hexdigest()[:16]
            found.prints = digest, digest
        else:
            node = _target_node(found.node)
            strict = ast.dump(normalise(node), include_attributes=False)
            loose = ast.dump(normalise(node, messages=True), include_attributes=False)
            found.prints = hashlib.sha256(strict.encode()).hexdigest()[:16], hashlib.sha256(loose.encode()).hexdigest()[:16]
    return found.prints


def normalised_source(found: Found) -> str:
    """The normalised code as text (for diffs)."""
    if found.node is None:
        return f"# bound to {found.external}\n"
    return ast.unparse(normalise(_target_node(found.node))) + "\n"


def env_entry(wheel: Wheel, name: str) -> tuple[str, ast.AST | None]:
    """Whether ``vllm/envs.py`` defines the environment variable ``name``: ("defined" | "removed" | "absent", value)."""
    tree = wheel.tree("vllm.envs")
    if tree is None:
        return "absent", None
    tables: dict[str, ast.Dict] = {}
    for bound, stmt in _bindings(tree.body):
        value = getattr(stmt, "value", None)
        if bound in ("environment_variables", "removed_environment_variables") and isinstance(value, ast.Dict):
            tables[bound] = value
    for table, state in (("environment_variables", "defined"), ("removed_environment_variables", "removed")):
        d = tables.get(table)
        if d is None:
            continue
        for k, v in zip(d.keys, d.values, strict=True):
            if isinstance(k, ast.Constant) and k.value == name:
                return state, v
    return "absent", None
