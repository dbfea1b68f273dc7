"""On the CPU: a ``-k`` selection of ``test_daemon_gpu.py`` starts only the models its tests read.

Each model there is four engines and a weight-cache daemon; before this, every selection started all nine
models (with the Machete daemon and the int8 engine), ~47 vLLM processes, and several selections side by side
took a 128 GiB device machine down (2026-12-06).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_daemon_gpu import MODELS, models_to_start

HERE = Path(__file__).parent


def _collected(k: str) -> list[tuple[str, str | None]]:
    """(test function, its ``name`` parameter) of what ``pytest -k K`` selects in test_daemon_gpu.py."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "test_daemon_gpu.py"), "-k", k, "--collect-only", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=HERE.parents[1], check=False,
    ).stdout
    ids = [line.split("::", 1)[1] for line in out.splitlines() if "::" in line]
    return [(i.split("[")[0], i.split("[")[1].rstrip("]") if "[" in i else None) for i in ids]


def test_a_model_parameter_starts_that_model_only() -> None:
    selected = [("test_four_starts_agree", "qwen3moe-ct4-asym"), ("test_daemons_filled_from_the_bundle", "qwen3moe-ct4-asym")]
    assert models_to_start(selected) == ["qwen3moe-ct4-asym"]


def test_tests_without_a_model_parameter_start_the_model_they_read() -> None:
    assert models_to_start([("test_int8_activations_are_refused", None)]) == ["gptq4"]
    assert models_to_start([("test_plain_vllm_preload_gets_the_plugin", None), ("test_four_starts_agree", "ct4")]) == ["gptq8", "ct4"]
    assert models_to_start([("test_machete_layers_are_shared", None)]) == ["awq4"]


def test_the_timings_use_a_selected_model_or_awq4_alone() -> None:
    assert models_to_start([("test_fill_and_load_timings", None), ("test_four_starts_agree", "ct4-asym")]) == ["ct4-asym"]
    assert models_to_start([("test_fill_and_load_timings", None)]) == ["awq4"]


def test_everything_selected_starts_every_model() -> None:
    assert models_to_start(_collected("gpu or not gpu")) == list(MODELS)


@pytest.mark.parametrize(
    ("k", "want"),
    [
        ("qwen3moe-ct4", ["qwen3moe-ct4-asym"]),
        ("gptq4 and not qwen3moe or int8", ["gptq4", "gptq4-vocab"]),
        ("gptq8 or test_plain or ct4 and not qwen3moe", ["gptq8", "ct4", "ct4-asym"]),
    ],
)
def test_k_selections(k: str, want: list[str]) -> None:
    assert models_to_start(_collected(k)) == want
