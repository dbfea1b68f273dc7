"""Start the loader's copy helpers while vLLM's worker builds its model runner.

vLLM 0.33.0's ``Worker.init_device`` takes its GPU memory snapshot (what the KV cache is later sized
from), then builds the workspace and the model runner; ``load_model`` follows. The copy helpers of
a ``marlin_prepacked`` load that copies with them (``io_mode`` ``processes``, or ``auto`` where they
help) each need a CUDA context first, ~0.25 s for four, which the copy otherwise waits for inside
"Model loading took". Started here, after the snapshot, their contexts come up beside vLLM's own
set-up, and the loader takes them (:mod:`~marlin_pack.vllm_plugin.helper_policy`).

Only for ``--load-format marlin_prepacked`` with ``io_early_helpers`` on (the default); every
other engine keeps vLLM's behaviour. The weight-cache daemon builds no worker: its fill starts its
helpers as it builds the model.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from marlin_pack._constants import LOAD_FORMAT
from marlin_pack.vllm_plugin.patches.registry import Patch

__all__ = ["PATCHES"]

logger = logging.getLogger("vllm.marlin_pack")


def _init_workspace_and_model_runner(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init_workspace_and_model_runner(self: Any, *args: Any, **kwargs: Any) -> Any:
        ours = started = False
        try:
            vllm_config = self.vllm_config
            ours = str(getattr(vllm_config.load_config, "load_format", "")) == LOAD_FORMAT
            if ours:
                from marlin_pack.vllm_plugin.helper_policy import start_early

                index = getattr(getattr(self, "device", None), "index", None)
                started = isinstance(index, int) and start_early(vllm_config, index) is not None
        except Exception:  # noqa: BLE001 - never stop an engine's start: the loader starts its own helpers
            logger.exception("marlin-pack: could not start the copy helpers early")
        t0 = time.perf_counter()
        result = original(self, *args, **kwargs)
        if ours:  # what the helpers' start beside it costs vLLM's own step (compare io_early_helpers false)
            beside = " (copy helpers starting beside it)" if started else ""
            logger.info("marlin-pack: vLLM built its workspace and model runner in %.2f s%s", time.perf_counter() - t0, beside)
        return result

    return init_workspace_and_model_runner


PATCHES = (
    Patch(
        "vllm.v1.worker.gpu_worker:Worker._init_workspace_and_model_runner",
        _init_workspace_and_model_runner,
        remove_when="vLLM lets a model loader start work for its load (e.g. a prepare hook) after the worker's memory snapshot",
        deferred=True,  # imported by vLLM only in GPU worker processes
    ),
)
