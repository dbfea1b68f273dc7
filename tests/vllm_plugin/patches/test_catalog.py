"""``patches.catalog`` and ``marlin_pack.patch_list``: every patch has a purpose and names the upstream change
that retires it; the registry is grouped by purpose; the plain listing is the installed registry and imports
neither vLLM nor torch."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from marlin_pack.patch_list import PURPOSES, patch_rows
from marlin_pack.vllm_plugin.patches import PATCHES, Patch, catalog, registry

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.target.rsplit(":", 1)[1])
def test_every_patch_has_a_purpose_and_a_specific_exit(patch: Patch) -> None:
    assert patch.purpose in PURPOSES, patch.target
    text = patch.remove_when
    assert text.strip() and len(text) >= 40, f"{patch.target}: {text!r} does not say which upstream change retires it"
    # It names what upstream changes: a vLLM function, class or attribute (snake_case or CamelCase), or vLLM itself.
    assert re.search(r"\b[a-z]+_[a-z_]+\b|\b[A-Z][a-z]+[A-Z]\w+|vLLM|vllm", text), text


def test_the_registry_is_grouped_by_purpose() -> None:
    purposes = [p.purpose for p in PATCHES]
    assert list(dict.fromkeys(purposes)) == list(PURPOSES)  # each purpose once, contiguous, in PURPOSES order
    assert registry.PURPOSES == PURPOSES
    assert len({p.target for p in PATCHES}) == len(PATCHES) == len(catalog.ROWS)


def test_purposes_of_the_patch_modules() -> None:
    """What each purpose holds (issue "house"): the bundle loaded right, the weight cache, faster starts."""
    by_provider: dict[str, set[str]] = {}
    for row in catalog.ROWS:
        by_provider.setdefault(row.provider, set()).add(row.purpose)
    assert by_provider == {
        "post_processing": {"correctness", "weight_cache"},  # finishing marked layers; the opt-in
        "moe_post_processing": {"correctness", "weight_cache"},
        "placeholders": {"correctness"},
        "weight_cache": {"weight_cache"},
        "gc_freeze": {"speed"},
        "worker_preload": {"speed"},
        "construct": {"speed"},
        "cache_key": {"speed"},
    }
    pre_processed = {r.target for r in catalog.ROWS if r.target.endswith(".supports_pre_processed_weights")}
    assert pre_processed and all(r.purpose == "weight_cache" for r in catalog.ROWS if r.target in pre_processed)


def test_each_module_builds_exactly_its_rows() -> None:
    for provider in catalog.PROVIDERS:
        module = importlib.import_module(f"marlin_pack.vllm_plugin.patches.{provider}")
        rows = [r for r in catalog.ROWS if r.provider == provider]
        assert [(p.target, p.purpose, p.remove_when, p.deferred) for p in module.PATCHES] == [
            (r.target, r.purpose, r.remove_when, r.deferred) for r in rows
        ], provider


def test_a_module_that_disagrees_with_the_catalog_fails_at_once() -> None:
    with pytest.raises(RuntimeError, match=r"patches of gc_freeze and the catalog disagree: no row for \['vllm.x:y'\]"):
        catalog.patches("gc_freeze", {"vllm.x:y": lambda original: original})
    with pytest.raises(RuntimeError, match="no patch for"):
        catalog.patches("marlin_pack.vllm_plugin.patches.construct", {})


def test_the_daemon_targets_match_the_spawn_target_module() -> None:
    from marlin_pack.vllm_plugin import daemon_process

    assert (catalog.DAEMON_MODULE, catalog.RUN_DAEMON) == (daemon_process.DAEMON_MODULE, daemon_process.RUN_DAEMON)


def test_patch_rows_are_the_registry() -> None:
    rows = patch_rows()
    assert rows == [(p.purpose, p.target, p.remove_when) for p in PATCHES]
    assert all(isinstance(x, str) for row in rows for x in row)


def test_patch_rows_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import json, sys\n"
        "from marlin_pack.patch_list import patch_rows\n"
        "rows = patch_rows()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(json.dumps({'rows': len(rows), 'heavy': heavy[:5]}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"rows": len(PATCHES), "heavy": []}
