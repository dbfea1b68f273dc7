"""How a bundle reaches the GPU: decided once, from plain facts, and carried as a value.

:func:`plan_io` turns :class:`IoFacts` (gathered by the vLLM adapter: processes, cores, allocator,
file system, GPU room) into an :class:`IoPlan` that every reader obeys: the loader's copy of the rank
file, its reads of the common tensors, and the page-locking ahead of the copy (``preload``). Nothing
here imports torch or vLLM, so every decision is tested on a CPU.

The four ways, with the figures that chose them (H200 host, 16 cores, pinned host-to-GPU 55 GB/s;
``benchmarks/bench_h2d.py``; docs/performance.md):

``staged``
    ``pread`` into pinned buffers, then a copy: one CPU copy per byte. The way for a file on a tmpfs of
    4 KiB pages, where page-locking walks every page (70B rank file: 12.7-19.7 GB/s staged against
    10.1 GB/s registered).
``registered``
    page-lock the page cache's pages in place and let the copy engine read them (22-26 GB/s: part of
    the page-locking limit is per process).
``helpers``
    ``registered`` in a few copy helper processes (4 x 4 threads: 35-37 GB/s), where they pay and work:
    one vLLM process on the host, enough cores, memory of PyTorch's ordinary allocator (legacy CUDA IPC)
    and room on the GPU for their CUDA contexts. With ``preload`` they page-lock the bundle while vLLM
    sets up, so the copy itself does not page-lock (70B: 0.83-1.10 s "Model loading took").

``direct``
    ``O_DIRECT`` reads of large aligned windows, several in flight, into pinned buffers, then a copy: the
    way for a rank file that is mostly not in the page cache (the first start after ``convert``, whose
    writes bypass the page cache, or after a reboot) where the host's memory could not keep it cached.
    Page-locking a cold map faults it in page by page (1.2 GB/s for a 70B rank file, 29.95 s "Model loading
    took"); direct reads are bound by the disk. Chosen from :func:`~marlin_pack.io.residency.cached_fraction`
    of the rank file, never by an option.

A cold rank file that the host's available memory holds with room to spare (:attr:`IoFacts.cache_room`) is read
``staged`` with the direct way's threads and windows instead: ``pread`` through the page cache, the same one read of
the disk (as fast: 1.13-1.39 s against 1.42-1.54 s for a 2 GB cold file on the 2-core VM, both at 1.00x the file),
which leaves the file cached, so the next start is warm without the loader reading it again afterwards.

A file this process must hash as well as copy (``verify: auto`` without a stamp of this user, or ``full``) is read
once for both where its copy reads it from the disk (:func:`reads_cold`: the cold ways): the decision leaves its
digest to the copy (:func:`hash_left_to_copy`), which stages every byte of it through its own buffers and hashes them
there (:meth:`IoPlan.hashing`; :class:`~marlin_pack.io.hashing.CopyHash`). A warm file is hashed before the copy, as
before: both read the page cache, not the disk.

``MARLIN_PACK_IO`` (a JSON object of :class:`IoPlan` fields, e.g. ``{"mode": "registered"}``) overrides
the plan for benchmarks; it is not an option a user needs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ENV", "GpuRoom", "HELPER_CONTEXT_BYTES", "IoFacts", "IoPlan", "Mode", "hash_left_to_copy", "helpers_fit", "plan_io",
    "reads_cold", "usable_cores",
]

Mode = Literal["staged", "registered", "helpers", "direct"]
MODES: tuple[str, ...] = ("staged", "registered", "helpers", "direct")
ENV = "MARLIN_PACK_IO"
_MIB = 1 << 20

# GPU memory per copy helper's CUDA context (a driver-API context without torch: nvidia-smi showed 518 MiB on an H200).
HELPER_CONTEXT_BYTES = 512 << 20
# What a vLLM process holds besides the weights when the helpers must fit (its own CUDA context, NCCL's and
# cuBLAS's buffers), with a margin.
_PROCESS_BASELINE_BYTES = 3 << 30
# Helpers only with this many usable cores (4 helpers x 4 threads measured best on 16).
_HELPER_MIN_CORES = 8
# (threads, window bytes) per way: measured, see the module docstring.
_STAGED = (8, 64 * _MIB)  # more or larger pinned buffers cost more to allocate than they gain
_REGISTERED = (16, 256 * _MIB)
_HELPER_THREADS, _HELPER_WINDOW, _HELPERS = 4, 256 * _MIB, 4
# Direct reads: 8 threads x 2 buffers of 32 MiB (16 requests of 32 MiB in flight, as fast loaders keep on NVMe);
# on an H100's local disk a cold start read at the disk's rate with them (docs/performance.md, cold starts).
_DIRECT = (8, 32 * _MIB)
# Below this fraction of the rank file in the page cache, the copy reads it directly.
COLD_BELOW = 0.5


@dataclass(frozen=True)
class GpuRoom:
    """The GPU's memory as the driver reports it before the copy (bytes)."""

    free: int
    total: int


