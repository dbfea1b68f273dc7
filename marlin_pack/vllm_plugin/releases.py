"""The vLLM releases marlin-pack serves, newest first: what differs between them, as data.

One entry per release. What a bundle holds does not differ (the post-processed bytes of Marlin dense, Machete
dense, Marlin MoE and compressed-tensors WNA16 are the same from 0.30.0 to 0.34.0, see docs/development.md);
what differs is the plugin's surface, read from each release's code:

* ``layouts``: the bundle layouts the release serves, by layer family (``marlin``, ``machete``, ``marlin_moe``)
  -> layout version. A bundle is accepted when the running release lists the layout of every family it holds
  (:func:`serves`), whatever release it was made with; a layout version is bumped only when bytes change.
* ``finish``: what ``MarlinLinearKernel``'s post-processing leaves on a layer besides its tensors, so what
  finishing a layer whose tensors arrived final sets: ``workspace`` (0.30: as ``empty_qzeros``, and the kernel's
  own ``workspace``, which its ``apply_weights`` reads; the Marlin MoE methods' ``layer.workspace`` is read by no
  kernel), ``empty_qzeros`` (0.31-0.33: an unused zero-point parameter becomes ``int32[0]``),
  ``w_zp`` (0.34: an unused ``qzeros`` is retired, its data kept, and an empty ``w_zp`` is the kernel's).
* ``env``: the vLLM environment variables the plugin reads that the release still has.
* ``memory_hook``: vLLM's GPU worker calls ``BaseModelLoader.get_external_weight_memory`` (the loader waits there
  for its copy helpers).
* ``cache_key``: ``WeightCacheKey.from_model_config`` takes ``kernel_config`` (``kernel_config``) or not (``plain``).
* ``daemon``: how weight-cache daemons start: ``module`` (0.30: ``python -m ...weight_cache.daemon``) or
  ``preload`` (``vllm preload``, with ``WeightCacheDaemon.get_model`` and ``get_draft_daemon_config``).
* ``upstream``: what marlin-pack patches in that the release ships itself: ``dense_pre_processed`` (0.34: the dense
  AWQ/GPTQ methods declare ``supports_pre_processed_weights`` and have a pre-processed branch, for MarlinLinearKernel
  only, so marlin-pack's rows stay: they also cover Machete, compressed-tensors and MoE), ``kernel_format_reload``
  (0.34: ``reload_weights(is_checkpoint_format=False)`` post-processes under ``weights_already_processed()``).
* ``new_params``: the kernel's post-processing leaves each parameter it transforms (``w_q``, ``w_s``, ``w_zp`` with
  zero points) a new plain ``torch.nn.Parameter`` holding the old one's ``weight_loader`` (0.30-0.32), where later
  releases keep the loaded parameter object (``PackedvLLMParameter``, ...); finishing does the same.
* ``transformers_backend``: the architectures of marlin-pack's table (``marlin/architectures.py``) that the release
  serves through its Transformers backend (registry entry ``("transformers", ...)``), every other one through vLLM's own
  class. An architecture's row says which of the two paths its layout is for (``Architecture.paths``: the backend's for
  Olmo 2, both for Gemma, whose backend layers equal gemma.py's); a bundle is refused on a release taking another path
  (:func:`path_problem`), and, through the backend, under a transformers outside the releases its layout was checked
  against (:func:`transformers_problem`). ``transformers``: the transformers release the release's environment
  resolves to (its pin), the one its oracles ran with. ``unregistered``: architectures of the table the release's
  registry does not list at all (Kolibri 1 before 0.33: neither a class of vLLM's own nor a backend entry, and its pinned
  transformers has no such class), refused there (:func:`path_problem`). ``backend_fallback``: architectures of the table
  the release's registry does not list either, but that its transformers has a class for: vLLM serves them through its
  Transformers backend all the same (``ModelRegistry``'s "fallback to transformers impl" with ``model_impl`` auto:
  ``_try_resolve_transformers`` takes transformers' class where ``is_backend_compatible()`` or
  ``_can_set_attn_implementation()``, ``ModelConfig._get_transformers_backend_cls`` names ``TransformersForCausalLM``,
  or ``TransformersMoEForCausalLM`` for an MoE config; the same code in every release here), so their path is the
  backend's, as for a registry entry (:func:`via_fallback` says which of the two).
* ``ready``: the plugin's adapter for the release is done and its oracles pass. A release listed but not ready is
  refused like an unknown one; its entry is data for the adapter to come.

Patches carry the releases they apply to in :mod:`.patches.catalog` (``Row.first``/``Row.last``, or ``Row.needs``: a
feature of :data:`FEATURES` read from the entries above), resolved here (:func:`applies`). This module is the only
place that orders or compares release strings; importing it imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from marlin_pack._constants import LAYOUT_VERSION, MADE_WITH_VLLM

__all__ = [
    "Release",
    "RELEASES",
    "MADE_WITH",
    "release",
    "supported",
    "supported_text",
    "unsupported_reason",
    "applies",
    "serves",
    "served_natively",
    "serving_path",
    "via_fallback",
    "path_problem",
    "transformers_problem",
]

FAMILIES = ("marlin", "machete", "marlin_moe")
_LAYOUTS_V1: Mapping[str, int] = MappingProxyType({f: LAYOUT_VERSION for f in FAMILIES})


@dataclass(frozen=True)
class Release:
    """What marlin-pack's plugin needs to know about one vLLM release (see the module docstring)."""

    version: str
    finish: Literal["workspace", "empty_qzeros", "w_zp"]
    memory_hook: bool
    cache_key: Literal["plain", "kernel_config"]
    daemon: Literal["module", "preload"]
    ready: bool
    env: frozenset[str] = frozenset()
    upstream: frozenset[str] = frozenset()
    layouts: Mapping[str, int] = field(default_factory=lambda: _LAYOUTS_V1)
    # Whether the kernel's post-processing re-registers each transformed parameter as a plain torch.nn.Parameter
    # (MPLinearKernel._transform_param -> replace_parameter: 0.30-0.32) instead of keeping the parameter object (0.33+).
    new_params: bool = False
    # Architectures of marlin-pack's table that this release serves through its Transformers backend (registry entry
    # ("transformers", ...)); the table's others through vLLM's own class.
    transformers_backend: frozenset[str] = frozenset()
    # The transformers release this release's environment resolves to (tools/vllm-env.sh; its oracles ran with it).
    transformers: str = ""
    # Architectures of marlin-pack's table that this release's model registry does not list (no path serves them).
    unregistered: frozenset[str] = frozenset()
    # Architectures of marlin-pack's table that this release's registry does not list but serves through its Transformers
    # backend because its transformers has the class (the registry's fallback, model_impl "auto").
    backend_fallback: frozenset[str] = frozenset()

    def has_env(self, name: str) -> bool:
        """Whether this release still reads the environment variable ``name``."""
        return name in self.env

    def has(self, feature: str) -> bool:
        """Whether this release has ``feature``, one of :data:`FEATURES` (what a patch row ``needs``).

        Raises:
            KeyError: ``feature`` is not one of :data:`FEATURES`.
        """
        return FEATURES[feature](self)


