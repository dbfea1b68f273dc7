"""A weight-cache daemon page-locks its bundle while vLLM is still starting it (``daemon_preload``).

A daemon's fill copies the bundle into GPU memory with copy helpers. With helpers of its own, each
page-locks (``cuMemHostRegister``) every window of the page cache as it copies, and beside vLLM's
construction that held a 70B fill at 1.2-2.1 s on an H200; helpers that hold the bundle page-locked
already (``marlin-pack helpers --retain-gib G --preload BUNDLE``) copied it at 42-47 GB/s, a fill of
1.06-1.29 s (docs/performance.md). ``vllm preload`` spawns each daemon process, which then spends
seconds importing torch and vLLM and unpickling its configuration before it builds and fills the
model; this module puts the page-locking in that time, so a plain ``vllm preload`` /
``marlin-pack daemon`` gets the preloaded fill without a service to run:

* In the ``vllm preload`` process, :func:`export` (called as vLLM looks at the final configuration
  one last time before spawning the daemons) picks the files this daemon will copy
  (:func:`plan`) and names them in the environment the spawned daemon inherits (:data:`ENV`).
* In the daemon process, :func:`start_from_environment` runs as the spawn target's module is
  imported (:mod:`.daemon_process`), before the configuration is unpickled: on a thread, a
  private helper service (:class:`.helper_service.HelperService`, sockets in a fresh 0700
  directory) starts and page-locks those files, retaining them.
* The loader waits for it (:func:`ready_service_dir`) before its copy; its helper pool then takes
  that service's helpers, with every window held already. After the fill the daemon stops it
  (:func:`stop`): its helpers unregister the pages and exit in the background.

Only for a daemon of one GPU whose loader copies with helpers (``io_mode`` resolving to
``processes``: enough cores, no sleep mode, a bundle not on a tmpfs of 4 KiB pages), of a bundle
without experts layers, without a draft daemon, with ``io_helper_service`` on, when no
``marlin-pack helpers`` serves that GPU already (the loader uses that one), and not with
``"daemon_preload": false``. Meanwhile the bundle's page-cache pages are pinned in host memory
(as the fill pins them anyway) and the helpers hold a CUDA context each on the GPU.

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

from marlin_pack.vllm_plugin.helper_service import HelperService, find_sockets, gpu_uuid, socket_dir

__all__ = ["ENV", "Preload", "current", "export", "plan", "ready_service_dir", "start_from_environment", "stop"]

logger = logging.getLogger("vllm.marlin_pack")

# The plan, as JSON, from the vllm preload process to the daemon it spawns.
ENV = "MARLIN_PACK_DAEMON_PRELOAD"
_MIB = 1 << 20
# How long the loader waits for the page-locking before copying without it: a cold page cache makes
# it read the files from disk first (which the copy would have to do as well).
_WAIT_S = 600.0


def plan(vllm_config: Any) -> dict | None:
    """What a daemon spawned for ``vllm_config`` should page-lock as it starts; None where it should not.

    Runs in the ``vllm preload`` process (vLLM imported). Cheap: the manifest is read, nothing is
    hashed (the daemon's loader checks the bundle as always, and stops the page-locking if it
    does not use it). Never raises: a bundle it cannot find is the loader's to report.
    """
    from marlin_pack._constants import LOAD_FORMAT
    from marlin_pack.vllm_plugin.options import parse_extra_config

    load_config = vllm_config.load_config
    if str(load_config.load_format) != LOAD_FORMAT:
        return None
    try:
        options = parse_extra_config(load_config.model_loader_extra_config or {})
    except ValueError:
        return None  # the daemon's loader refuses it with the message
    if not options.daemon_preload or not options.io_helper_service:
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
    except Exception as e:  # noqa: BLE001 - the daemon's loader says what is wrong, with its own message
        logger.debug("marlin-pack: no page-locking ahead of the daemon's fill: %s", e)
        return None
    return {
        "parent": os.getpid(),
        "files": files,
        "bytes": sum(sizes),
        "device": 0,  # the one daemon's local rank: its device index
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
    # One daemon: vLLM's own count of the processes (TP, PCP, PP and DP), as helpers_help reads it.
    found = None if draft or vllm_config.parallel_config.world_size_across_dp != 1 else plan(vllm_config)
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
    """The daemon's page-locking ahead of its fill: a private helper service, started on a thread."""

    spec: dict
    directory: Path
    began: float = field(default_factory=time.perf_counter)
    service: HelperService | None = None
    locked: int = 0  # bytes page-locked (retained) by the service's helpers
    seconds: float | None = None  # from the start until the files were page-locked (or it failed)
    error: str | None = None  # why not, if not
    done: threading.Event = field(default_factory=threading.Event)
    stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        try:
            spec = self.spec
            device = int(spec["device"])
            # No socket at all: no service, and no driver call (cuInit) to learn this GPU's UUID.
            if list(socket_dir().glob("*.sock")) and find_sockets(gpu_uuid(device)):
                self.error = "marlin-pack helpers serves this GPU already (the loader uses it)"
                return
            service = HelperService(
                [device], processes=int(spec["processes"]), directory=self.directory, staged=int(spec["staged"]),
                stage_mib=int(spec["stage_mib"]), nice=int(spec["nice"]),
                # Each helper may hold every byte: preload gives each a share, and a window the fill cuts
                # otherwise is then registered and retained by whichever helper copies it.
                retain_mib=-(-int(spec["bytes"]) // _MIB), log=lambda line: logger.info("%s", line),
            )
            with self._lock:
                if self.stopped:
                    return
                self.service = service
            service.start()
            if not self.stopped:
                self.locked = sum(service.preload(spec["files"], int(spec["window_mib"])).values())
        except Exception as e:  # noqa: BLE001 - the fill then copies with helpers of its own
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - self.began
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


_CURRENT: Preload | None = None


def current() -> Preload | None:
    """This process's page-locking ahead of its fill, if it started one."""
    return _CURRENT


def start_from_environment(environ: dict[str, str] | None = None) -> Preload | None:
    """In a spawned daemon process: start the page-locking :func:`export` planned for it, on a thread.

    The plan is taken out of the environment (the daemon's own children never see it), and only a
    direct child of the process that planned it acts on it.
    """
    global _CURRENT
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
    preload = Preload(spec, directory)
    _CURRENT = preload
    atexit.register(preload.stop)
    threading.Thread(target=preload.run, name="marlin-pack-daemon-preload", daemon=True).start()
    return preload


def ready_service_dir(timeout_s: float = _WAIT_S) -> Path | None:
    """For the loader, before it starts copying: the socket directory of this process's page-locking service
    once it has page-locked the files; None where there is none (or it failed, said here once)."""
    preload = _CURRENT
    if preload is None or preload.stopped:
        return None
    if not preload.done.wait(timeout_s):
        logger.warning("marlin-pack: the daemon's copy helpers did not page-lock its bundle in %.0f s; copying without them", timeout_s)
        stop()
        return None
    if preload.error is not None or not preload.locked:
        logger.warning("marlin-pack: the daemon's bundle was not page-locked ahead of its fill (%s); copying as usual",
                       preload.error or "nothing was page-locked")
        stop()
        return None
    logger.info(
        "marlin-pack: %s of the bundle page-locked in %d copy helpers in %.2f s, %.2f s before the copy began",
        _size(preload.locked), int(preload.spec["processes"]), preload.seconds or 0.0,
        time.perf_counter() - preload.began - (preload.seconds or 0.0),
    )
    return preload.directory


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def stop() -> None:
    """After the fill (used or not): end this process's page-locking service, if any, without waiting for it."""
    preload = _CURRENT
    if preload is not None and not preload.stopped:
        threading.Thread(target=preload.stop, name="marlin-pack-daemon-preload-stop", daemon=True).start()