@dataclass(frozen=True)
class IoFacts:
    """What the plan depends on, as plain values.

    Attributes:
        role: ``engine`` (vLLM measures the GPU memory after loading, so the helpers must be gone or
            counted) or ``daemon`` (a weight-cache daemon's fill: nothing is measured after it).
        processes: vLLM processes of this engine on the host (TP x PP x DP): several would each start
            helpers and contend for cores and page pins.
        cores: CPU cores this process may run on.
        legacy_ipc: device memory comes from PyTorch's ordinary allocator (no sleep mode, no
            ``expandable_segments``), which legacy CUDA IPC can open in a helper.
        base_pages: the rank file lies in memory held in 4 KiB pages (a tmpfs without huge pages).
        experts: the bundle has experts layers: vLLM's Marlin MoE methods keep their own device
            placeholders, so the copy waits for the model's construction.
        bundle_bytes: the rank file and the common file.
        gpu: the GPU's memory before loading; None where it cannot be asked (no helpers then).
        utilization: ``--gpu-memory-utilization`` (an engine's share the GPU must keep free at vLLM's snapshot).
        preload: planned ahead, with the loader's ``preload`` option: an engine's helpers would start before
            vLLM's memory snapshot. False for the loader's own plan, made after that snapshot.
        cached: the fraction of the rank file in the page cache (None: unknown, taken as cached).
        direct_reads: the rank file's file system takes ``O_DIRECT`` reads.
        cache_room: the host's available memory holds the rank file in the page cache and still leaves
            :data:`~marlin_pack.io.residency.HEADROOM`.
    """

    role: Literal["engine", "daemon"] = "engine"
    processes: int = 1
    cores: int = 1
    legacy_ipc: bool = True
    base_pages: bool = False
    experts: bool = False
    bundle_bytes: int = 0
    gpu: GpuRoom | None = None
    utilization: float = 0.9
    preload: bool = True
    cached: float | None = None
    direct_reads: bool = False
    cache_room: bool = False

    @property
    def helpers_ahead(self) -> bool:
        """Helpers, if the plan has them, start ahead and page-lock the bundle: with ``preload``, and not for
        experts layers (their copy waits for the model's construction). An engine's are then alive at vLLM's
        memory snapshot."""
        return self.preload and not self.experts


