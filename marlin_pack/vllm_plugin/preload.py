"""Copy helpers page-lock the bundle before the loader copies it: in a weight-cache daemon as it starts
(``daemon_preload``), in an engine while vLLM sets up its GPU worker (``engine_preload``).

The loader copies the bundle into GPU memory with copy helpers. With helpers of its own, each
page-locks (``cuMemHostRegister``) every window of the page cache as it copies, and beside vLLM's
construction that held a 70B fill at 1.2-2.1 s and an engine's read+copy at 20-35 GB/s on an H200;
helpers that hold the bundle page-locked already (``marlin-pack helpers --retain-gib G --preload
BUNDLE``) copied it at 42-47 GB/s (docs/performance.md). This module starts such helpers without a
service to run, as a private helper service (:class:`.helper_service.HelperService`, sockets in a
fresh 0700 directory) on a thread, which page-locks the files the copy will read and retains them:

* **A weight-cache daemon.** ``vllm preload`` spawns each daemon process, which then spends seconds
  importing torch and vLLM and unpickling its configuration. In the ``vllm preload`` process,
  :func:`export` (called as vLLM looks at the final configuration one last time before spawning the
  daemons) names the files (:func:`plan`) in the environment the daemon inherits (:data:`ENV`); in
  the daemon, :func:`start_from_environment` starts the service as the spawn target's module is
  imported (:mod:`.daemon_process`), before the configuration is unpickled. After the fill the daemon
  stops it (:func:`stop`).
* **An engine.** :func:`start_in_worker` starts it as vLLM's GPU worker begins ``init_device``
  (CUDA, NCCL and cuBLAS set-up, the memory snapshot, the model runner, then the model's construction
  come before the copy). The helpers' CUDA contexts must be in vLLM's memory snapshot, which sizes the
  KV cache from the free memory: the loader's ``get_external_weight_memory``, vLLM's last call before
  the snapshot, waits for them (:func:`await_helpers`), and they are stopped only once vLLM has
  measured the memory after its profile run (:func:`stop_after_memory_profile`), so that they count as
  another process's memory both times and the KV cache is sized as without them.

The loader's helper pool waits for the page-locking (:func:`ready_service_dir`) on its starting thread,
while vLLM builds the model, and then takes that service's helpers, with every window held already. Only where the loader copies with
helpers (``io_mode`` resolving to ``processes``: enough cores, no sleep mode, a bundle not on a tmpfs
of 4 KiB pages) in a single process (one GPU), for a bundle without experts layers, with
``io_helper_service`` on, when no ``marlin-pack helpers`` serves that GPU already (the loader uses that
one); in an engine also only where the GPU keeps room for the helpers' contexts under
``--gpu-memory-utilization``. Meanwhile the bundle's page-cache pages are pinned in host memory (as
the copy pins them anyway) and the helpers hold a CUDA context each on the GPU.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marlin_pack.vllm_plugin.helper_service import HELPER_CONTEXT_BYTES, HelperService, find_sockets, gpu_uuid, socket_dir

__all__ = [
    "ENV", "Preload", "await_helpers", "current", "export", "plan", "ready_service_dir", "start_from_environment", "start_in_worker",
    "stop", "stop_after_memory_profile",
]

logger = logging.getLogger("vllm.marlin_pack")

# The plan, as JSON, from the vllm preload process to the daemon it spawns.
ENV = "MARLIN_PACK_DAEMON_PRELOAD"
_MIB = 1 << 20
# How long the loader waits for the page-locking before copying without it: a cold page cache makes
# it read the files from disk first (which the copy would have to do as well).
_WAIT_S = 600.0


def plan(vllm_config: Any, role: str = "daemon") -> dict | None:
    """What the loader of ``vllm_config`` should have page-locked before it copies; None where nothing.

    ``role``: ``"daemon"`` (planned in the ``vllm preload`` process for the daemon it spawns; the
    ``daemon_preload`` option) or ``"engine"`` (in the engine's GPU worker; ``engine_preload``). vLLM is
    imported. Cheap: the manifest is read, nothing is hashed (the loader checks the bundle as always,
    and the page-locking is stopped if it does not use it). Never raises: a bundle it cannot find is
    the loader's to report.
    """
    from marlin_pack._constants import LOAD_FORMAT
    from marlin_pack.vllm_plugin.options import parse_extra_config

    load_config = vllm_config.load_config
    # One process (vLLM's own count over TP, PCP, PP and DP, as helpers_help reads it): an explicit io_mode
    # "processes" skips helpers_help, and several ranks would each start a service on the same cores.
    if str(load_config.load_format) != LOAD_FORMAT or vllm_config.parallel_config.world_size_across_dp != 1:
        return None
    try:
        options = parse_extra_config(load_config.model_loader_extra_config or {})
    except ValueError:
        return None  # the daemon's loader refuses it with the message
    if not (options.daemon_preload if role == "daemon" else options.engine_preload) or not options.io_helper_service:
        return None
    try:
        from marlin_pack.bundle.reader import read_manifest, resolve_file
        from marlin_pack.vllm_plugin.copy_helpers import DEFAULT_PROCESSES
        from marlin_pack.vllm_plugin.decision import check_engine, resolve_bundle_dir
        from marlin_pack.vllm_plugin.engine import engine_facts
        from marlin_pack.vllm_plugin.gpu_reader import MODE_DEFAULTS, helpers_help, uses_helpers

        model_config = vllm_config.model_config
        facts = engine_facts(vllm_config, model_config)
        bundle_dir = resolve_bundle_dir(options, facts.model, facts.revision)
        manifest = read_manifest(bundle_dir)
        tp_set = check_engine(manifest, facts)
        if tp_set.moe_layers:
            return None
        rank_file = resolve_file(bundle_dir, tp_set.ranks[facts.tp_rank].file)
        common_file = resolve_file(bundle_dir, manifest.common)
        if not uses_helpers(options.io_mode, lambda: rank_file, lambda: helpers_help(vllm_config, model_config)):
            return None
        files = [str(rank_file.resolve()), str(common_file.resolve())]
        sizes = [os.stat(f).st_size for f in files]
    except Exception as e:  # noqa: BLE001 - the loader says what is wrong, with its own message
        logger.debug("marlin-pack: no page-locking ahead of the %s's copy: %s", role, e)
        return None
    return {
        "parent": os.getpid(),
        "files": files,
        "bytes": sum(sizes),
        "device": 0,  # a single process's device index (an engine's worker sets its own)
        "processes": options.io_processes or DEFAULT_PROCESSES,
        "window_mib": options.chunk_mb or MODE_DEFAULTS["processes"][1] // _MIB,  # the windows the loader cuts
        "staged": options.io_staged,
        "stage_mib": options.io_stage_mib,
        "nice": options.io_helper_nice,
    }


def export(vllm_config: Any, draft: bool, environ: dict[str, str] | None = None) -> dict | None:
    """In the ``vllm preload`` process, before it spawns its daemons: name what the daemon should page-lock
    as it starts in ``environ`` (default ``os.environ``, which spawned processes inherit), or clear it.

    Only a single daemon (one GPU, no ``draft`` daemon beside it) gets a plan."""
    env = os.environ if environ is None else environ
    found = None if draft else plan(vllm_config)  # plan() is None for more than one daemon
    if found is None:
        env.pop(ENV, None)
        return None
    env[ENV] = json.dumps(found)
    logger.info(
        "marlin-pack: the weight-cache daemon page-locks its bundle (%d files, %s) in copy helpers while it starts, "
        "so that its fill copies without page-locking (\"daemon_preload\": false turns this off)",
        len(found["files"]), _size(found["bytes"]),
    )
    return found


@dataclass
class Preload:
    """Page-locking ahead of the loader's copy: a private helper service, started on a thread.

    ``engine``: started by an engine's worker, whose memory snapshot counts the helpers' contexts; they
    then live until :func:`stop_after_memory_profile` (a daemon stops them after its fill)."""

    spec: dict
    directory: Path
    engine: bool = False
    began: float = field(default_factory=time.perf_counter)
    service: HelperService | None = None
    locked: int = 0  # bytes page-locked (retained) by the service's helpers
    seconds: float | None = None  # from the start until the files were page-locked (or it failed)
    error: str | None = None  # why not, if it failed
    skipped: str | None = None  # why nothing was started, where that is no failure (a service serves the GPU; no room)
    helpers_up: threading.Event = field(default_factory=threading.Event)  # contexts created (or it failed)
    done: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        try:
            spec = self.spec
            device = int(spec["device"])
            # No socket at all: no service, and no driver call (cuInit) to learn this GPU's UUID.
            if list(socket_dir().glob("*.sock")) and find_sockets(gpu_uuid(device)):
                self.skipped = "marlin-pack helpers serves this GPU already (the loader uses it)"
                return
            if "utilization" in spec and (why := _no_room(device, int(spec["processes"]), float(spec["utilization"]))):
                self.skipped = why
                return
            service = HelperService(
                [device], processes=int(spec["processes"]), directory=self.directory, staged=int(spec["staged"]),
                stage_mib=int(spec["stage_mib"]), nice=int(spec["nice"]),
                # Each helper may hold every byte: preload gives each a share, and a window the copy cuts
                # otherwise is then registered and retained by whichever helper copies it.
                retain_mib=-(-int(spec["bytes"]) // _MIB), log=lambda line: logger.info("%s", line),
            )
            with self._lock:
                if self.stopped:
                    return
                self.service = service
            service.start()
            self.helpers_up.set()
            if not self.stopped:
                self.locked = sum(service.preload(spec["files"], int(spec["window_mib"])).values())
        except Exception as e:  # noqa: BLE001 - the loader then copies with helpers of its own
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - self.began
            self.helpers_up.set()
            self.done.set()

    def stop(self, wait_s: float = 30.0) -> None:
        """End the service (its helpers unregister the pages and exit) and remove its directory; idempotent.

        Waits (at most ``wait_s``) for a start still under way, so that no helper it spawns is left behind."""
        self.done.wait(wait_s)
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            service = self.service
        if service is not None:
            service.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


# Beside the helpers' contexts, what an engine's worker holds at vLLM's memory snapshot (its own CUDA
# context, NCCL's and cuBLAS's buffers), with a margin: the GPU must keep this much above the
# --gpu-memory-utilization share, or vLLM refuses to start.
_ENGINE_BASELINE_BYTES = 3 << 30


def _no_room(device: int, processes: int, utilization: float) -> str | None:
    """Why an engine's GPU has no room for ``processes`` helper contexts beside ``--gpu-memory-utilization``; None if it has.

    vLLM's worker requires the free memory at its snapshot to cover ``utilization`` of the GPU, and
    helpers alive then take theirs from it. Asks NVML (no CUDA context), as vLLM's platform does."""
    from vllm.utils.import_utils import import_pynvml

    try:
        nvml = import_pynvml()
        nvml.nvmlInit()
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByUUID(gpu_uuid(device)))
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - e.g. a MIG instance, which NVML names otherwise: then no helpers ahead
        return f"NVML could not say how much memory the GPU has free ({type(e).__name__}: {e})"
    need = processes * HELPER_CONTEXT_BYTES + _ENGINE_BASELINE_BYTES
    if info.free - need >= utilization * info.total:
        return None
    return (
        f"the GPU has {info.free / 2**30:.1f} GiB free of {info.total / 2**30:.1f} GiB; {processes} helper contexts and the "
        f"engine's own ({need / 2**30:.1f} GiB) would leave less than --gpu-memory-utilization {utilization} of it"
    )


