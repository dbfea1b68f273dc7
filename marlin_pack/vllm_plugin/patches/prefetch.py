"""An ``ipc_cache`` engine asks the weight-cache daemon for its tensors while it builds its model.

vLLM 0.33.0's ``IpcModelLoader.load_model`` first asks the daemon for its state (``get_state``:
the daemon exports one CUDA IPC handle per tensor, 1444 for a 70B model, and pickles them),
waits for the answer, and only then builds the model on ``meta``. The answer is first read
after that construction, to map the tensors. Measured on the H200 (``bench_load.py``'s attach
phases, 70B GPTQ): the request 0.06 s, the construction 0.32-0.37 s of a 0.51-0.57 s
``load_model``.

Here ``_state_for_key`` (the request, after vLLM computed the cache key) runs on a thread and
returns a :class:`PendingState` at once; the engine builds its model meanwhile. The first step
after the construction, ``check_ipc_quant_support``, waits for the answer *before* it checks,
and a construction that fails waits for it too. So the daemon's errors (unreachable, key
mismatch, another GPU) are raised where vLLM raised them, before any error of the construction
or of the quant check, and vLLM's fallback decides on them as before.

Only a model load in ``zero_copy`` mode (vLLM's default) prefetches. A reload (``is_reload``)
reads the state at once, and ``copy`` mode releases the daemon's weights when loading fails
after the state was fetched, so it keeps vLLM's order.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from marlin_pack.vllm_plugin.patches.registry import Patch

__all__ = ["PATCHES", "PendingState"]

_IPC = "vllm.model_executor.model_loader.weight_cache.ipc_loader"
# The state this context's load_model asked for and has not read yet.
_PENDING: contextvars.ContextVar[PendingState | None] = contextvars.ContextVar("marlin_pack_pending_state", default=None)


class PendingState:
    """Stands for vLLM's ``WeightCacheState`` while the daemon answers on a thread.

    Reading a field waits for the answer, and raises what asking for it raised.
    """

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> Any:
        """The daemon's ``WeightCacheState`` (waits for it; raises the request's error)."""
        return self._future.result()

    @property
    def entries(self) -> Any:
        return self.result().entries

    @property
    def aliases(self) -> Any:
        return self.result().aliases

    @property
    def attrs(self) -> Any:
        return self.result().attrs


def _current_device() -> int | None:
    """The CUDA device this thread uses, if CUDA is in use (a new thread starts on device 0)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def _ask(original: Callable[..., Any], loader: Any, cache_key: Any, device: int | None, future: Future) -> None:
    try:
        if device is not None:
            import torch

            torch.cuda.set_device(device)  # the GPU check compares the daemon's GPU with this thread's
        future.set_result(original(loader, cache_key, is_reload=False))
    except BaseException as e:  # noqa: BLE001 - handed to the reader of the state, as vLLM would have raised it
        future.set_exception(e)


def _state_for_key(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def state_for_key(self: Any, cache_key: Any, *, is_reload: bool = False) -> Any:
        if is_reload or getattr(self, "mode", None) != "zero_copy":
            return original(self, cache_key, is_reload=is_reload)
        future: Future = Future()
        threading.Thread(
            target=_ask, args=(original, self, cache_key, _current_device(), future), name="marlin-pack-ipc-state", daemon=True
        ).start()
        pending = PendingState(future)
        _PENDING.set(pending)
        return pending

    return state_for_key


def _answer_first() -> None:
    """Wait for the state this load asked for, raising the request's error (once)."""
    pending = _PENDING.get()
    if pending is not None:
        _PENDING.set(None)
        pending.result()


def _initialize_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_model(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException:
            _answer_first()  # vLLM asked the daemon before building: its error comes first
            raise

    return initialize_model


def _check_quant_support(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def check_ipc_quant_support(*args: Any, **kwargs: Any) -> Any:
        _answer_first()
        return original(*args, **kwargs)

    return check_ipc_quant_support


_REMOVE = "vLLM's IpcModelLoader builds the model while the daemon answers get_state"
PATCHES = (
    Patch(f"{_IPC}:IpcModelLoader._state_for_key", _state_for_key, remove_when=_REMOVE),
    Patch(f"{_IPC}:initialize_model", _initialize_model, remove_when=_REMOVE),
    Patch(f"{_IPC}:check_ipc_quant_support", _check_quant_support, remove_when=_REMOVE),
)