@dataclass(frozen=True)
class IoPlan:
    """How this process copies its bundle, and why.

    Attributes:
        mode: ``staged``, ``registered``, ``helpers`` or ``direct`` (see the module docstring).
        threads: reader threads of this process; with helpers, each helper's threads.
        window: bytes of one read / page-locked window.
        helpers: copy helper processes (0 unless ``mode`` is ``helpers``).
        during_build: copy the rank file into its memory while vLLM builds the model.
        common_during_build: also copy the large common tensors beside the construction (a daemon's
            fill with helpers: one job for both files).
        defer_unregister: helpers keep windows page-locked until their whole share is copied (a
            daemon's fill, whose helpers exit in the background).
        preload: helpers page-lock the bundle before the copy (as the engine's worker or the daemon starts).
        why: one line for the log.
    """

    mode: Mode = "registered"
    threads: int = _REGISTERED[0]
    window: int = _REGISTERED[1]
    helpers: int = 0
    during_build: bool = True
    common_during_build: bool = False
    defer_unregister: bool = False
    preload: bool = False
    why: str = ""

    def local(self) -> IoPlan:
        """The plan for what this process reads itself beside its helpers (the common tensors while the
        helpers copy the rank file, the windows a helper left): ``registered``, or ``staged`` where that is the plan."""
        if self.mode != "helpers":
            return self
        threads, window = _REGISTERED
        return dataclasses.replace(self, mode="registered", threads=threads, window=window, helpers=0, preload=False)

    def hashing(self) -> IoPlan:
        """The plan for a file this process hashes as it copies it: every byte through this process's own staging
        buffers, where the digest is taken (:class:`~marlin_pack.io.hashing.CopyHash`). The plan itself where it
        stages (``staged``, ``direct``); else ``staged`` (registered pages and helpers' copies never pass through
        this process's buffers)."""
        if self.mode in ("staged", "direct"):
            return self
        threads, window = _STAGED
        return dataclasses.replace(self, mode="staged", threads=threads, window=window, helpers=0, preload=False)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> IoPlan:
        """A plan :meth:`to_json` wrote (another process's, e.g. ``vllm preload``'s for its daemon).

        Raises:
            ValueError: not such a plan.
        """
        return _replace(cls(), json.loads(text), "a carried I/O plan")


def helpers_fit(facts: IoFacts, helpers: int) -> bool:
    """The one rule for room on the GPU: ``helpers`` CUDA contexts and this process's own fit beside what it needs.

    Helpers an engine starts ahead (``preload``, no experts) are alive at vLLM's memory snapshot, which must
    find ``--gpu-memory-utilization`` of the GPU free. Helpers started by the loader come after that snapshot
    and are gone (joined) before vLLM measures again, so, like a daemon's, they need only room for the bundle
    beside them. A model that just fits must not fail to load because of helpers, which only make it faster.
    """
    if facts.gpu is None:
        return False
    at_snapshot = facts.role == "engine" and facts.helpers_ahead
    need = facts.utilization * facts.gpu.total if at_snapshot else facts.bundle_bytes
    return facts.gpu.free - helpers * HELPER_CONTEXT_BYTES - _PROCESS_BASELINE_BYTES >= need


def _helpers_refused(facts: IoFacts) -> str | None:
    """Why copy helpers do not pay or cannot work here; None where they do."""
    if facts.processes != 1:
        return f"{facts.processes} vLLM processes on this host"
    if facts.cores < _HELPER_MIN_CORES:
        return f"{facts.cores} cores (helpers from {_HELPER_MIN_CORES})"
    if not facts.legacy_ipc:
        return "GPU memory from sleep mode or expandable segments (no legacy CUDA IPC)"
    if not helpers_fit(facts, _HELPERS):
        return "no room on the GPU for their CUDA contexts" if facts.gpu is not None else "the GPU's free memory is unknown"
    return None


def reads_cold(cached: float | None, direct_reads: bool) -> bool:
    """The one rule for a cold file: its file system takes ``O_DIRECT`` reads and less than :data:`COLD_BELOW` of it is
    in the page cache (None: unknown, taken as cached). Such a rank file is copied ``direct``, or ``staged`` through the
    page cache where memory keeps it (:func:`plan_io`)."""
    return direct_reads and cached is not None and cached < COLD_BELOW


def hash_left_to_copy(path: str | os.PathLike[str]) -> bool:
    """Whether a bundle file that must be hashed is better hashed by its copy than before it: it is cold
    (:func:`reads_cold`), so hashing it first would read it from the disk once for the digest and again for the copy.
    The caller leaves its digest to a copy that reads the whole file (the loader's, which compares it before serving)."""
    from marlin_pack.io.residency import cached_fraction, takes_direct_reads  # plain file facts (no torch)

    return reads_cold(cached_fraction(path), takes_direct_reads(path))


