"""The loader's decision made ahead of the load: on a thread, as vLLM's GPU worker begins ``init_device``.

:func:`~marlin_pack.vllm_plugin.decision.decide` reads and checks the manifest, the source checkpoint's
headers, the rank and common files' headers (and their stamps): 0.13-0.15 s of a 1.3 s 70B start on
the H200, spent before the copy can begin. vLLM's ``init_device`` (CUDA, NCCL, cuBLAS, the memory
snapshot) and the engine's set-up after it take seconds, so the same decision runs then, on a thread
of its own (:func:`start`, from :mod:`.patches.worker_preload`), and the loader takes it (:func:`take`).

The loader uses it only where nothing it decided on changed: the same options and the same engine facts
as the loader gathers (else its TP rank, say, was guessed wrong before distributed was up), the same
manifest, rank file, common file and experts file (device, inode, size, mtime and ctime, checked again at :func:`take`);
and only a decision that selected a bundle (a refusal or a fallback is decided again, with its messages,
by the loader). Anything else: :func:`take` answers None and the loader decides as before.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Ahead", "start", "start_in_worker", "take"]

logger = logging.getLogger("vllm.marlin_pack")


def _identity(path: Path) -> tuple[int, int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class Ahead:
    """One decision running (or done) ahead of the load."""

    options: Any  # LoaderOptions
    facts: Any  # EngineFacts
    decision: Any = None  # Decision, once done without an exception
    seconds: float = 0.0
    identities: dict[Path, tuple[int, int, int, int, int] | None] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, decide: Any) -> None:
        t0 = time.perf_counter()
        try:
            decision = decide(self.options, self.facts)
            bundle = decision.bundle
            if bundle is not None:
                from marlin_pack._constants import MANIFEST_NAME

                files = (bundle.bundle_dir / MANIFEST_NAME, bundle.rank_file, bundle.common_file,
                         *(() if bundle.experts is None else (bundle.experts.rank_file,)))  # an expert share's file too
                self.identities = {f: _identity(f) for f in files}
                self.decision = decision
        except BaseException as e:  # noqa: BLE001 - the loader decides again and reports it
            logger.debug("marlin-pack: the decision ahead of the load did not select a bundle: %s", e)
        finally:
            self.seconds = time.perf_counter() - t0
            self.done.set()

    def unchanged(self) -> bool:
        return bool(self.identities) and all(_identity(f) == ident and ident is not None for f, ident in self.identities.items())


_LOCK = threading.Lock()
_AHEAD: Ahead | None = None


def start(options: Any, facts: Any, decide: Any = None) -> Ahead:
    """Run ``decide(options, facts)`` on a daemon thread; the loader's :func:`take` finds it.

    ``decide``: the loader's :func:`marlin_pack.vllm_plugin.decision.decide` (``select_for_copy``) unless given (tests)."""
    global _AHEAD
    if decide is None:
        from marlin_pack.vllm_plugin.decision import decide as decide_with
        from marlin_pack.vllm_plugin.decision import select_for_copy

        def decide(options: Any, facts: Any) -> Any:
            return decide_with(options, facts, select_for_copy)
    ahead = Ahead(options, facts)
    with _LOCK:
        _AHEAD = ahead
    threading.Thread(target=ahead.run, args=(decide,), name="marlin-pack-decide-ahead", daemon=True).start()
    return ahead


def take(options: Any, facts: Any) -> tuple[Any, float] | None:
    """The decision made ahead for exactly ``options`` and ``facts``, with the seconds it took, where the bundle's
    files are as they were then; else None (the loader decides itself). Taken once: a later call answers None."""
    global _AHEAD
    with _LOCK:
        ahead, _AHEAD = _AHEAD, None
    if ahead is None or ahead.options != options or ahead.facts != facts:
        return None
    # Waited for however long it takes: deciding again would read and hash the same files from the start (a first
    # start hashing a 70B bundle on a slow disk takes minutes), and a decision that hangs would hang here as well.
    ahead.done.wait()
    if ahead.decision is None or not ahead.unchanged():
        return None
    return ahead.decision, ahead.seconds


def start_in_worker(worker: Any) -> Ahead | None:
    """As vLLM's GPU ``worker`` begins ``init_device``: :func:`start` the decision of a ``marlin_prepacked`` engine's
    loader. Distributed is not up yet, so the TP rank is the worker's rank modulo the TP size and the pipeline stage
    the quotient (modulo the stages), as vLLM lays out its groups (the loader's own facts must match: :func:`take`).
    Never raises; every other load format is left alone before anything is read."""
    try:
        from marlin_pack._constants import LOAD_FORMAT

        vllm_config = worker.vllm_config
        load_config = vllm_config.load_config
        if str(load_config.load_format) != LOAD_FORMAT:
            return None
        import dataclasses

        from marlin_pack.vllm_plugin.engine import engine_facts
        from marlin_pack.vllm_plugin.options import parse_extra_config

        options = parse_extra_config(load_config.model_loader_extra_config or {})
        if options.remote is not None:  # a bucket's bundle: decided by the loader (no file identities to compare)
            return None
        facts = engine_facts(vllm_config, vllm_config.model_config)
        rank = int(getattr(worker, "rank", 0) or 0)  # in its data-parallel replica: pp_rank * tp_size + tp_rank
        if facts.tp_size > 1:
            facts = dataclasses.replace(facts, tp_rank=rank % facts.tp_size)
        if facts.pp_size > 1:
            facts = dataclasses.replace(facts, pp_rank=rank // facts.tp_size % facts.pp_size)
    except Exception as e:  # noqa: BLE001 - the loader decides at load time, as without it
        logger.debug("marlin-pack: no decision ahead of the load: %s", e)
        return None
    return start(options, facts)