# What a patch row may need of a release (``Row.needs``), each read from the entry's data above.
FEATURES: Mapping[str, Callable[[Release], bool]] = MappingProxyType({
    "memory_hook": lambda r: r.memory_hook,             # get_external_weight_memory is called before the snapshot
    "vllm_preload": lambda r: r.daemon == "preload",     # WeightCacheDaemon.get_model, get_draft_daemon_config
    "kernel_config_key": lambda r: r.cache_key == "kernel_config",  # WeightCacheKey.from_model_config(kernel_config=)
})

_MARLIN_INPUT = frozenset({"VLLM_MARLIN_INPUT_DTYPE"})
# Through the Transformers backend, read from each release's models/registry.py (tests/vllm_plugin/test_releases.py
# checks the running release's): 0.30-0.31 these; 0.32 adds the models it moved off its own classes (gpt_neox.py,
# phi.py, glm.py, arcee.py, seed_oss.py, mellum.py, ...); 0.33 Kolibri 1 (new); 0.34 Gemma, StableLM and Olmoe too.
_BACKEND_030 = frozenset({"OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "SmolLM3ForCausalLM",
                          "Starcoder2ForCausalLM", "GPTBigCodeForCausalLM", "HunYuanDenseV1ForCausalLM",
                          "VaultGemmaForCausalLM", "FlexOlmoForCausalLM", "HunYuanMoEV1ForCausalLM"})