_CURRENT: Preload | None = None


def current() -> Preload | None:
    """This process's page-locking ahead of its copy, if it started one."""
    return _CURRENT


def _begin(spec: dict, directory: Path, engine: bool) -> Preload:
    global _CURRENT
    preload = Preload(spec, directory, engine=engine)
    _CURRENT = preload
    atexit.register(preload.stop)
    threading.Thread(target=preload.run, name="marlin-pack-preload", daemon=True).start()
    return preload


def start_from_environment(environ: dict[str, str] | None = None) -> Preload | None:
    """In a spawned daemon process: start the page-locking :func:`export` planned for it, on a thread.

    The plan is taken out of the environment (the daemon's own children never see it), and only a
    direct child of the process that planned it acts on it.
    """
    env = os.environ if environ is None else environ
    raw = env.pop(ENV, None)
    if raw is None or _CURRENT is not None:
        return None
    try:
        spec = json.loads(raw)
        if not isinstance(spec, dict) or spec.get("parent") != os.getppid() or not spec.get("files"):
            return None
        directory = Path(tempfile.mkdtemp(prefix="marlin-pack-daemon-"))  # mode 0700, this user's
    except (ValueError, OSError):
        return None
    return _begin(spec, directory, engine=False)


def start_in_worker(worker: Any) -> Preload | None:
    """As vLLM's GPU ``worker`` begins ``init_device``: start the page-locking its loader's copy will use, on a thread.

    Only where :func:`plan` finds a plan (``engine_preload``; a single-process engine), and not in a process
    that started one already. Never raises."""
    if _CURRENT is not None:
        return None
    try:
        vllm_config = worker.vllm_config
        spec = plan(vllm_config, role="engine")  # None for an engine of several processes
        if spec is None:
            return None
        spec["device"] = int(getattr(worker, "local_rank", 0) or 0)
        spec["utilization"] = float(vllm_config.cache_config.gpu_memory_utilization)
        directory = Path(tempfile.mkdtemp(prefix="marlin-pack-engine-"))  # mode 0700, this user's
    except Exception as e:  # noqa: BLE001 - the engine starts as without it
        logger.debug("marlin-pack: no page-locking ahead of the engine's copy: %s", e)
        return None
    logger.info(
        "marlin-pack: copy helpers page-lock the bundle (%d files, %s) while vLLM sets up its GPU worker, so that the "
        "copy does not page-lock (\"engine_preload\": false turns this off)",
        len(spec["files"]), _size(spec["bytes"]),
    )
    return _begin(spec, directory, engine=True)


