"""Bundles are byte-for-byte what they were: a guard on the on-disk format.

``tests/data/bundle_digests.json`` holds the SHA-256 of every file of the bundles written
for a matrix of synthetic checkpoints (AWQ, GPTQ 4/8-bit, v1/v2, group sizes -1/32/64/128,
padding, biases, fp16/bf16, sharded, TP 1/2/4/8). Any change to the bytes a bundle holds
(tensor layout, file order, header, manifest) fails here. A deliberate format change
regenerates the file with ``MARLIN_PACK_UPDATE_DIGESTS=1 pytest tests/bundle/test_bundle_bytes.py``
and says so in its commit.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from marlin_pack import convert
from marlin_pack.testing.synthetic import PRESETS, ModelShape, write_awq_checkpoint, write_gptq_checkpoint
from marlin_pack.testing.synthetic_moe import MOE_PRESETS, write_moe_checkpoint

DIGESTS = Path(__file__).parents[1] / "data" / "bundle_digests.json"
_WIDE = ModelShape(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
_PADDED_AT_TP2 = ModelShape(hidden_size=384, intermediate_size=704, num_attention_heads=6, num_key_value_heads=2)

# name: (format, shape, writer options, tp sizes)
CASES: dict[str, tuple[str, Any, dict, tuple[int, ...]]] = {
    "awq-tiny-g128-fp16": ("awq", PRESETS["tiny"], {"group_size": 128}, (1, 2)),
    "awq-padded-g32-bf16": ("awq", PRESETS["tiny-padded"], {"group_size": 32, "dtype": torch.bfloat16}, (1,)),
    "awq-qwen2-g64-bias": ("awq", PRESETS["tiny-qwen2"], {"group_size": 64}, (1, 2)),
    "awq-tiny-gch": ("awq", PRESETS["tiny"], {"group_size": -1}, (1,)),
    "gptq4-tiny-g128": ("gptq", PRESETS["tiny"], {"bits": 4, "group_size": 128}, (1, 2)),
    "gptq8-tiny-gch": ("gptq", PRESETS["tiny"], {"bits": 8, "group_size": -1}, (1, 2)),
    "gptq4-wide-g32-tp8": ("gptq", _WIDE, {"bits": 4, "group_size": 32}, (1, 2, 4, 8)),
    "gptq4-padded-at-tp2-g32": ("gptq", _PADDED_AT_TP2, {"bits": 4, "group_size": 32}, (1, 2)),
    "gptq8-qwen3-g128-bf16-sharded": (
        "gptq", PRESETS["tiny-qwen3"],
        {"bits": 8, "group_size": 128, "dtype": torch.bfloat16, "max_shard_bytes": 200_000}, (1,),
    ),
    "gptq4-v2-qwen2-g64": ("gptq", PRESETS["tiny-qwen2"], {"bits": 4, "group_size": 64, "checkpoint_format": "gptq_v2"}, (1, 2)),
    # Mixture of experts (Qwen3-MoE, marlin_pack.testing.synthetic_moe): experts layers after the dense ones.
    "moe-gptq4-qwen3moe-g128": ("moe-gptq", MOE_PRESETS["tiny-qwen3moe"], {"bits": 4, "group_size": 128}, (1, 2)),
    "moe-awq-qwen3moe-g64-bf16": ("moe-awq", MOE_PRESETS["tiny-qwen3moe"], {"group_size": 64, "dtype": torch.bfloat16}, (1, 2)),
}


def _bundle_digests(model: Path, tps: tuple[int, ...]) -> dict[str, str]:
    bundle = model / "marlin-pack"
    convert(model, tp=tps)
    return {
        p.relative_to(bundle).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(bundle.rglob("*"))
        if p.is_file()
    }


def _write(tmp: Path, name: str) -> dict[str, str]:
    fmt, shape, options, tps = CASES[name]
    if fmt.startswith("moe-"):
        model = write_moe_checkpoint(tmp / name, shape, fmt.removeprefix("moe-"), seed=7, **options)  # type: ignore[arg-type]
        return _bundle_digests(model, tps)
    writer = write_awq_checkpoint if fmt == "awq" else write_gptq_checkpoint
    model = writer(tmp / name, shape, tokenizer=False, seed=7, **options)
    return _bundle_digests(model, tps)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bundle_bytes_unchanged(name: str, tmp_path: Path) -> None:
    got = _write(tmp_path, name)
    if os.environ.get("MARLIN_PACK_UPDATE_DIGESTS"):
        table = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
        table[name] = got
        DIGESTS.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        pytest.skip("digests updated")
    want = json.loads(DIGESTS.read_text())[name]
    assert got == want