_BACKEND_032 = _BACKEND_030 | {"GPTNeoXForCausalLM", "PhiForCausalLM", "GlmForCausalLM", "ArceeForCausalLM",
                               "SeedOssForCausalLM", "CwmForCausalLM", "Jais2ForCausalLM", "MellumForCausalLM"}
_BACKEND_033 = _BACKEND_032 | {"Kolibri1ForCausalLM"}
_BACKEND_034 = _BACKEND_033 | {"GemmaForCausalLM", "StableLmForCausalLM", "OlmoeForCausalLM"}
# Listed by no registry before 0.33 (transformers < 5.20 has no Kolibri1ForCausalLM either).
_UNREGISTERED_030 = frozenset({"Kolibri1ForCausalLM"})
# Listed by no registry, served through the backend by its fallback: every release's transformers (5.16.1 to 5.22.2) has
# these classes, backend-compatible, with the same modules (tests/vllm_plugin/test_releases.py checks the running one's).
_FALLBACK_030 = frozenset({"HeliumForCausalLM", "MinistralForCausalLM", "NanoChatForCausalLM"})

# Newest first. Each fact was read from the release's wheel (vllm/**/*.py).
RELEASES: tuple[Release, ...] = (
    Release("0.34.0", finish="w_zp", memory_hook=True, cache_key="kernel_config", daemon="preload", ready=True,
            upstream=frozenset({"dense_pre_processed", "kernel_format_reload"}),
            transformers_backend=_BACKEND_034, transformers="5.22.2",
            backend_fallback=_FALLBACK_030),
    Release("0.33.0", finish="empty_qzeros", memory_hook=True, cache_key="kernel_config", daemon="preload", ready=True,
            env=_MARLIN_INPUT, transformers_backend=_BACKEND_033, transformers="5.20.2", backend_fallback=_FALLBACK_030),
    Release("0.32.0", finish="empty_qzeros", memory_hook=True, cache_key="plain", daemon="preload", ready=True, new_params=True,
            env=_MARLIN_INPUT, transformers_backend=_BACKEND_032, transformers="5.19.0", unregistered=_UNREGISTERED_030,
            backend_fallback=_FALLBACK_030),
    Release("0.31.0", finish="empty_qzeros", memory_hook=False, cache_key="plain", daemon="preload", ready=True, new_params=True,
            env=_MARLIN_INPUT, transformers_backend=_BACKEND_030, transformers="5.17.0", unregistered=_UNREGISTERED_030,
            backend_fallback=_FALLBACK_030),
    Release("0.30.0", finish="workspace", memory_hook=False, cache_key="plain", daemon="module", ready=True, new_params=True,
            env=_MARLIN_INPUT, transformers_backend=_BACKEND_030, transformers="5.16.1", unregistered=_UNREGISTERED_030,
            backend_fallback=_FALLBACK_030),
)

# The release written into a manifest as ``target.vllm_version`` ("made with"): the one whose post-processing the
# converter's layout functions were first checked against. Only recorded; acceptance is by layout (:func:`serves`).
MADE_WITH = MADE_WITH_VLLM

_BY_VERSION = {r.version: r for r in RELEASES}
_ORDER = {r.version: i for i, r in enumerate(RELEASES)}  # 0: newest


def release(version: str) -> Release | None:
    """The entry of ``version`` (a local build suffix such as ``+cu130`` ignored) if marlin-pack serves it."""
    entry = _BY_VERSION.get(version.split("+", 1)[0])
    return entry if entry is not None and entry.ready else None


def supported() -> tuple[str, ...]:
    """The releases served, newest first."""
    return tuple(r.version for r in RELEASES if r.ready)


def supported_text() -> str:
    """``0.34.0, 0.33.0, ...``: the releases served, newest first, for messages."""
    return ", ".join(supported())


def unsupported_reason(version: str) -> str:
    """The one line said where ``version`` is not served."""
    return f"vLLM {version} is not a release marlin-pack supports (supported: {supported_text()})"


def applies(version: str, first: str | None, last: str | None, needs: str | None = None) -> bool:
    """Whether a patch row listed for ``first``..``last`` (either None: open) that ``needs`` a feature of
    :data:`FEATURES` (None: nothing) applies to the release ``version``.

    Raises:
        KeyError: ``version``, ``first`` or ``last`` is not in :data:`RELEASES`, or ``needs`` not in :data:`FEATURES`.
    """
    base = version.split("+", 1)[0]
    at = _ORDER[base]
    in_range = (first is None or at <= _ORDER[first]) and (last is None or at >= _ORDER[last])
    return in_range and (needs is None or _BY_VERSION[base].has(needs))