def await_helpers(timeout_s: float = 60.0) -> None:
    """In an engine, just before vLLM's memory snapshot: wait until the page-locking service's helpers hold their
    CUDA contexts (or it failed), so that the snapshot counts them as another process's memory."""
    preload = _CURRENT
    if preload is None or not preload.engine or preload.stopped:
        return
    t0 = time.perf_counter()
    if not preload.helpers_up.wait(timeout_s):  # they appear after the snapshot: the KV cache comes out smaller, never larger
        logger.warning("marlin-pack: the copy helpers were not up after %.0f s, before vLLM's memory snapshot", timeout_s)
    elif (waited := time.perf_counter() - t0) >= 0.01:
        logger.info("marlin-pack: waited %.2f s for the copy helpers' CUDA contexts before vLLM's memory snapshot", waited)


def ready_service_dir(timeout_s: float = _WAIT_S) -> Path | None:
    """For the loader's helper pool, as it starts (beside vLLM's construction of the model): the socket directory
    of this process's page-locking service once it has page-locked the files; None where there is none (or it
    failed, said here once)."""
    preload = _CURRENT
    if preload is None or preload.stopped:
        return None
    role = "engine" if preload.engine else "daemon"
    asked = time.perf_counter()
    if not preload.done.wait(timeout_s):
        logger.warning("marlin-pack: the %s's copy helpers did not page-lock its bundle in %.0f s; copying without them", role, timeout_s)
        _stop_unless_counted(preload)
        return None
    if preload.skipped is not None:
        logger.info("marlin-pack: no copy helpers page-locked the bundle ahead of the %s's copy: %s", role, preload.skipped)
        _stop_unless_counted(preload)
        return None
    if preload.error is not None or not preload.locked:
        logger.warning("marlin-pack: the %s's bundle was not page-locked ahead of its copy (%s); copying as usual",
                       role, preload.error or "nothing was page-locked")
        _stop_unless_counted(preload)
        return None
    now = time.perf_counter()
    logger.info(
        "marlin-pack: %s of the bundle page-locked in %d copy helpers in %.2f s, %.2f s before the loader's helper pool "
        "took them (which waited %.2f s for it, beside vLLM's construction of the model)",
        _size(preload.locked), int(preload.spec["processes"]), preload.seconds or 0.0,
        now - preload.began - (preload.seconds or 0.0), now - asked,
    )
    return preload.directory


def _stop_unless_counted(preload: Preload) -> None:
    """A daemon's unused service ends now; an engine's lives on until vLLM has measured the memory again."""
    if not preload.engine:
        stop()


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def stop() -> None:
    """After the copy (used or not): end this process's page-locking service, if any, without waiting for it."""
    preload = _CURRENT
    if preload is not None and not preload.stopped:
        threading.Thread(target=preload.stop, name="marlin-pack-preload-stop", daemon=True).start()


def stop_after_memory_profile() -> None:
    """In an engine, once vLLM has measured the memory after its profile run (the KV cache is sized): end the
    page-locking service its worker started; its helpers' memory is then free for the KV cache allocation."""
    preload = _CURRENT
    if preload is not None and preload.engine:
        stop()
