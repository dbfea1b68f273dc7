"""Names every module of marlin-pack agrees on."""

__all__ = [
    "BUNDLE_DIRNAME",
    "COMMON_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MACHETE_FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "KERNEL_NAME",
    "MACHETE_KERNEL_NAME",
    "LAYOUT_VERSION",
    "LOAD_FORMAT",
    "MANIFEST_NAME",
    "LEGACY_STAMPS_NAME",
    "MADE_WITH_VLLM",
    "DEBUG_ENV",
    "SUPPORTED_GROUP_SIZES",
]

FORMAT_NAME = "marlin-pack"
# Bumped whenever the manifest or the files change in a way an older reader would misread.
# 2: the manifest records the source's relevant quantization settings, not its whole quantization_config.
# 4: mixture-of-experts layers (``moe_layers``); format 3 bundles (dense) are still read.
# 5: layers in Machete's layout (``kernel: "machete"``); written only by bundles holding such a layer, so a
# Marlin-only bundle stays format 4, byte for byte, and readable by older marlin-packs.
FORMAT_VERSION = 4
MACHETE_FORMAT_VERSION = 5
READABLE_FORMAT_VERSIONS = (3, 4, 5)
# Bumped whenever the tensor layout written for a kernel changes (vLLM releases list the layouts they serve:
# marlin_pack.vllm_plugin.releases).
LAYOUT_VERSION = 1
# The manifest's target.vllm_version ("made with"): the release the layout functions were first checked against.
# Recorded only; a bundle is accepted by any release whose entry lists its layouts.
MADE_WITH_VLLM = "0.33.0"
KERNEL_NAME = "MarlinLinearKernel"
MACHETE_KERNEL_NAME = "MacheteLinearKernel"  # vLLM 0.33.0's choice on SM90 where it implements a layer
LOAD_FORMAT = "marlin_prepacked"

MANIFEST_NAME = "manifest.json"
COMMON_FILE = "common.safetensors"
# Default bundle location: a sub-directory of the checkpoint. vLLM only globs
# top-level ``*.safetensors`` of a model directory, so a bundle there is never
# mistaken for checkpoint weights.
BUNDLE_DIRNAME = "marlin-pack"
# The stamp cache earlier versions kept inside a bundle: never read (stamps are per user, see
# marlin_pack.io.stamps); only tolerated in a bundle that --force replaces.
LEGACY_STAMPS_NAME = ".stamps.json"
DEBUG_ENV = "MARLIN_PACK_DEBUG"
# Group sizes MarlinLinearKernel accepts in vLLM 0.33.0 (-1: one group per output channel).
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
