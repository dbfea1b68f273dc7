"""The loader's timings: what each step of a ``marlin_prepacked`` load took, and the one INFO line that says it.

Each figure is measured by :class:`~marlin_pack.vllm_plugin.loader.MarlinPrepackedLoader` where the step runs; this
module only holds and words them (the benchmarks read that line: ``benchmarks/bench_load.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from marlin_pack.vllm_plugin.decision import SelectedBundle
from marlin_pack.vllm_plugin.stage import stage_text

__all__ = ["LoadTimings"]


@dataclass
class LoadTimings:
    """What each step of one load took (seconds), for the loader's one INFO line (:meth:`line`) and its parts."""

    validate: float = 0.0  # what the decision added to the load (waiting for it, where it was made ahead)
    validate_ahead: float | None = None  # seconds the decision took ahead of the load (decide_ahead), beside vLLM's set-up
    create: float = 0.0
    arena: float = 0.0  # part of create: allocating the arena before the construction (copy during build)
    place: float = 0.0  # binding the arena's views to the layers' parameters, finishing their other placeholders
    copy: float = 0.0  # the rank file's read+copy, from its start to its end
    copy_bytes: int = 0
    beside: bool = False  # the copy ran beside the model's construction and the common tensors
    wait: float = 0.0  # beside: how long loading then waited for the copy
    settle: float = 0.0  # digests left to the copy (a cold bundle without stamps): waiting for it and comparing them
    in_settle: bool = False  # the copy ran after the construction and was waited for with the digests (in settle)
    modes: str = "-"  # the reader modes the copy used
    helpers_ready: float | None = None  # seconds from the helpers' start until the copy found them ready
    helpers_retained: int | None = None  # bytes the early helpers held page-locked (preload)
    common: float = 0.0
    common_beside: int | None = None  # common_during_build: the checkpoint names loaded by the copy beside the construction
    post: float = 0.0

    @property
    def rate(self) -> float:
        return self.copy_bytes / self.copy / 1e9 if self.copy > 0 else 0.0

    def copy_text(self) -> str:
        text = f"read+copy {self.copy:.2f} s ({self.copy_bytes / 1e9:.2f} GB, {self.rate:.1f} GB/s)"
        if self.helpers_ready is not None:
            text += f", helpers ready after {self.helpers_ready:.2f} s"
            if self.helpers_retained:  # large or small: a real bundle or a test's
                n = self.helpers_retained
                text += f", {n / 1e9:.2f} GB" if n >= 1e9 else f", {n / 1e6:.1f} MB"
                text += " page-locked ahead"
        if self.settle:
            text += f", hashed as it was read (digests compared after {self.settle:.2f} s)"
        return f"{text} beside create and common, waited {self.wait:.2f} s" if self.beside else text

    def common_text(self) -> str:
        beside = "" if self.common_beside is None else f" ({self.common_beside} of its names copied beside the construction)"
        return f"load common {self.common:.2f} s{beside}"

    def ahead_text(self) -> str:
        return "" if self.validate_ahead is None else f" (decided ahead in {self.validate_ahead:.2f} s)"

    def create_text(self) -> str:
        arena = f" (arena {self.arena:.2f} s)" if self.beside else ""
        return f"create {self.create:.2f} s{arena}, place {self.place:.2f} s"

    def line(self, bundle: SelectedBundle, layers: int) -> str:
        # What the copy added to the loader's time (a copy waited for with the digests: counted in settle)
        serial = 0.0 if self.in_settle else self.wait if self.beside else self.copy
        total = self.validate + self.settle + self.create + self.place + serial + self.common + self.post
        return (
            f"marlin-pack: validate {self.validate:.2f} s{self.ahead_text()}, {self.create_text()}, {self.copy_text()}, "
            f"{self.common_text()}, post-process {self.post:.2f} s, total {total:.2f} s "
            f"({layers} prepacked layers, tp {bundle.tp_set.tp_size} rank {bundle.rank}{stage_text(bundle)}, "
            f"bundle {bundle.bundle_dir})"
        )
