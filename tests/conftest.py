"""Shared fixtures: tiny checkpoints and bundles written by the project's own tools, cached per session.

* ``make_checkpoint(fmt, preset, ...)``: a synthetic AWQ/GPTQ/compressed-tensors (``ct``, ``ct-asym``)
  checkpoint (read-only, cached).
* ``make_bundle(fmt, preset, tp_sizes=..., ...)``: that checkpoint with its bundle at
  ``MODEL_DIR/marlin-pack`` (read-only, cached).
* ``damaged_copy(model_dir, damage)``: a private copy of a checkpoint (and its bundle) for one
  test, with ``damage(copy)`` applied; tests that break files use this, never the cache.

Stamps (``marlin_pack.io.stamps``) go to a directory of this test session (``MARLIN_PACK_STAMPS``),
never to the user's own store; a test about stamps points it elsewhere itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from marlin_pack import convert
from marlin_pack.testing.synthetic import (
    PRESETS,
    ModelShape,
    write_awq_checkpoint,
    write_compressed_tensors_checkpoint,
    write_gptq_checkpoint,
)

# A run started in the background of a non-interactive shell (`nohup ... &`) inherits SIGINT ignored, and so would every
# process the tests start: the tests that interrupt a conversion or a GPU run with SIGINT need it as at a terminal. A
# handler (unlike an ignored signal) is reset to the default in every program the tests start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Eight query heads, two KV heads: TP 8 replicates each KV head on four ranks.
WIDE = ModelShape(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
# Aligned at TP 1 but not at TP 2: down_proj gets 352 input features per rank, padded to 384.
PADDED_AT_TP2 = ModelShape(hidden_size=384, intermediate_size=704, num_attention_heads=6, num_key_value_heads=2)
SHAPES = {**PRESETS, "wide": WIDE, "padded-at-tp2": PADDED_AT_TP2, "mistral": ModelShape(model_type="mistral")}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run every N-th collected test, starting at the I-th (0-based): tools/run-tests.sh runs N such "
                          "pytest processes side by side, one per core")


def _shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--shard I/N``: keep every N-th test from the I-th, in collection order (a module's slow cases alternate
    between the processes rather than landing in one)."""
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"--shard {spec}: expected I/N with 0 <= I < N, e.g. 0/2") from None
    keep = [item for k, item in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _shard(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _session_stamps(tmp_path_factory: pytest.TempPathFactory) -> None:
    """This session's stamp store, for every test and the processes they start."""
    os.environ["MARLIN_PACK_STAMPS"] = str(tmp_path_factory.mktemp("stamps") / "store")


CheckpointFactory = Callable[..., Path]


def _write_checkpoint(
    d: Path, fmt: str, preset: str, bits: int, group_size: int, dtype: torch.dtype, sharded: bool, seed: int
) -> Path:
    kw = dict(group_size=group_size, dtype=dtype, seed=seed, max_shard_bytes=200_000 if sharded else None, tokenizer=False)
    if fmt == "awq":
        return write_awq_checkpoint(d, SHAPES[preset], **kw)
    if fmt in ("ct", "ct-asym"):  # compressed-tensors pack-quantized (llm-compressor), symmetric or with zero points
        return write_compressed_tensors_checkpoint(d, SHAPES[preset], bits=bits, symmetric=fmt == "ct", **kw)
    return write_gptq_checkpoint(d, SHAPES[preset], bits=bits, **kw)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``make_checkpoint(fmt, preset, bits=4, group_size=128, dtype=float16, sharded=False)``, cached."""
    cache: dict[tuple, Path] = {}

    def make(
        fmt: str,
        preset: str = "tiny",
        *,
        bits: int = 4,
        group_size: int = 128,
        dtype: torch.dtype = torch.float16,
        sharded: bool = False,
        seed: int = 0,
    ) -> Path:
        key = (fmt, preset, bits, group_size, dtype, sharded, seed)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{fmt}{bits}-{preset}-g{group_size}".replace("-1", "ch"))
            cache[key] = _write_checkpoint(d, fmt, preset, bits, group_size, dtype, sharded, seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def make_bundle(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``make_bundle(fmt, preset="tiny", tp_sizes=(1,), kernel="marlin", **make_checkpoint options)``: MODEL_DIR with its bundle.

    Cached per session: treat the result as read-only (use ``damaged_copy`` to break it).
    """
    cache: dict[tuple, Path] = {}

    def make(
        fmt: str,
        preset: str = "tiny",
        *,
        tp_sizes: tuple[int, ...] = (1,),
        bits: int = 4,
        group_size: int = 128,
        dtype: torch.dtype = torch.float16,
        sharded: bool = False,
        seed: int = 0,
        kernel: str = "marlin",
    ) -> Path:
        key = (fmt, preset, tuple(tp_sizes), bits, group_size, dtype, sharded, seed, kernel)
        if key not in cache:
            model = _write_checkpoint(
                tmp_path_factory.mktemp(f"bundle-{fmt}{bits}-{preset}"), fmt, preset, bits, group_size, dtype, sharded, seed
            )
            convert(model, tp=tp_sizes, kernel=kernel)  # explicit: the same bundles on a machine with an H200
            cache[key] = model
        return cache[key]

    return make


@pytest.fixture
def damaged_copy(tmp_path: Path) -> Callable[..., Path]:
    """``damaged_copy(model_dir, damage=None)``: a private copy of ``model_dir`` (bundle included).

    ``damage(copy)`` is applied to the copy before it is returned; several copies per test are fine.
    """
    count = 0

    def copy(model_dir: Path, damage: Callable[[Path], object] | None = None) -> Path:
        nonlocal count
        count += 1
        target = tmp_path / f"copy-{count}" / model_dir.name
        shutil.copytree(model_dir, target)
        if damage is not None:
            damage(target)
        return target

    return copy


@pytest.fixture
def awq_copy(make_checkpoint: CheckpointFactory, damaged_copy: Callable[..., Path]) -> Path:
    """A private copy of the tiny AWQ checkpoint (no bundle yet) that a test may edit."""
    return damaged_copy(make_checkpoint("awq"))


def _edit_config(model_dir: Path, **changes: object) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("q_"):
            cfg["quantization_config"][key[2:]] = value
        else:
            cfg[key] = value
    (model_dir / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def edit_config() -> Callable[..., None]:
    """``edit_config(model_dir, key=value, q_key=value)``: change config.json (``q_`` keys: its quantization_config)."""
    return _edit_config


def _no_leftovers(model_dir: Path) -> None:
    assert not (model_dir / "marlin-pack").exists()
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".marlin-pack")]


@pytest.fixture
def no_leftovers() -> Callable[[Path], None]:
    """``no_leftovers(model_dir)``: assert a failed conversion left neither a bundle nor a temporary directory."""
    return _no_leftovers