def serves(version: str, layouts: Mapping[str, int]) -> bool:
    """Whether the release ``version`` serves a bundle holding ``layouts`` (family -> layout version)."""
    entry = release(version)
    return entry is not None and all(entry.layouts.get(f) == v for f, v in layouts.items())


Path = Literal["native", "transformers", "unregistered"]
_PATH_WORDS = {"native": "with its own model class", "transformers": "through its Transformers backend"}
_LAYOUT_WORDS = {"native": "vLLM's own model class", "transformers": "vLLM's Transformers backend"}


def serving_path(version: str, architecture: str) -> Path | None:
    """How the release ``version`` serves ``architecture``: ``native`` (vLLM's own model class), ``transformers`` (its
    Transformers backend) or ``unregistered`` (its model registry does not list it); None where marlin-pack does not
    serve the release."""
    entry = release(version)
    if entry is None:
        return None
    if architecture in entry.unregistered:
        return "unregistered"
    backend = entry.transformers_backend | entry.backend_fallback
    return "transformers" if architecture in backend else "native"


def via_fallback(version: str, architecture: str) -> bool:
    """Whether the release ``version`` takes its Transformers backend for ``architecture`` because its registry lists no
    such architecture and transformers has the class (the registry's fallback), not by a registry entry."""
    entry = release(version)
    return entry is not None and architecture in entry.backend_fallback


def path_problem(version: str, architecture: str, paths: frozenset[str], checkpoint: str | None = None) -> str | None:
    """Why the release ``version`` cannot serve a bundle of ``architecture`` whose layers are those of the serving paths
    ``paths`` (the architecture row's ``paths``, or fewer where the bundle's checkpoint names tensors only those load:
    ``checkpoint`` says which, as Olmoe's "experts named mlp.experts.N.{w1,w3,w2}", which olmoe.py does not map); None:
    it takes one of them."""
    path = serving_path(version, architecture)
    if path is None or path in paths:
        return None
    held = " and ".join(_LAYOUT_WORDS[p] for p in sorted(paths)) or "no vLLM model"
    others = [r.version for r in RELEASES if r.ready and serving_path(r.version, architecture) in paths]
    where = f"serve it with vLLM {', '.join(others)}" if others else "no release marlin-pack supports builds those layers"
    if path == "unregistered":
        return f"vLLM {version} does not serve {architecture}: its model registry lists no such architecture; {where}"
    if checkpoint:
        return (f"vLLM {version} serves {architecture} {_PATH_WORDS[path]}, which does not load the {checkpoint} of the "
                f"checkpoint the bundle was made from (only {held} does); {where}")
    return (f"vLLM {version} serves {architecture} {_PATH_WORDS[path]}, whose layers differ from those of {held} the "
            f"bundle holds; {where}")


def _minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a release string such as ``5.22.2`` or ``5.23.0.dev0``; None if it has none."""
    parts = version.split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def transformers_problem(checked: str, installed: str | None) -> str | None:
    """Why a bundle whose Transformers-backend layout was checked against the transformers releases ``checked``
    (``5.16-5.22``: major.minor, inclusive; a manifest's ``target.transformers``) cannot be served where
    ``installed`` is (None: not installed); None: it can. The backend builds its layers from the installed
    transformers' modeling code, which other releases may change."""
    low, _, high = checked.partition("-")
    bounds = _minor(low), _minor(high or low)
    found = _minor(installed) if installed else None
    if None not in bounds and found is not None and bounds[0] <= found <= bounds[1]:  # type: ignore[operator]
        return None
    what = f"transformers {installed}" if installed else "no transformers"
    return (f"{what} is installed; the bundle holds the Transformers backend's layers as transformers {checked} "
            f"model them; install one of those releases (pip install 'transformers>={low},<{_next_minor(high or low)}')")


def _next_minor(version: str) -> str:
    m = _minor(version)
    return f"{m[0]}.{m[1] + 1}" if m else version


def served_natively(version: str, architecture: str) -> str | None:
    """Why the release ``version`` cannot serve a bundle of ``architecture`` that holds the layers of vLLM's own model
    class only (None: it can); :func:`path_problem` with the native path."""
    return path_problem(version, architecture, frozenset({"native"}))
