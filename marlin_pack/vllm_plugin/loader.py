"""``MarlinPrepackedLoader``: the vLLM model loader for ``--load-format marlin_prepacked``.

Three steps, usable separately (the weight-cache daemon calls the first two itself):

``create_model``
    Validates the bundle against the engine (cheap, before any GPU allocation), then
    builds the model with the kernels the bundle's layouts are for, and checks each quantized
    layer's kernel and configuration against the manifest. A bundle converted for SM90 (with
    Machete layers) keeps vLLM's own per-layer choice: ``MacheteLinearKernel`` where it implements
    the layer, ``MarlinLinearKernel`` elsewhere (off SM90 such a bundle is refused before this).
    A Marlin bundle sets ``linear_backend_per_quant["mixed_precision"] = "marlin"`` on the engine's
    ``KernelConfig`` so every AWQ/GPTQ/compressed-tensors layer gets ``MarlinLinearKernel``, on SM90
    too, where one WARNING names what vLLM's default would have run on Machete. That override stays
    set: the engine does run Marlin, and vLLM's compile-cache hashes must not collide with a Machete
    run. Experts layers get the Marlin MoE backend.
``load_weights``
    Replaces each quantized layer's placeholder tensors with the rank file's tensors
    (new device tensors bound to the same Parameter objects), marks the
    layers prepacked (see :mod:`.patches.post_processing`), and feeds ``common.safetensors`` through
    the model's own ``load_weights`` (sharding, stacking, tied embeddings).
``load_model``
    The engine path: both steps, vLLM's ``process_weights_after_loading`` (for the marked
    layers only ``engine.finish_layer``: Marlin's or Machete's finish), timings in one INFO line.

With ``{"fallback": true}`` a bundle that does not fit is reported with a warning and the
checkpoint is loaded by vLLM's ``DefaultModelLoader``; without it the load stops with a
:class:`~marlin_pack.errors.LoadRefusedError` naming the field. Fallback covers every failure before
the GPU work begins (the decision, the kernel settings), whatever its type: one that is no refusal
(a bug) is warned about as an internal error. From the I/O plan on (copy helpers, the arena, the
model's construction) an error propagates, except the layer checks' refusals.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import Counter
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
from marlin_pack.bundle.integrity import settle_pending
from marlin_pack.errors import BundleError, MismatchField
from marlin_pack.gpu.helpers import HelperPool, exits_in_background
from marlin_pack.gpu.host_map import HostMap
from marlin_pack.gpu.plan import IoPlan
from marlin_pack.gpu.reader import ParallelReader
from marlin_pack.vllm_plugin import common_tensors, decide_ahead, patches, preload
from marlin_pack.vllm_plugin.arena import ArenaLayout, BackgroundCopy, release
from marlin_pack.vllm_plugin.common_tensors import CommonPrefill, alias_names, common_weights
from marlin_pack.vllm_plugin.decision import (
    Decision,
    EngineFacts,
    SelectedBundle,
    hopper_machete_layers,
    internal_error,
    loaded_zero_word,
    refusal,
)
from marlin_pack.vllm_plugin.engine import (
    built_parameters,
    engine_facts,
    force_marlin,
    freeze_gc_heap,
    keep_loaded_zero_points,
    layer_facts,
    quantized_layers,
)
from marlin_pack.vllm_plugin.io_facts import plan_for
from marlin_pack.vllm_plugin.layer_check import check_layers, check_moe_layers
from marlin_pack.vllm_plugin.load_timings import LoadTimings
from marlin_pack.vllm_plugin.moe_engine import force_marlin_moe, is_moe_layer, moe_layer_facts
from marlin_pack.vllm_plugin.options import parse_extra_config
from marlin_pack.vllm_plugin.patches.placeholders import stub_quantized_placeholders
from marlin_pack.vllm_plugin.patches.post_processing import is_patched, is_prepacked, mark_prepacked
from marlin_pack.vllm_plugin.remote_load import IO_PLAN, RemoteSelected, copy_rank, decide_bundle
from marlin_pack.vllm_plugin.stage import check_nothing_left_out, stage_text
from marlin_pack.vllm_plugin.stubs import materialize_stubs

__all__ = ["MarlinPrepackedLoader"]


# A child of "vllm" so vLLM's logging configuration (handler, level, format) applies.
logger = init_logger("vllm.marlin_pack")


@dataclass
class _ArenaFill:
    """The arena and its copy: allocated before vLLM builds the model and copied beside the construction (``beside``),
    or, where no copy ran beside it and digests are left to the copy (experts layers, a stage without layers), allocated
    after it in place of the placeholders it replaces (``released``) and copied before anything is bound."""

    layout: ArenaLayout
    arena: torch.Tensor
    copy: BackgroundCopy
    common: CommonPrefill | None = None  # plan.common_during_build: the large common tensors, copied after the rank file
    beside: bool = True  # copied beside the construction (else after it, waited for with the digests)
    # The placeholders vLLM made that were released for the arena (not beside): each parameter, its shape and dtype
    released: tuple[tuple[nn.Parameter, torch.Size, torch.dtype], ...] = ()

    def abandon(self) -> None:
        """Wait for the copy and drop its outcome (loading is failing or falling back); the arena goes, and placeholders
        released for it get memory again, of their shape and dtype (zeros), for vLLM's weight loaders to write into."""
        self.copy.abandon()  # its thread writes into the arena (and uses the helpers) until it ends
        self.arena = self.arena.new_empty(0)  # (before the placeholders: their memory is the arena's)
        for param, shape, dtype in self.released:
            param.data = torch.zeros(shape, dtype=dtype, device=param.device)
        self.released = ()

    def join(self) -> float:
        """Wait for the copy; returns the seconds waited. Raises what the copy raised."""
        return self.copy.join()


