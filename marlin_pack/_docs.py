"""The docs' tables of source formats (README.md) and architectures (docs/architectures.md), generated from the code.

``python -m marlin_pack._docs`` (from the repository root; or with the files to rewrite as arguments)
rewrites the blocks between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; ``tests/test_docs.py``
fails when a page and the code disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from marlin_pack._constants import SUPPORTED_GROUP_SIZES
from marlin_pack.marlin.architectures import ARCHITECTURES, UNSUPPORTED_ARCHITECTURES, Architecture, Linear
from marlin_pack.schemas import LayerKind

__all__ = ["DOCS", "architecture_table", "format_table", "render", "main"]


def _linears(linears: tuple[Linear, ...]) -> list[str]:
    out = []
    for lin in linears:
        modules = list(dict.fromkeys(p.module.rsplit(".", 1)[-1] for p in lin.parts))
        leaf = lin.name.rsplit(".", 1)[-1]
        parent = lin.name.split(".")[1] if lin.name.count(".") == 2 else None
        if parent is not None:  # a shared expert (DeepSeek's shared_experts, Qwen2-MoE's shared_expert, ...): named as such
            leaf, modules = f"{parent}.{leaf}", [f"{parent}.{m}" for m in modules]
        replicated = " (replicated)" if lin.kind is LayerKind.replicated else ""
        if len(modules) == 1 and len(lin.parts) > 1:  # stored fused: vLLM cuts it into column blocks
            out.append(f"{leaf} ← {modules[0]} (stored fused: {'+'.join(p.role for p in lin.parts)})")
        else:
            out.append((leaf if modules == [leaf] else f"{leaf} ← {'+'.join(modules)}") + replicated)
    return out


def _experts(arch: Architecture) -> str:
    from marlin_pack.marlin.moe import MOE_ARCHITECTURES

    m = MOE_ARCHITECTURES[arch.name]
    n = m.namings[0]  # the naming transformers writes (the table shows one)
    return (f"{m.vllm_experts.split('.', 1)[1]} (Marlin MoE, all experts stacked) w13 ← {n.block}.experts.*.{n.gate}+{n.up}, "
            f"w2 ← {n.block}.experts.*.{n.down}")


def _layers(arch: Architecture) -> str:
    if arch.mla is not None:  # DeepSeek: the layers depend on the config (marlin.deepseek)
        m = arch.mla
        return (f"MLA attention: {', '.join(_linears(m.attention))} (q_lora_rank null) or "
                f"{', '.join(_linears(m.attention_q_lora))} (q_lora_rank set); layers with routed experts: "
                f"{', '.join(_linears(m.shared_experts))}, {_experts(arch)}; the other layers "
                f"(i < first_k_dense_replace, or i % moe_layer_freq != 0): {', '.join(_linears(m.dense_mlp))}")
    out = _linears(arch.linears)
    if arch.mlp_layer_types is not None:  # Mellum: each layer sparse or dense by config
        m = arch.mlp_layer_types
        return (f"{', '.join(out)}; sparse layers: {_experts(arch)}; dense layers ({m.key} \"dense\"): "
                f"{', '.join(_linears(m.dense))}")
    if arch.moe:
        out.append(_experts(arch))
    return ", ".join(out)


def architecture_table() -> str:
    """Markdown: one row per supported architecture, then the refused ones with vLLM's reason."""
    header = ("| architecture (`config.json`) | vLLM class | quantized layers (vLLM ← checkpoint) "
              "| decoder layers in checkpoint → in vLLM |")
    rows = [header, "|---|---|---|---|"]
    for a in ARCHITECTURES.values():
        prefixes = " or ".join(f"`{p}`" for p in a.checkpoint_layers)
        rows.append(f"| `{a.name}` | `{a.vllm_class}` | {_layers(a)} | {prefixes} → `{a.layers}` |")
    rows.append("")
    rows += [f"- `{name}` is refused: {why}." for name, why in UNSUPPORTED_ARCHITECTURES.items()]
    return "\n".join(rows)


def path_table() -> str:
    """Markdown: how each supported vLLM release serves every architecture that one of them serves through its
    Transformers backend (the release table's ``transformers_backend``), and whether a bundle loads there."""
    from marlin_pack.vllm_plugin import releases

    versions = releases.supported()
    names = [a for a in ARCHITECTURES.values() if any(releases.serving_path(v, a.name) == "transformers" for v in versions)]
    rows = ["| architecture | " + " | ".join(f"vLLM {v}" for v in versions) + " |", "|---|" + "---|" * len(versions)]
    for a in names:
        cells = []
        for v in versions:
            path = releases.serving_path(v, a.name)
            word = {"transformers": "Transformers backend", "native": "own class"}.get(path or "", "not served")
            if releases.via_fallback(v, a.name):  # no registry entry: the registry's fallback to transformers' class
                word += " (registry fallback)"
            cells.append(word if path in a.paths else f"{word}: refused")
        rows.append(f"| `{a.name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_table() -> str:
    """Markdown: one row per source format reader."""
    from marlin_pack.sources import AwqGemmSource, CompressedTensorsSource, GptqV1Source

    groups = ", ".join(str(g) for g in SUPPORTED_GROUP_SIZES)
    rows = ["| written by | `quantization_config` | bits | Marlin weight type | group sizes |", "|---|---|---|---|---|"]
    for reader in (AwqGemmSource, GptqV1Source, CompressedTensorsSource):
        who, qc, bits, wtype = reader.support
        rows.append(f"| {who} | {qc} | {bits} | {wtype} | {groups} |")
    return "\n".join(rows)


BLOCKS = {"architectures": architecture_table, "paths": path_table, "formats": format_table}
# Which generated blocks each page holds (paths from the repository root).
DOCS: dict[str, tuple[str, ...]] = {"README.md": ("formats",), "docs/architectures.md": ("architectures", "paths")}


def render(text: str, names: tuple[str, ...] = tuple(BLOCKS)) -> str:
    """``text`` with each generated block of ``names`` replaced by the current table.

    Raises:
        ValueError: ``text`` lacks one of those blocks.
    """
    for name in names:
        make = BLOCKS[name]
        pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def _names(path: Path, text: str) -> tuple[str, ...]:
    """The blocks ``path`` must hold: those of :data:`DOCS` for a known page, else those it has."""
    for rel, names in DOCS.items():
        if path.as_posix().endswith(rel):
            return names
    return tuple(n for n in BLOCKS if f"<!-- {n}:begin -->" in text) or tuple(BLOCKS)


def main(argv: list[str]) -> int:
    for path in map(Path, argv or list(DOCS)):
        text = path.read_text()
        path.write_text(render(text, _names(path, text)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
