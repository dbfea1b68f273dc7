"""``--load-format marlin_prepacked`` on a vLLM release marlin-pack does not serve: one line, or the ordinary load.

Registered instead of :class:`~.loader.MarlinPrepackedLoader` where the running release has no entry in
:mod:`.releases` (0.35 when it comes, a local build of another release). It imports only vLLM's loader base
classes, which every release has, and nothing of marlin-pack's vLLM internals; no patch is installed on such a
release, so an engine that does not ask for this load format runs exactly as without the plugin.

Asked for, it refuses before building the model, naming the releases marlin-pack supports; with
``{"fallback": true}`` it warns and loads the checkpoint the ordinary way (vLLM's ``DefaultModelLoader``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from marlin_pack.errors import LoadRefusedError, MismatchField
from marlin_pack.vllm_plugin import releases
from marlin_pack.vllm_plugin.options import parse_extra_config

__all__ = ["UnservedReleaseLoader", "refusal_text"]

logger = logging.getLogger("vllm.marlin_pack")

_FALLBACK_HINT = """pass --model-loader-extra-config '{"fallback": true}' to load the checkpoint the ordinary way"""


def refusal_text(version: str, model: str) -> str:
    """The one line an engine of release ``version`` asking for a bundle gets."""
    return (
        f"marlin-pack cannot serve {model}: [{MismatchField.vllm_version}] {releases.unsupported_reason(version)}. "
        f"Install one of them, or {_FALLBACK_HINT}."
    )


class UnservedReleaseLoader(BaseModelLoader):
    """The ``marlin_prepacked`` load format on a release marlin-pack does not serve (see the module docstring)."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = parse_extra_config(load_config.model_loader_extra_config, str(load_config.load_format))

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(dataclasses.replace(self.load_config, load_format="auto", model_loader_extra_config={}))

    def _fall_back_or_refuse(self, model_config: Any) -> None:
        from marlin_pack.vllm_plugin.version_guard import vllm_version

        text = refusal_text(vllm_version(), str(model_config.model))
        if not self.options.fallback:
            raise LoadRefusedError(MismatchField.vllm_version, text)
        logger.warning("%s; loading the checkpoint the ordinary way because fallback is on", text.split(". Install")[0])

    def download_model(self, model_config: Any) -> None:
        self._default_loader().download_model(model_config)

    def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        self._fall_back_or_refuse(model_config)
        return self._default_loader().create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: Any, model_config: Any) -> None:
        self._default_loader().load_weights(model, model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        self._fall_back_or_refuse(model_config)
        return self._default_loader().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
