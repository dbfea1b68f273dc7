"""``MarlinPrepackedLoader``: vLLM 0.33.0 model loader for ``--load-format marlin_prepacked``.

Three steps, usable separately (the weight-cache daemon calls the first two itself):

``create_model``
    Validates the bundle against the engine (cheap, before any GPU allocation), then
    builds the model with ``linear_backend_per_quant["mixed_precision"] = "marlin"``
    on the engine's ``KernelConfig`` so every AWQ/GPTQ layer gets ``MarlinLinearKernel``
    (on SM90 vLLM would pick Machete), and checks each quantized layer's kernel and
    configuration against the manifest. The override stays set: the engine does run
    Marlin, and vLLM's compile-cache hashes must not collide with a Machete run.
``load_weights``
    Replaces each quantized layer's placeholder tensors with the rank file's tensors
    (new device tensors bound to the same Parameter objects), marks the
    layers prepacked (see :mod:`.patches.post_processing`), and feeds ``common.safetensors`` through
    the model's own ``load_weights`` (sharding, stacking, tied embeddings).
``load_model``
    The engine path: both steps, vLLM's ``process_weights_after_loading`` (for the marked
    layers only ``engine.finish_marlin_layer``), timings in one INFO line.

With ``{"fallback": true}`` a bundle that does not fit is reported with a warning and the
checkpoint is loaded by vLLM's ``DefaultModelLoader``; without it the load stops with a
:class:`~marlin_pack.errors.LoadRefusedError` naming the field.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from marlin_pack._constants import KERNEL_NAME, LOAD_FORMAT
from marlin_pack.errors import BundleError, MismatchField
from marlin_pack.io.safetensors_io import TensorInfo
from marlin_pack.vllm_plugin import patches, preload
from marlin_pack.vllm_plugin.arena import ArenaLayout, BackgroundCopy, release
from marlin_pack.vllm_plugin.common_prefill import CommonPrefill, alias_names, plain_copy_target
from marlin_pack.vllm_plugin.copy_helpers import DEFAULT_PROCESSES, HelperPool, exits_in_background
from marlin_pack.vllm_plugin.decision import Decision, SelectedBundle, decide, refusal
from marlin_pack.vllm_plugin.engine import engine_facts, force_marlin, freeze_gc_heap, layer_facts, quantized_layers
from marlin_pack.vllm_plugin.gpu_reader import CopyItem, HostMap, ParallelReader, helpers_help, uses_helpers
from marlin_pack.vllm_plugin.helper_service import HELPER_CONTEXT_BYTES
from marlin_pack.vllm_plugin.layer_check import check_layers, check_moe_layers
from marlin_pack.vllm_plugin.moe_engine import force_marlin_moe, is_moe_layer, moe_layer_facts
from marlin_pack.vllm_plugin.options import parse_extra_config
from marlin_pack.vllm_plugin.patches.placeholders import stub_quantized_placeholders
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked, mark_prepacked
from marlin_pack.vllm_plugin.stubs import materialize_stubs

__all__ = ["MarlinPrepackedLoader"]

# Common tensors from this size on are read with the parallel reader (see _common_weights), and copied
# beside the construction with common_during_build (common_prefill).
_LARGE_COMMON = 16 << 20
# common_io staged: this process's reader of the common tensors beside the construction (pinned: 2 x 64 MiB a thread).
_COMMON_STAGED_THREADS, _COMMON_STAGED_CHUNK = 4, 64 << 20

# A child of "vllm" so vLLM's logging configuration (handler, level, format) applies.
logger = init_logger("vllm.marlin_pack")


@dataclass
class _ArenaFill:
    """The arena allocated before vLLM builds the model, and its copy running beside the construction."""

    layout: ArenaLayout
    arena: torch.Tensor
    copy: BackgroundCopy
    common: CommonPrefill | None = None  # common_during_build: the large common tensors (after the rank file, or see common_copy)
    common_copy: BackgroundCopy | None = None  # common_io staged: their own copy, at the same time as the rank file's

    def abandon(self) -> None:
        """Wait for the copies and drop their outcome (loading is failing or falling back)."""
        self.copy.abandon()  # its thread writes into the arena (and uses the helpers) until it ends
        if self.common_copy is not None:
            self.common_copy.abandon()

    def join(self) -> float:
        """Wait for the copies (both end, also when one failed); returns the seconds waited. Raises what a copy raised."""
        try:
            waited = self.copy.join()
        except BaseException:
            if self.common_copy is not None:
                self.common_copy.abandon()
            raise
        return waited + (self.common_copy.join() if self.common_copy is not None else 0.0)


@dataclass
class _ModelState:
    bundle: SelectedBundle | None  # None: loaded the ordinary way
    layers: dict[str, nn.Module] = field(default_factory=dict)
    helpers: HelperPool | None = None  # io_mode processes: started before vLLM builds the model, closed after the copies
    fill: _ArenaFill | None = None  # the rank file already being copied (dense bundles)


@dataclass
class _Timings:
    validate: float = 0.0
    create: float = 0.0
    arena: float = 0.0  # part of create: allocating the arena before the construction (copy during build)
    place: float = 0.0  # binding the arena's views to the layers' parameters, finishing their other placeholders
    copy: float = 0.0  # the rank file's read+copy, from its start to its end
    copy_bytes: int = 0
    beside: bool = False  # the copy ran beside the model's construction and the common tensors
    wait: float = 0.0  # beside: how long loading then waited for the copy
    modes: str = "-"  # the reader modes the copy used
    helpers_ready: float | None = None  # seconds from the helpers' start until the copy found them ready
    helpers_source: str = "own"  # or "service": marlin-pack helpers' (HelperPool.source)
    helpers_retained: int | None = None  # bytes the service's helpers held registered from earlier engines, if they retain
    common: float = 0.0
    common_beside: int | None = None  # common_during_build: the checkpoint names loaded by the copy beside the construction
    common_copy: float | None = None  # common_io staged: how long their own copy took, from its start to its end
    post: float = 0.0

    @property
    def rate(self) -> float:
        return self.copy_bytes / self.copy / 1e9 if self.copy > 0 else 0.0

    def copy_text(self) -> str:
        text = f"read+copy {self.copy:.2f} s ({self.copy_bytes / 1e9:.2f} GB, {self.rate:.1f} GB/s)"
        if self.helpers_ready is not None:
            text += f", helpers ready after {self.helpers_ready:.2f} s"
            text += " (the helper service's)" if self.helpers_source == "service" else ""
            if self.helpers_retained is not None:  # large or small: a real bundle or a test's
                n = self.helpers_retained
                text += f", {n / 1e9:.2f} GB" if n >= 1e9 else f", {n / 1e6:.1f} MB"
                text += " of pages retained registered"
        return f"{text} beside create and common, waited {self.wait:.2f} s" if self.beside else text

    def common_text(self) -> str:
        staged = "" if self.common_copy is None else f", staged in {self.common_copy:.2f} s"
        beside = "" if self.common_beside is None else f" ({self.common_beside} of its names copied beside the construction{staged})"
        return f"load common {self.common:.2f} s{beside}"

    def create_text(self) -> str:
        arena = f" (arena {self.arena:.2f} s)" if self.beside else ""
        return f"create {self.create:.2f} s{arena}, place {self.place:.2f} s"

    def line(self, bundle: SelectedBundle, layers: int) -> str:
        serial = self.wait if self.beside else self.copy  # what the copy added to the loader's time
        total = self.validate + self.create + self.place + serial + self.common + self.post
        return (
            f"marlin-pack: validate {self.validate:.2f} s, {self.create_text()}, {self.copy_text()}, "
            f"{self.common_text()}, post-process {self.post:.2f} s, total {total:.2f} s "
            f"({layers} prepacked layers, tp {bundle.tp_set.tp_size} rank {bundle.rank}, "
            f"bundle {bundle.bundle_dir})"
        )


class MarlinPrepackedLoader(BaseModelLoader):
    """Serve an AWQ/GPTQ checkpoint from its marlin-pack bundle (no repack at start).

    Extra config (``--model-loader-extra-config``): ``bundle``, ``fallback``, ``verify``,
    ``io_threads``, ``chunk_mb``, ``io_mode``; see :class:`~marlin_pack.vllm_plugin.options.LoaderOptions`.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Cheap and side-effect free: vLLM also instantiates loaders at worker init.
        self.options = parse_extra_config(load_config.model_loader_extra_config, str(load_config.load_format))
        self._decisions: dict[tuple[object, ...], Decision] = {}
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        self._timings = _Timings()

    # -- helpers -------------------------------------------------------------------------

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(
            dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={})
        )

    @staticmethod
    def _is_draft(vllm_config: VllmConfig, model_config: ModelConfig) -> bool:
        spec = vllm_config.speculative_config
        return spec is not None and model_config is getattr(spec, "draft_model_config", None)

    def _decide(self, vllm_config: VllmConfig, model_config: ModelConfig) -> Decision:
        facts = engine_facts(vllm_config, model_config)
        key = (facts.model, facts.tp_size, facts.tp_rank, facts.dtype)
        if key not in self._decisions:
            t0 = time.perf_counter()
            decision = decide(self.options, facts)
            self._timings.validate = time.perf_counter() - t0
            if decision.fallback:
                logger.warning(
                    "marlin-pack: not using the bundle for %s ([%s] %s); loading the checkpoint the "
                    "ordinary way because fallback is on",
                    facts.model,
                    decision.field,
                    decision.reason,
                )
            elif decision.bundle is not None and (hashed := decision.bundle.hashed.summary()) is not None:
                logger.warning("marlin-pack: rank %d %s", facts.tp_rank, hashed)
            self._decisions[key] = decision
        return self._decisions[key]

    # -- BaseModelLoader API ---------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        self._default_loader().download_model(model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """0 (the weights are this process's); vLLM's GPU worker asks just before its memory snapshot, so this is
        where it waits for the copy helpers it started early to hold their CUDA contexts (:func:`.preload.await_helpers`):
        the snapshot then counts them, as the measurement after the profile run does."""
        preload.await_helpers()
        return 0

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """Build the model with Marlin forced for mixed-precision layers and check its layers."""
        patches.install()
        if self._is_draft(vllm_config, model_config):
            logger.info("marlin-pack: loading the draft model %s the ordinary way", model_config.model)
            model = super().create_model(vllm_config, model_config, prefix)
            self._models[model] = _ModelState(None)
            return model
        decision = self._decide(vllm_config, model_config)
        if decision.bundle is None:
            model = super().create_model(vllm_config, model_config, prefix)
            self._models[model] = _ModelState(None)
            return model
        bundle = decision.bundle
        t0 = time.perf_counter()
        force_marlin(vllm_config.kernel_config)
        if bundle.tp_set.moe_layers:  # experts: Marlin MoE for --moe-backend auto (an explicit other one is refused below)
            force_marlin_moe(vllm_config.kernel_config)
        helpers = self._start_helpers(vllm_config, model_config, bundle)  # they get their CUDA contexts while vLLM builds the model
        try:
            model = self._create_checked(vllm_config, model_config, prefix, bundle, t0, helpers)
        except BaseException:
            if helpers is not None:
                helpers.close()
            raise
        if self._models[model].helpers is None and helpers is not None:
            helpers.close()  # fell back to the ordinary way
        return model

    def _start_helpers(self, vllm_config: VllmConfig, model_config: ModelConfig, bundle: SelectedBundle) -> HelperPool | None:
        """Helpers for the ``processes`` mode; None for other modes."""
        if not torch.cuda.is_available():
            return None
        def usable() -> bool:
            return helpers_help(vllm_config, model_config) and self._helpers_fit(bundle)

        if not uses_helpers(self.options.io_mode, lambda: bundle.rank_file, usable):
            return None
        # A weight-cache daemon or an engine that page-locks its bundle as it starts: that service's helpers copy it.
        # The pool waits for the page-locking on its starting thread, so vLLM builds the model meanwhile.
        service_dir = preload.ready_service_dir if self.options.io_helper_service and preload.current() is not None else None
        return HelperPool(
            self.options.io_processes, torch.cuda.current_device(),
            staged=self.options.io_staged, stage_mib=self.options.io_stage_mib,
            defer_unregister=self._in_daemon_by_default(self.options.io_defer_unregister, helpers=True), nice=self.options.io_helper_nice,
            service=self.options.io_helper_service, service_dir=service_dir,
        )

    @staticmethod
    def _in_daemon_by_default(option: bool | None, helpers: bool) -> bool:
        """An option whose default (None) is on in a weight-cache daemon's fill that copies with helpers,
        and off in an engine (or without helpers, where it was not measured).

        ``common_during_build`` with ``io_defer_unregister``: the helpers copy the rank file and the
        common tensors in one job each beside vLLM's construction and unregister the pages after it.
        A daemon does not wait for them to exit; an engine would (vLLM measures the free memory after
        loading), and there the 70B figures did not settle it (see docs/performance.md).
        """
        return exits_in_background() and helpers if option is None else option

    def _helpers_fit(self, bundle: SelectedBundle) -> bool:
        """Whether the GPU has room for the helpers' CUDA contexts beside the model's weights.

        They live only while the model loads, but a model that just fits must not fail to load
        because of them (``auto`` then stays in-process).
        """
        count = self.options.io_processes or DEFAULT_PROCESSES
        free, _ = torch.cuda.mem_get_info()
        weights = sum(f.stat().st_size for f in (bundle.rank_file, bundle.common_file))
        return free >= weights + count * HELPER_CONTEXT_BYTES

    def _create_checked(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, bundle: SelectedBundle, t0: float,
        helpers: HelperPool | None,
    ) -> nn.Module:
        fill = self._start_fill(bundle, helpers)
        try:
            with stub_quantized_placeholders(fill is not None, embeddings=fill is not None and fill.common is not None):
                model = super().create_model(vllm_config, model_config, prefix)
            if fill is not None and fill.copy.gate is not None:
                fill.copy.gate.set()  # built: the engine's process may copy its share now (io_own_share after_build)
        except BaseException:
            if fill is not None:
                fill.abandon()
            raise
        layers = quantized_layers(model)
        try:
            experts = {name: m for name, m in layers.items() if is_moe_layer(m)}
            facts = {
                name: layer_facts(m, skips_when_marked=is_patched(m.quant_method)) for name, m in layers.items() if name not in experts
            }
            check_layers(bundle.manifest, bundle.tp_set, facts)
            moe_facts = {name: moe_layer_facts(m, skips_when_marked=is_patched(m.quant_method)) for name, m in experts.items()}
            check_moe_layers(bundle.manifest, bundle.tp_set, moe_facts)
        except BundleError as e:
            reason, fld = str(e), getattr(e, "field", None) or MismatchField.layers
            if fill is not None:
                fill.abandon()
                fill = None  # the arena goes before the checkpoint loads
                for module in model.modules():  # vLLM's weight loaders will write into the placeholders
                    materialize_stubs(module)
            if not self.options.fallback:
                raise refusal(fld, reason, str(model_config.model), bundle.bundle_dir) from e
            # The model vLLM built is valid for ordinary loading (Marlin stays forced).
            logger.warning(
                "marlin-pack: not using the bundle %s ([%s] %s); loading the checkpoint the ordinary way "
                "because fallback is on",
                bundle.bundle_dir,
                fld,
                reason,
            )
            self._models[model] = _ModelState(None)
            return model
        self._timings.create = time.perf_counter() - t0
        logger.info(
            "marlin-pack: %d quantized layers use %s (linear_backend_per_quant mixed_precision=marlin set by "
            "the %s loader)%s",
            len(layers) - len(experts),
            KERNEL_NAME,
            LOAD_FORMAT,
            f"; {len(experts)} experts layers use Marlin MoE (moe_backend={vllm_config.kernel_config.moe_backend})"
            if experts else "",
        )
        self._models[model] = _ModelState(bundle, layers, helpers, fill)
        return model

    def _start_fill(self, bundle: SelectedBundle, helpers: HelperPool | None) -> _ArenaFill | None:
        """Allocate the arena and start copying the rank file into it, before vLLM builds the model.

        Only for bundles without experts layers: vLLM's Marlin MoE methods keep their device
        placeholders (not stubbed), so their arena would sit beside them. The arena goes to the
        default device, which vLLM sets around ``create_model`` (the engine's and the daemon's).
        """
        if not self.options.copy_during_build or bundle.tp_set.moe_layers:
            return None
        layout = ArenaLayout.of(bundle)
        if not layout.slots:
            return None
        t0 = time.perf_counter()
        arena = layout.allocate()
        during = self._in_daemon_by_default(self.options.common_during_build, helpers=helpers is not None)
        common = CommonPrefill.allocate(bundle, _LARGE_COMMON) if during else None
        self._timings.arena = time.perf_counter() - t0
        built = threading.Event() if self.options.io_own_share == "after_build" else None
        # common_io staged: the common tensors get a reader of their own in this process, through pinned buffers
        # (no page-locking here beside the construction), while the rank file's reader copies the rank file.
        common_copy = None
        if common is not None and self.options.common_io == "staged":
            common_copy = BackgroundCopy(
                lambda: ParallelReader(_COMMON_STAGED_THREADS, _COMMON_STAGED_CHUNK, "staged"),
                bundle.common_file, common.copy_items(), name="marlin-pack-common-copy",
            )
        copy = BackgroundCopy(
            lambda: self._reader(helpers, own_after=built),
            bundle.rank_file,
            layout.copy_items(arena),
            # The helpers exit as soon as their share is copied: their CUDA contexts go while loading goes on
            # (unless they copy the common tensors next: then once those are copied).
            on_done=None if helpers is None or self.options.io_common_by_helpers else (lambda: helpers.close(wait=False)),
            gate=built,
            then=[] if common is None or common_copy is not None else [(bundle.common_file, common.copy_items())],
        )
        return _ArenaFill(layout, arena, copy, common, common_copy)

    def _reader(
        self, helpers: HelperPool | None, mode: str | None = None, own_after: threading.Event | None = None
    ) -> ParallelReader:
        return ParallelReader(
            self.options.io_threads,
            None if self.options.chunk_mb is None else self.options.chunk_mb << 20,
            mode or self.options.io_mode,  # type: ignore[arg-type]
            helpers=helpers,
            processes=self.options.io_processes,
            own_share=self.options.io_own_share != "none",
            own_after=own_after,
        )

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Place the rank file's tensors and mark the layers; load the common tensors via vLLM."""
        state = self._models.get(model)
        if state is None:
            raise RuntimeError(
                f"the {LOAD_FORMAT} loader can only load weights into a model built by its own create_model"
            )
        if state.bundle is None:
            self._default_loader().load_weights(model, model_config)
            return
        helpers, state.helpers = state.helpers, None
        try:
            self._load_bundle(state, state.bundle, model, helpers)
        finally:
            if helpers is not None:
                helpers.close(wait=False)
                if exits_in_background():  # a weight-cache daemon: nothing is measured after its fill
                    logger.info("marlin-pack: the copy helpers exit in the background (weight-cache daemon)")
                else:  # their CUDA contexts must be gone before vLLM measures the GPU memory left for the KV cache
                    t0 = time.perf_counter()  # (a service's stay, counted before and after alike: they only unmap our memory)
                    helpers.join()
                    logger.info(
                        "marlin-pack: waited %.2f s for the copy helpers to %s", time.perf_counter() - t0,
                        "let go of this process's memory" if helpers.source == "service" else "exit",
                    )

    def _load_bundle(self, state: _ModelState, bundle: SelectedBundle, model: nn.Module, helpers: HelperPool | None) -> None:
        fill, state.fill = state.fill, None
        # With the rank file copying beside, the common tensors are read here without the helpers (which it
        # uses), or given to the helpers as their next job (io_common_by_helpers: one copy at a time, in turn).
        by_helpers = fill is not None and helpers is not None and self.options.io_common_by_helpers
        if by_helpers:
            common_helpers, common_mode = helpers, "processes"
        else:
            common_helpers = None if fill is not None else helpers
            common_mode = "registered" if fill is not None and self.options.io_mode == "processes" else None
        try:
            with self._reader(common_helpers, common_mode) as reader:
                t0 = time.perf_counter()
                layout = fill.layout if fill is not None else ArenaLayout.of(bundle)
                params = layout.parameters(state.layers)
                release(params)  # placeholders vLLM made with memory (stubs have none), before the arena is allocated
                if fill is None:
                    arena = layout.allocate(params[0].device) if params else torch.empty(0, dtype=torch.uint8)
                    layout.bind(params, arena)
                    tc = time.perf_counter()
                    self._timings.copy_bytes = reader.copy(bundle.rank_file, layout.copy_items(arena))
                    self._timings.copy = time.perf_counter() - tc
                    self._timings.modes = "/".join(sorted(reader.modes_used)) or "-"
                    if helpers is not None:
                        helpers.close(wait=False)  # they exit while the common tensors load (which this process reads)
                else:
                    layout.bind(params, fill.arena)
                prefilled: set[str] = set()
                if fill is not None and fill.common is not None:
                    prefilled = self._bind_common(fill.common, bundle, model, state)
                    self._timings.common_beside = len(prefilled)
                for layer in state.layers.values():
                    # Placeholders the bundle does not replace stay stubs: finishing sets them (GPTQ's qzeros
                    # become int32[0]) and gives memory to any it keeps (70B GPTQ: 267 MB in 320 tensors no
                    # longer allocated and filled only to be dropped).
                    mark_prepacked(layer)
                t1 = time.perf_counter()
                device = next(next(iter(state.layers.values())).parameters()).device
                with HostMap(bundle.common_file) as host:
                    model.load_weights(self._common_weights(reader, host, bundle, model, device, skip=prefilled))
                t2 = time.perf_counter()
        finally:
            if fill is not None:
                waited = fill.join()  # also when loading failed: the copies write into the arena and the common tensors
                if fill.common_copy is not None:
                    self._timings.common_copy = fill.common_copy.seconds
                self._timings.copy, self._timings.copy_bytes = fill.copy.seconds, fill.copy.bytes
                self._timings.beside, self._timings.wait = True, waited
                self._timings.modes = "/".join(sorted(fill.copy.modes_used)) or "-"
                fill.common = None  # the copies no parameter was pointed at go
            if helpers is not None:
                self._timings.helpers_ready, self._timings.helpers_source = helpers.ready_after, helpers.source
                self._timings.helpers_retained = helpers.retained_bytes
        self._timings.place = t1 - t0 - (0.0 if fill is not None else self._timings.copy)
        self._timings.common = t2 - t1
        # Also the daemon's path (it calls create_model/load_weights, not load_model): say which file.
        logger.info(
            "marlin-pack: placed %d tensors from %s for tp %d rank %d: %s, %s, io_mode %s, %s",
            len(params),
            bundle.rank_file,
            bundle.tp_set.tp_size,
            bundle.rank,
            self._timings.create_text(),
            self._timings.copy_text(),
            self._timings.modes,
            self._timings.common_text(),
        )

    @staticmethod
    def _bind_common(common: CommonPrefill, bundle: SelectedBundle, model: nn.Module, state: _ModelState) -> set[str]:
        """Point the parameters of the common tensors copied beside the construction at their copies; give
        memory to the other stubs outside the quantized layers (vLLM's loaders write into them). Returns
        the checkpoint names so loaded."""
        aliases = alias_names(bundle)
        names = [n for name in bundle.common_header.tensors for n in (name, *aliases.get(name, ()))]
        done = common.bind(dict(model.named_parameters(remove_duplicate=False)), names)
        quantized = {id(m) for m in state.layers.values()}  # their stubs are left to finishing
        left = sum(materialize_stubs(m) for m in model.modules() if id(m) not in quantized)
        logger.debug("marlin-pack: %d common names copied beside the construction, %d stubs given memory", len(done), left)
        return done

    @staticmethod
    def _common_weights(
        reader: ParallelReader, host: HostMap, bundle: SelectedBundle, model: nn.Module, device: torch.device,
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``common.safetensors`` in file order, for the model's ``load_weights``.

        Large tensors (embeddings, output head) at TP=1 are read straight into their
        parameters by ``reader`` when a plain copy is all vLLM's weight loader would do
        (:func:`_direct_target`), and not yielded; other large tensors are staged on the GPU
        at TP=1. Everything else is yielded as CPU views of the file map for vLLM's weight
        loaders to narrow (TP shards) and copy. The direct copies run first, as one batch. A tensor stored once for several checkpoint
        names (``common_aliases``) goes to each of them, as the checkpoint's loader would. Names in ``skip``
        are loaded already (:meth:`_bind_common`).
        """
        copies = alias_names(bundle)
        # (name, info, the checkpoint names it still loads) in file order; a tensor all of whose names are loaded is left out.
        ordered = [
            (name, info, names)
            for name, info in sorted(bundle.common_header.tensors.items(), key=lambda kv: kv[1].start)
            if (names := [n for n in (name, *copies.get(name, ())) if n not in skip])
        ]
        whole = device.type == "cuda" and bundle.tp_set.tp_size == 1  # each rank uses whole tensors
        params = dict(model.named_parameters(remove_duplicate=False)) if whole else {}

        def direct_targets(names: list[str], info: TensorInfo) -> dict[int, nn.Parameter] | None:
            """The parameters (by address) a large tensor is copied straight into, or None."""
            if not whole or info.nbytes < _LARGE_COMMON:
                return None
            targets = [_direct_target(params.get(n), info.shape, info.torch_dtype) for n in names]
            if any(t is None for t in targets):
                return None
            return {t.data_ptr(): t for t in targets}  # type: ignore[union-attr]  # a tied head is the embedding itself

        # The direct copies go first, in one batch: the reader's threads then share all their windows (one
        # tensor at a time, a 2 GB embedding's 8 windows of 256 MiB kept half of 16 threads idle).
        batch: list[CopyItem] = []
        done: set[str] = set()
        filled: set[int] = set()  # a later tensor into a destination already in the batch waits (file order)
        for name, info, names in ordered:
            targets = direct_targets(names, info)
            if targets is not None and filled.isdisjoint(targets):
                batch += [CopyItem(info.start, info.nbytes, t.data) for t in targets.values()]
                filled |= targets.keys()
                done.add(name)
        if batch:
            reader.copy(bundle.common_file, batch)
        for name, info, names in ordered:
            if name in done:
                continue
            targets = direct_targets(names, info)
            if targets is not None:
                reader.copy(bundle.common_file, [CopyItem(info.start, info.nbytes, t.data) for t in targets.values()])
                continue
            if whole and info.nbytes >= _LARGE_COMMON:
                t = torch.empty(info.shape, dtype=info.torch_dtype, device=device)
                reader.copy(bundle.common_file, [CopyItem(info.start, info.nbytes, t)])
            else:
                t = host.tensor(info.start, info.nbytes, info.torch_dtype, info.shape)
            for n in names:
                yield n, t

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """The engine path: create, place, vLLM post-processing (no-op for prepacked layers), timings."""
        if self._is_draft(vllm_config, model_config) or self._decide(vllm_config, model_config).fallback:
            return self._default_loader().load_model(
                vllm_config=vllm_config, model_config=model_config, prefix=prefix
            )
        load_device = (
            vllm_config.device_config.device if self.load_config.device is None else self.load_config.device
        )
        target_device = torch.device(load_device)
        freeze_gc_heap()  # no gc.collect() here: see freeze_gc_heap
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = self.create_model(vllm_config, model_config, prefix)
            self.load_weights(model, model_config)
            t0 = time.perf_counter()
            process_weights_after_loading(model, model_config, target_device)
            self._timings.post = time.perf_counter() - t0
            state = self._models[model]
            left = [name for name, layer in state.layers.items() if is_prepacked(layer)]
            if left:
                raise RuntimeError(
                    f"marlin-pack: vLLM's post-processing did not run the patched method for {len(left)} "
                    f"prepacked layers (e.g. {left[0]}); their tensors may be corrupt"
                )
            torch.accelerator.empty_cache()  # placeholders replaced by bundle tensors of another size
        if state.bundle is not None:
            logger.info(self._timings.line(state.bundle, len(state.layers)))
        return model.eval()


def _direct_target(param: nn.Parameter | None, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter | None:
    """``param`` when copying a checkpoint tensor of ``shape``/``dtype`` into its memory is exactly what
    its vLLM weight loader would do at TP=1 (:func:`~.common_prefill.plain_copy_target`, contiguous), else None."""
    target = plain_copy_target(param, shape, dtype)
    return target if target is not None and target.data.is_contiguous() else None
