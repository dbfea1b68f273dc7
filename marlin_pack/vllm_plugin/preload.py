"""Copy helpers page-lock the bundle before the loader copies it (the ``preload`` option): in a weight-cache
daemon as it starts, in an engine while vLLM sets up its GPU worker.

Page-locking (``cuMemHostRegister``) the page cache's pages is what keeps a copy below pinned speed;
helpers that hold the bundle page-locked already copied a 70B rank file at 42-47 GB/s (docs/performance.md).
Where the I/O plan copies with helpers (:mod:`marlin_pack.gpu.plan`: one process, enough cores, room on the
GPU) and ``preload`` is on, this module starts those helpers early, on a thread, and has them page-lock
(retain) the files the copy will read; the loader then takes the same :class:`~marlin_pack.gpu.helpers.HelperPool`
(its pipes are this process's own):

* **A weight-cache daemon.** ``vllm preload`` spawns each daemon process, which then spends seconds
  importing torch and vLLM and unpickling its configuration. In the ``vllm preload`` process, :func:`export`
  (called as vLLM looks at the final configuration one last time before spawning) writes the plan and the
  files into the environment the daemon inherits (:data:`ENV`); in the daemon, :func:`start_from_environment`
  starts the helpers as the spawn target's module is imported (:mod:`.daemon_process`). After the fill the
  loader stops them (:func:`stop`).
* **An engine.** :func:`start_in_worker` starts them as vLLM's GPU worker begins ``init_device``. Their CUDA
  contexts must be in vLLM's memory snapshot, which sizes the KV cache: the loader's
  ``get_external_weight_memory``, vLLM's last call before the snapshot, waits for them (:func:`await_helpers`);
  after the copy they let go of the engine's memory and of the pages (:meth:`HelperPool.let_go`) and exit once
  vLLM has measured the memory after its profile run (:func:`stop_after_memory_profile`), so that they count
  as another process's memory both times and the KV cache is sized as without them.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marlin_pack.gpu.plan import IoPlan

__all__ = [
    "ENV", "Preload", "await_helpers", "current", "export", "plan", "start_from_environment", "start_in_worker", "stop",
    "stop_after_memory_profile", "take_pool",
]

logger = logging.getLogger("vllm.marlin_pack")

# The plan, as JSON, from the vllm preload process to the daemon it spawns.
ENV = "MARLIN_PACK_DAEMON_PRELOAD"


def plan(vllm_config: Any, role: str = "daemon", device: int = 0) -> dict | None:
    """What the loader of ``vllm_config`` should have page-locked before it copies, with its I/O plan; None where nothing.

    ``role``: ``"daemon"`` (planned in the ``vllm preload`` process for the daemon it spawns) or ``"engine"`` (in the
    engine's GPU worker). Cheap: the manifest is read, nothing is hashed (the loader checks the bundle as always,
    and stops the helpers if it does not use them). None for a pipeline stage (page-locking would read the other
    stages' layers). Never raises: a bundle it cannot find is the loader's to report.
    """
    from marlin_pack._constants import LOAD_FORMAT
    from marlin_pack.vllm_plugin.options import parse_extra_config

    load_config = vllm_config.load_config
    if str(load_config.load_format) != LOAD_FORMAT:
        return None
    try:
        options = parse_extra_config(load_config.model_loader_extra_config or {})
    except ValueError:
        return None  # the loader refuses it with the message
    if not options.preload or options.remote is not None:  # a bucket's bundle: streamed, nothing to page-lock
        return None
    try:
        from marlin_pack.bundle.reader import resolve_file
        from marlin_pack.vllm_plugin.decision import check_engine, load_manifest, resolve_bundle_dir
        from marlin_pack.vllm_plugin.engine import engine_facts
        from marlin_pack.vllm_plugin.io_facts import plan_for

        model_config = vllm_config.model_config
        facts = engine_facts(vllm_config, model_config)
        if facts.pp_size > 1:  # page-locking reads the whole rank file; a pipeline stage reads only its layers
            logger.debug("marlin-pack: no page-locking ahead of the %s's copy: pipeline_parallel_size %d", role, facts.pp_size)
            return None
        bundle_dir = resolve_bundle_dir(options, facts.model, facts.revision)
        manifest = load_manifest(bundle_dir)
        tp_set = check_engine(manifest, facts)
        files = (resolve_file(bundle_dir, tp_set.ranks[facts.tp_rank].file), resolve_file(bundle_dir, manifest.common))
        io_plan = plan_for(vllm_config, model_config, files, experts=bool(tp_set.moe_layers), role=role, preload=True,
                           device=device)
    except Exception as e:  # noqa: BLE001 - the loader says what is wrong, with its own message
        logger.debug("marlin-pack: no page-locking ahead of the %s's copy: %s", role, e)
        return None
    if not io_plan.preload:
        logger.debug("marlin-pack: no page-locking ahead of the %s's copy: %s", role, io_plan.why)
        return None
    resolved = [str(f.resolve()) for f in files]
    return {"parent": os.getpid(), "files": resolved, "bytes": sum(os.stat(f).st_size for f in resolved), "device": device,
            "plan": io_plan.to_json()}


def export(vllm_config: Any, draft: bool, environ: dict[str, str] | None = None) -> dict | None:
    """In the ``vllm preload`` process, before it spawns its daemons: name what the daemon should page-lock as it
    starts in ``environ`` (default ``os.environ``, which spawned processes inherit), or clear it.

    Only a single daemon (one GPU, no ``draft`` daemon beside it) gets a plan (the I/O plan has helpers only for one process)."""
    env = os.environ if environ is None else environ
    found = None if draft else plan(vllm_config)
    if found is None:
        env.pop(ENV, None)
        return None
    env[ENV] = json.dumps(found)
    logger.info(
        "marlin-pack: the weight-cache daemon page-locks its bundle (%d files, %s) in copy helpers while it starts, "
        "so that its fill copies without page-locking (\"preload\": false turns this off)",
        len(found["files"]), _size(found["bytes"]),
    )
    return found


@dataclass
class Preload:
    """Copy helpers started early, page-locking the bundle on a thread.

    ``engine``: started by an engine's worker, whose memory snapshot counts the helpers' contexts; they then
    live until :func:`stop_after_memory_profile` (a daemon's are stopped after its fill)."""

    files: list[str]
    device: int
    plan: IoPlan
    engine: bool = False
    began: float = field(default_factory=time.perf_counter)
    pool: Any = None  # the HelperPool, once started
    locked: int = 0  # bytes page-locked (retained) by the helpers
    seconds: float | None = None  # from the start until the files were page-locked (or it failed)
    error: str | None = None
    helpers_up: threading.Event = field(default_factory=threading.Event)  # contexts created (or it failed)
    done: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        try:
            from marlin_pack.gpu.helpers import HelperPool

            with self._lock:
                if self.stopped:
                    return
                self.pool = HelperPool(self.plan.helpers, self.device, defer_unregister=self.plan.defer_unregister)
            if not self.pool.ready():
                self.error = self.pool.failures[-1] if self.pool.failures else "no helper started"
                return
            self.helpers_up.set()
            if not self.stopped:
                self.locked = self.pool.retain(self.files, self.plan.window)
            self.seconds = time.perf_counter() - self.began
            logger.info(
                "marlin-pack: %s of the bundle page-locked in %d copy helpers in %.2f s", _size(self.locked),
                self.plan.helpers, self.seconds,
            )
        except Exception as e:  # noqa: BLE001 - the loader then copies without page-locked pages
            self.error = f"{type(e).__name__}: {e}"
        finally:
            if self.seconds is None:
                self.seconds = time.perf_counter() - self.began
            self.helpers_up.set()
            self.done.set()

    def stop(self, wait_s: float = 30.0) -> None:
        """End the helpers (they unregister the pages and exit); idempotent. Waits (at most ``wait_s``) for a start
        still under way, so that no helper it spawns is left behind."""
        self.done.wait(wait_s)
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            pool = self.pool
        if pool is not None:
            pool.close()


_CURRENT: Preload | None = None


def current() -> Preload | None:
    """This process's page-locking ahead of its copy, if it started one."""
    return _CURRENT


def _begin(files: list[str], device: int, io_plan: IoPlan, engine: bool) -> Preload:
    global _CURRENT
    preload = Preload(files, device, io_plan, engine=engine)
    _CURRENT = preload
    atexit.register(preload.stop)
    threading.Thread(target=preload.run, name="marlin-pack-preload", daemon=True).start()
    return preload


def start_from_environment(environ: dict[str, str] | None = None) -> Preload | None:
    """In a spawned daemon process: start the page-locking :func:`export` planned for it, on a thread.

    The plan is taken out of the environment (the daemon's own children never see it), and only a direct child
    of the process that planned it acts on it."""
    env = os.environ if environ is None else environ
    raw = env.pop(ENV, None)
    if raw is None or _CURRENT is not None:
        return None
    try:
        spec = json.loads(raw)
        if not isinstance(spec, dict) or spec.get("parent") != os.getppid() or not spec.get("files"):
            return None
        files = [str(f) for f in spec["files"]]
        io_plan = IoPlan.from_json(str(spec["plan"]))
        device = int(spec.get("device", 0))
    except (ValueError, TypeError, KeyError):
        return None
    return _begin(files, device, io_plan, engine=False)


def start_in_worker(worker: Any) -> Preload | None:
    """As vLLM's GPU ``worker`` begins ``init_device``: start the page-locking its loader's copy will use, on a thread.

    Only where :func:`plan` finds a plan, and not in a process that started one already. Never raises."""
    if _CURRENT is not None:
        return None
    try:
        spec = plan(worker.vllm_config, role="engine", device=int(getattr(worker, "local_rank", 0) or 0))
        if spec is None:
            return None
        io_plan = IoPlan.from_json(spec["plan"])
    except Exception as e:  # noqa: BLE001 - the engine starts as without it
        logger.debug("marlin-pack: no page-locking ahead of the engine's copy: %s", e)
        return None
    logger.info(
        "marlin-pack: copy helpers page-lock the bundle (%d files, %s) while vLLM sets up its GPU worker, so that the "
        "copy does not page-lock (\"preload\": false turns this off)",
        len(spec["files"]), _size(spec["bytes"]),
    )
    return _begin(spec["files"], spec["device"], io_plan, engine=True)


def take_pool(rank_file: Path) -> tuple[Any, IoPlan] | None:
    """For the loader: this process's early helpers and their plan, where they page-lock ``rank_file``; else None.

    The pool's jobs wait for its page-locking (one job at a time), so the loader starts its copy at once and
    vLLM builds the model meanwhile."""
    preload = _CURRENT
    if preload is None or preload.stopped or str(Path(rank_file).resolve()) not in preload.files:
        return None
    preload.helpers_up.wait(60.0)
    if preload.error is not None or preload.pool is None:
        role = "engine" if preload.engine else "daemon"
        logger.warning("marlin-pack: the %s's copy helpers did not start (%s); copying without them", role, preload.error)
        return None
    return preload.pool, preload.plan


def await_helpers(timeout_s: float = 60.0) -> None:
    """In an engine, just before vLLM's memory snapshot: wait until the early helpers hold their CUDA contexts (or
    failed), so that the snapshot counts them as another process's memory."""
    preload = _CURRENT
    if preload is None or not preload.engine or preload.stopped:
        return
    t0 = time.perf_counter()
    if not preload.helpers_up.wait(timeout_s):  # they appear after the snapshot: the KV cache comes out smaller, never larger
        logger.warning("marlin-pack: the copy helpers were not up after %.0f s, before vLLM's memory snapshot", timeout_s)
    elif (waited := time.perf_counter() - t0) >= 0.01:
        logger.info("marlin-pack: waited %.2f s for the copy helpers' CUDA contexts before vLLM's memory snapshot", waited)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def stop() -> None:
    """After the copy (used or not): end this process's early helpers, if any, without waiting for them."""
    preload = _CURRENT
    if preload is not None and not preload.stopped:
        threading.Thread(target=preload.stop, name="marlin-pack-preload-stop", daemon=True).start()


def stop_after_memory_profile() -> None:
    """In an engine, once vLLM has measured the memory after its profile run (the KV cache is sized): end the early
    helpers its worker started; their memory is then free for the KV cache allocation."""
    preload = _CURRENT
    if preload is not None and preload.engine:
        stop()