@dataclass
class _ModelState:
    bundle: SelectedBundle | None  # None: loaded the ordinary way
    layers: dict[str, nn.Module] = field(default_factory=dict)
    plan: IoPlan = field(default_factory=IoPlan)
    helpers: HelperPool | None = None  # a helpers plan: started before vLLM builds the model, ended after the copies
    borrowed: bool = False  # the helpers are the early ones of preload (which ends them), not the loader's
    fill: _ArenaFill | None = None  # the rank file already being copied (dense bundles)
    common_host: HostMap | None = None  # common.safetensors read whole and hashed (its digest left to the copy)
    layout: ArenaLayout | None = None  # where each bundle tensor goes, its parameters checked when the model was built


def _warn_marlin_on_hopper(bundle: SelectedBundle, facts: EngineFacts) -> None:
    """One WARNING where a Marlin bundle runs on SM90, on which vLLM's default would serve some layers with Machete."""
    n = hopper_machete_layers(bundle.manifest, bundle.tp_set, facts)
    if n:
        logger.warning(
            "marlin-pack: the bundle %s holds Marlin's layout; on this SM90 GPU vLLM's default serves %d of its %d "
            "quantized layers with Machete, which prefilled 1.76x faster in our measurement (70B AWQ). The start stays "
            "fast; to keep vLLM's kernel too, re-convert with `marlin-pack convert %s --compute-capability 9.0`",
            bundle.bundle_dir, n, len(bundle.tp_set.layers), facts.model,
        )