def plan_io(facts: IoFacts, environ: Mapping[str, str] | None = None) -> IoPlan:
    """The plan for ``facts`` (then ``$MARLIN_PACK_IO``'s overrides, for benchmarks).

    Raises:
        ValueError: ``$MARLIN_PACK_IO`` is not a JSON object of plan fields.
    """
    during = not facts.experts
    if reads_cold(facts.cached, facts.direct_reads):
        threads, window = _DIRECT
        cold = f"{facts.cached:.0%} of the rank file is in the page cache"
        if facts.cache_room:  # one read of the disk either way; through the cache it is warm for the next start
            plan = IoPlan("staged", threads, window, during_build=during,
                          why=f"{cold}: read through it at the disk's speed, left cached for the next start")
        else:
            plan = IoPlan("direct", threads, window, during_build=during,
                          why=f"{cold} and memory would not keep it there: direct reads, at the disk's speed")
    elif facts.base_pages:
        threads, window = _STAGED
        plan = IoPlan("staged", threads, window, during_build=during, why="the bundle is on a tmpfs of 4 KiB pages")
    elif (refused := _helpers_refused(facts)) is not None:
        threads, window = _REGISTERED
        plan = IoPlan("registered", threads, window, during_build=during, why=f"no copy helpers: {refused}")
    else:
        daemon = facts.role == "daemon"
        preload = facts.helpers_ahead
        plan = IoPlan(
            "helpers", _HELPER_THREADS, _HELPER_WINDOW, _HELPERS, during_build=during,
            common_during_build=daemon and during, defer_unregister=daemon, preload=preload,
            why=f"{_HELPERS} copy helpers ({facts.cores} cores, one process, room on the GPU)"
            + ("; they page-lock the bundle ahead of the copy" if preload else ""),
        )
    env = os.environ if environ is None else environ
    if env.get(ENV):
        try:
            overrides = json.loads(env[ENV])
        except ValueError:
            raise ValueError(f"{ENV}={env[ENV]!r} is not JSON; expected an object of I/O plan fields, or unset it") from None
        plan = _replace(plan, overrides, ENV)
        plan = dataclasses.replace(plan, why=f"{plan.why} (overridden by {ENV})")
    return plan


_FIELDS = {f.name: f for f in dataclasses.fields(IoPlan)}
_INTS = {"threads": (1, 64), "window": (1 << 16, 1 << 30), "helpers": (0, 32)}


def _replace(plan: IoPlan, overrides: object, where: str) -> IoPlan:
    if not isinstance(overrides, dict):
        raise ValueError(f"{where} must be a JSON object of I/O plan fields, got {type(overrides).__name__}")
    if "window_mib" in overrides:
        mib = overrides["window_mib"]
        if isinstance(mib, bool) or not isinstance(mib, int):  # not None: the message would name window, got None
            raise ValueError(f"{where}: window_mib must be an integer (MiB), got {mib!r}")
        overrides = {**overrides, "window": mib * _MIB}
        del overrides["window_mib"]
    for key, value in overrides.items():
        if key not in _FIELDS:
            raise ValueError(f"{where}: unknown field {key!r}; expected some of {sorted(_FIELDS)} (or window_mib)")
        if key == "mode" and value not in MODES:
            raise ValueError(f"{where}: mode {value!r}; expected one of {', '.join(MODES)}")
        if key in _INTS:
            lo, hi = _INTS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{where}: {key} must be an integer in {lo}..{hi}, got {value!r}")
        if _FIELDS[key].type == "bool" and not isinstance(value, bool):
            raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
    plan = dataclasses.replace(plan, **overrides)
    if plan.mode == "helpers" and plan.helpers == 0:
        plan = dataclasses.replace(plan, helpers=_HELPERS)
    if plan.window % 4096:
        raise ValueError(f"{where}: window must be a multiple of 4096 bytes, got {plan.window}")
    return plan if plan.mode == "helpers" else dataclasses.replace(plan, helpers=0, preload=False)


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