class MarlinPrepackedLoader(BaseModelLoader):
    """Serve an AWQ/GPTQ checkpoint from its marlin-pack bundle (no repack at start).

    Extra config (``--model-loader-extra-config``): ``bundle``, ``fallback``, ``verify``, ``preload``;
    see :class:`~marlin_pack.vllm_plugin.options.LoaderOptions`. How the bytes reach the GPU is the
    :class:`~marlin_pack.gpu.plan.IoPlan`'s (made once, :mod:`.io_facts`).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        # Cheap and side-effect free: vLLM also instantiates loaders at worker init.
        self.options = parse_extra_config(load_config.model_loader_extra_config, str(load_config.load_format))
        self._decisions: dict[tuple[object, ...], Decision] = {}
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        self._timings = LoadTimings()

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
        try:
            facts = engine_facts(vllm_config, model_config)
        except Exception as e:  # vLLM's configuration not as this marlin-pack reads it: before any GPU work
            return self._internal_fallback(("engine facts",), str(model_config.model), e)
        key = (facts.model, facts.tp_size, facts.tp_rank, facts.pp_size, facts.pp_rank, facts.dtype)
        if key not in self._decisions:
            t0 = time.perf_counter()
            try:
                ahead = decide_ahead.take(self.options, facts)
                decision = ahead[0] if ahead is not None else decide_bundle(self.options, facts)  # (falls back itself)
            except Exception as e:
                return self._internal_fallback(key, facts.model, e)
            self._timings.validate = time.perf_counter() - t0
            self._timings.validate_ahead = ahead[1] if ahead is not None else None
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

    def _internal_fallback(self, key: tuple[object, ...], model: str, error: Exception) -> Decision:
        """An exception before any GPU work that is no refusal (a bug of marlin-pack's, or vLLM internals not as
        expected): with ``fallback`` on, the checkpoint loads the ordinary way, with one WARNING naming it as an
        internal error (the traceback at DEBUG); without, it propagates."""
        if not self.options.fallback:
            raise error
        if key not in self._decisions:
            reason = internal_error(error)
            logger.warning(
                "marlin-pack: not using the bundle for %s ([%s] %s); loading the checkpoint the ordinary way because "
                "fallback is on", model, MismatchField.bundle, reason,
            )
            logger.debug("marlin-pack: the internal error's traceback", exc_info=error)
            self._decisions[key] = Decision(None, MismatchField.bundle, reason)
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
        """Build the model with the kernels the bundle's layouts are for (Marlin forced for a Marlin bundle) and check its
        layers."""
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
        try:  # still before any GPU work: fallback covers a failure here too
            if not bundle.manifest.has_machete_layers:  # a Marlin bundle: Marlin for every layer (on SM90 too, warned)
                _warn_marlin_on_hopper(bundle, engine_facts(vllm_config, model_config))  # as configured, before forcing
                force_marlin(vllm_config.kernel_config)
            if bundle.tp_set.moe_layers:  # experts: Marlin MoE for --moe-backend auto (an explicit other one is refused below)
                force_marlin_moe(vllm_config.kernel_config)
        except Exception as e:
            if not self.options.fallback:
                raise
            logger.warning(
                "marlin-pack: not using the bundle %s ([%s] %s); loading the checkpoint the ordinary way because fallback is on",
                bundle.bundle_dir, MismatchField.bundle, internal_error(e),
            )
            logger.debug("marlin-pack: the internal error's traceback", exc_info=e)
            model = super().create_model(vllm_config, model_config, prefix)  # (Marlin may stay forced, as below)
            self._models[model] = _ModelState(None)
            return model
        plan, helpers, borrowed = self._plan_and_helpers(vllm_config, model_config, bundle)
        try:
            model = self._create_checked(vllm_config, model_config, prefix, bundle, t0, plan, helpers, borrowed)
        except BaseException:
            self._end_helpers(helpers, borrowed)
            raise
        if self._models[model].helpers is None:
            self._end_helpers(helpers, borrowed)  # fell back to the ordinary way
        return model

    def _plan_and_helpers(
        self, vllm_config: VllmConfig, model_config: ModelConfig, bundle: SelectedBundle
    ) -> tuple[IoPlan, HelperPool | None, bool]:
        """The I/O plan, and for a helpers plan the pool: the early helpers of :mod:`.preload` (borrowed: they may be
        page-locking the bundle still) or the loader's own, started now so that they get their CUDA contexts
        while vLLM builds the model."""
        if isinstance(bundle, RemoteSelected):  # streamed from a bucket: nothing to page-lock or map
            return IO_PLAN, None, False
        taken = preload.take_pool(bundle.rank_file)
        if taken is not None:
            pool, plan = taken
            logger.info("marlin-pack: I/O plan %s: %s", plan.mode, plan.why)
            return plan, pool, True
        on_gpu = torch.cuda.is_available()
        plan = plan_for(
            vllm_config, model_config, (bundle.rank_file, bundle.common_file), experts=bool(bundle.tp_set.moe_layers),
            role="daemon" if exits_in_background() else "engine", preload=False,
            device=torch.cuda.current_device() if on_gpu else 0, gpu=on_gpu,
        )
        logger.info("marlin-pack: I/O plan %s: %s", plan.mode, plan.why)
        if plan.mode != "helpers" or not on_gpu:
            return plan, None, False
        return plan, HelperPool(plan.helpers, torch.cuda.current_device(), defer_unregister=plan.defer_unregister), False

    @staticmethod
    def _end_helpers(helpers: HelperPool | None, borrowed: bool) -> None:
        """Helpers no copy will use: the loader's own end; preload's end with preload (an engine's after vLLM's
        second memory measurement)."""
        if helpers is None:
            return
        if not borrowed:
            helpers.close()
        elif exits_in_background():
            preload.stop()
        else:
            helpers.let_go()

    def _create_checked(
        self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, bundle: SelectedBundle, t0: float,
        plan: IoPlan, helpers: HelperPool | None, borrowed: bool,
    ) -> nn.Module:
        fill = self._start_fill(bundle, plan, helpers, borrowed)
        try:
            with stub_quantized_placeholders(fill is not None, embeddings=fill is not None and fill.common is not None):
                model = super().create_model(vllm_config, model_config, prefix)
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
            check_moe_layers(bundle.manifest, bundle.tp_set, moe_facts, None if bundle.experts is None else bundle.experts.num_experts)
            if bundle.stage is not None:  # a pipeline stage: nothing vLLM built there is left unloaded
                check_nothing_left_out(bundle.stage, built_parameters(model, bundle.stage.left_out))
            # Every parameter the arena replaces exists with its slot's dtype: checked here, where a mismatch is the
            # layer check's refusal (or its fallback), not once the copy is placed
            layout = fill.layout if fill is not None else ArenaLayout.of(bundle)
            layout.parameters(layers)
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
        moe_text = (f"; {len(experts)} experts layers use Marlin MoE (moe_backend={vllm_config.kernel_config.moe_backend})"
                    if experts else "")
        if bundle.manifest.has_machete_layers:
            kernels = Counter(f.kernel for f in facts.values())
            logger.info(
                "marlin-pack: quantized layers use vLLM's own choice, as the bundle holds: %s%s",
                ", ".join(f"{n} {k}" for k, n in sorted(kernels.items())), moe_text,
            )
        else:
            logger.info(
                "marlin-pack: %d quantized layers use %s (linear_backend_per_quant mixed_precision=marlin set by "
                "the %s loader)%s",
                len(layers) - len(experts), KERNEL_NAME, LOAD_FORMAT, moe_text,
            )
        self._models[model] = _ModelState(bundle, layers, plan, helpers, borrowed, fill, layout=layout)
        return model

    def _start_fill(self, bundle: SelectedBundle, plan: IoPlan, helpers: HelperPool | None, borrowed: bool) -> _ArenaFill | None:
        """Allocate the arena and start copying the rank file into it, before vLLM builds the model (``plan.during_build``).

        Not for bundles with experts layers (the plan says so): vLLM's Marlin MoE methods keep their device
        placeholders (not stubbed), so their arena would sit beside them. The arena goes to the default
        device, which vLLM sets around ``create_model`` (the engine's and the daemon's).
        """
        if not plan.during_build:
            return None
        layout = ArenaLayout.of(bundle)
        if not layout.slots:
            return None
        t0 = time.perf_counter()
        arena = layout.allocate()
        # (not a common file whose digest is left to the copy: read whole once and hashed, its tensors come from there)
        common_pending = any(p.path == bundle.common_file for p in bundle.hashed.pending)
        common = CommonPrefill.allocate(bundle, common_tensors.LARGE_COMMON) if plan.common_during_build and not common_pending else None
        self._timings.arena = time.perf_counter() - t0
        copy = BackgroundCopy(
            lambda: ParallelReader(plan, helpers),
            bundle.rank_file,
            layout.copy_items(arena),
            # The loader's own helpers exit as soon as the rank file (and any common tensors after it) is copied:
            # their CUDA contexts go while loading goes on.
            on_done=None if helpers is None or borrowed else (lambda: helpers.close(wait=False)),
            then=[] if common is None else [(bundle.common_file, common.copy_items())],
            hashed=[p.path for p in bundle.hashed.pending if p.path == bundle.rank_file],  # read once for both
        )
        return _ArenaFill(layout, arena, copy, common)

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
            if state.bundle.hashed.pending and not self._settle_copy(state, state.bundle, model, model_config, helpers):
                return  # loaded the ordinary way (fallback)
            self._load_bundle(state, state.bundle, model, helpers)
        finally:
            if helpers is not None:
                t0 = time.perf_counter()
                if exits_in_background():  # a weight-cache daemon: nothing is measured after its fill
                    if state.borrowed:
                        preload.stop()
                    else:
                        helpers.close(wait=False)
                    logger.info("marlin-pack: the copy helpers exit in the background (weight-cache daemon)")
                elif state.borrowed:  # preload's: counted in vLLM's memory before and after alike; the copy is done,
                    # so they let go of our memory and the pages beside vLLM's next steps (preload.stop joins them):
                    # 70B 0.80 s against 0.98 s waited for, the KV cache the same (docs/performance.md)
                    helpers.let_go(wait=False)
                    logger.info("marlin-pack: the copy helpers let go of this process's memory and the pages in the background")
                else:  # the loader's own: vLLM measures the GPU memory left for the KV cache next, their CUDA contexts
                    # must be gone first
                    helpers.close(wait=False)
                    helpers.join()
                    logger.info("marlin-pack: waited %.2f s for the copy helpers to exit", time.perf_counter() - t0)

    def _settle_copy(
        self, state: _ModelState, bundle: SelectedBundle, model: nn.Module, model_config: ModelConfig,
        helpers: HelperPool | None = None,
    ) -> bool:
        """The digests the decision left to the copy (cold files, no stamp of this user, or ``verify: full``), compared
        and stamped before any tensor is bound or served: ``common.safetensors`` read whole once (hashed) while the copy
        goes on, then that copy's digests. The copy is the one beside the construction, or (experts layers, whose
        placeholders vLLM keeps until now; a stage or share with nothing to copy beside it) the one started here
        (:meth:`_fill_after_build`); it reads every file whose digest is left to it whole, the bytes it does not copy
        only into the hash. A mismatch, a file that changed or was cut short while it was copied: the decision's
        one-line refusal, or with ``fallback`` the checkpoint loaded the ordinary way into the model vLLM built (as
        after a layer check's refusal). Returns whether the bundle is still used."""
        pending, found = bundle.hashed.pending, {}
        paths = {str(p.path) for p in pending}
        t0 = time.perf_counter()
        if state.fill is None and not isinstance(bundle, RemoteSelected):  # (its parameters checked at the build)
            state.fill = self._fill_after_build(state, bundle, helpers)
        try:
            if str(bundle.common_file) in paths:
                with ParallelReader(state.plan.local()) as reader:
                    state.common_host = reader.read_whole(bundle.common_file)
                    found.update(reader.digests)
            if state.fill is not None:
                state.fill.join()  # raises what the copy raised (a file cut short)
                found.update(state.fill.copy.digests)
            self._timings.settle = time.perf_counter() - t0
            report = settle_pending(pending, found, self._timings.settle, bundle.hashed.every_time)
        except BundleError as e:
            state.common_host = None
            if state.fill is not None:
                state.fill.abandon()  # the arena goes before the checkpoint loads; released placeholders get memory
                state.fill = None
                for module in model.modules():  # vLLM's weight loaders will write into the placeholders
                    materialize_stubs(module)
            if not self.options.fallback:
                raise refusal(MismatchField.files, str(e), str(model_config.model), bundle.bundle_dir) from e
            logger.warning(
                "marlin-pack: not using the bundle %s ([%s] %s); loading the checkpoint the ordinary way because "
                "fallback is on", bundle.bundle_dir, MismatchField.files, e,
            )
            state.bundle = None
            self._default_loader().load_weights(model, model_config)
            return False
        if (summary := report.summary()) is not None:
            logger.warning("marlin-pack: rank %d %s, as it was copied", bundle.rank, summary)
        return True

    def _fill_after_build(self, state: _ModelState, bundle: SelectedBundle, helpers: HelperPool | None) -> _ArenaFill:
        """The arena and its copy after vLLM built the model, for digests left to the copy where none ran beside the
        construction: the placeholders the arena replaces released first (as :meth:`_load_bundle` releases them; kept
        in ``released`` to be given memory again should the digests refuse the bundle), the arena allocated, and every
        file the layout reads (the rank file, an expert share's file) copied on a thread, each file whose digest is left
        to the copy read whole and hashed, also one the layout reads nothing of (a stage without layers)."""
        layout = state.layout or ArenaLayout.of(bundle)
        params = layout.parameters(state.layers)
        released = tuple((p, p.shape, p.dtype) for p in params)
        release(params)
        arena = layout.allocate(params[0].device) if params else torch.empty(0, dtype=torch.uint8)
        jobs = layout.copy_jobs(arena, bundle.rank_file)
        hashed = [p.path for p in bundle.hashed.pending if p.path != bundle.common_file]
        jobs += [(path, []) for path in hashed if path not in {j[0] for j in jobs}]
        (path, items), *then = jobs or [(bundle.rank_file, [])]
        copy = BackgroundCopy(
            lambda: ParallelReader(state.plan, helpers), path, items,
            on_done=None if helpers is None or state.borrowed else (lambda: helpers.close(wait=False)),
            then=then, hashed=hashed,
        )
        return _ArenaFill(layout, arena, copy, beside=False, released=released)

    def _load_bundle(self, state: _ModelState, bundle: SelectedBundle, model: nn.Module, helpers: HelperPool | None) -> None:
        fill, state.fill = state.fill, None
        held, state.common_host = state.common_host, None  # (the model's state outlives loading: its memory must not)
        # With the rank file copying beside, this process reads the common tensors itself (the helpers copy the
        # rank file); without, the rank file and then the common tensors go the plan's way.
        plan = state.plan.local() if fill is not None else state.plan
        try:
            with ParallelReader(plan, None if fill is not None else helpers) as reader:
                if held is not None:
                    reader.hold(held)  # read once already (hashed): its tensors come from there
                t0 = time.perf_counter()
                layout = fill.layout if fill is not None else state.layout or ArenaLayout.of(bundle)
                params = layout.parameters(state.layers)
                release(params)  # placeholders vLLM made with memory (stubs have none), before the arena is allocated
                if fill is None:
                    arena = layout.allocate(params[0].device) if params else torch.empty(0, dtype=torch.uint8)
                    layout.bind(params, arena)
                    tc = time.perf_counter()
                    if isinstance(bundle, RemoteSelected):  # the common file's image is held by the reader from now on
                        self._timings.copy_bytes, held = copy_rank(bundle, layout.copy_items(arena), reader)
                    else:
                        self._timings.copy_bytes = reader.copy_files(layout.copy_jobs(arena, bundle.rank_file))
                    self._timings.copy = time.perf_counter() - tc
                    self._timings.modes = "/".join(sorted(reader.modes_used)) or "-"
                    if helpers is not None and not state.borrowed:
                        helpers.close(wait=False)  # they exit while the common tensors load (which this process reads)
                else:
                    layout.bind(params, fill.arena)
                prefilled: set[str] = set()
                if fill is not None and fill.common is not None:
                    prefilled = self._bind_common(fill.common, bundle, model, state)
                    self._timings.common_beside = len(prefilled)
                zero_word = loaded_zero_word(bundle.manifest)
                for layer in state.layers.values():
                    # Placeholders the bundle does not replace stay stubs: finishing sets them (GPTQ's qzeros
                    # become int32[0] up to vLLM 0.33) and gives memory to any it keeps (70B GPTQ: 267 MB in 320
                    # tensors no longer allocated and filled only to be dropped). A release that keeps the loaded
                    # unused zero points (0.34: retired) gets the checkpoint's, as its own loading leaves them.
                    keep_loaded_zero_points(layer, zero_word)
                    mark_prepacked(layer)
                t1 = time.perf_counter()
                # (a pipeline stage may have no decoder layer: then the model's first parameter says it)
                device = next(next(iter(state.layers.values())).parameters() if state.layers else model.parameters()).device
                with held or HostMap(bundle.common_file) as host:
                    model.load_weights(common_weights(reader, host, bundle, model, device, skip=prefilled))
                t2 = time.perf_counter()
        finally:
            if fill is not None:
                waited = fill.join()  # also when loading failed: the copy writes into the arena and the common tensors
                self._timings.copy, self._timings.copy_bytes = fill.copy.seconds, fill.copy.bytes
                self._timings.beside, self._timings.wait = fill.beside, waited
                self._timings.modes = "/".join(sorted(fill.copy.modes_used)) or "-"
                fill.common = None  # the copies no parameter was pointed at go
            self._timings.in_settle = fill is not None and not fill.beside
            if helpers is not None:
                self._timings.helpers_ready, self._timings.helpers_retained = helpers.ready_after, helpers.retained_bytes
        self._timings.place = t1 - t0 - (0.0 if fill is not None else self._timings.copy)
        self._timings.common = t2 - t1
        # Also the daemon's path (it calls create_model/load_weights, not load_model): say which file.
        logger.info(
            "marlin-pack: placed %d tensors from %s for tp %d rank %d%s: %s, %s, io %s, %s",
            len(params),
            bundle.rank_file,
            bundle.tp_set.tp_size,
            bundle.rank,
            stage_text(bundle),
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

