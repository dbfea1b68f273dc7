"""Which ``*.safetensors`` files make up a checkpoint (torch-free: also used by the loader's checks)."""

from __future__ import annotations

import json
from pathlib import Path

from marlin_pack.errors import CheckpointError
from marlin_pack.io.files import NotRegularFileError, read_limited

__all__ = ["INDEX_NAME", "QUANTIZE_CONFIG_NAME", "unreadable", "read_json", "quantization_config", "weight_files"]

INDEX_NAME = "model.safetensors.index.json"
# Older AutoGPTQ keeps the settings only here; vLLM 0.33.0 reads it (with --quantization gptq).
QUANTIZE_CONFIG_NAME = "quantize_config.json"
# config.json and index files are small; anything larger is not one (and is not read whole).
MAX_JSON_BYTES = 64 << 20


def unreadable(path: Path, e: OSError, expected: str) -> CheckpointError:
    """The one-line error for a checkpoint file that cannot be read, with the advice that fits the cause."""
    if isinstance(e, NotRegularFileError):
        return CheckpointError(f"{path} {e.strerror}; expected {expected} as a file")
    if isinstance(e, PermissionError):
        return CheckpointError(f"cannot read {path} ({e.strerror}); check the file's permissions")
    return CheckpointError(f"cannot read {path} ({e.strerror or e}); expected {expected}, restore the checkpoint")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``, or a one-line :class:`CheckpointError`."""
    try:
        data = json.loads(read_limited(path, MAX_JSON_BYTES).decode())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} not found: expected the checkpoint's {what}; point MODEL_DIR at a HuggingFace checkpoint directory"
        ) from None
    except OSError as e:
        raise unreadable(path, e, f"the checkpoint's {what}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); restore the file") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); restore the file") from e
    except RecursionError as e:
        raise CheckpointError(f"{path} nests JSON too deeply to be a {what}; restore the file") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def quantization_config(model_dir: Path, config: dict) -> dict | None:
    """A checkpoint's quantization settings: ``config.json``'s ``quantization_config``, else
    ``quantize_config.json`` (older AutoGPTQ: ``quant_method`` gptq unless it says otherwise), else None."""
    found = config.get("quantization_config")
    if isinstance(found, dict):
        return found
    path = model_dir / QUANTIZE_CONFIG_NAME
    if not path.exists():
        return None
    settings = read_json(path, QUANTIZE_CONFIG_NAME)
    return {"quant_method": "gptq", **settings}


def weight_files(model_dir: Path) -> list[str]:
    """The weight files: those the index names if there is one (others, e.g. Mistral's
    ``consolidated.safetensors``, are not part of the checkpoint), else every top-level one."""
    index = model_dir / INDEX_NAME
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if index.exists():
        weight_map = read_json(index, INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map; restore the index file")
        files = sorted(set(map(str, weight_map.values())))
        missing = [f for f in files if f not in found]
        if missing:
            raise CheckpointError(f"{INDEX_NAME} names {missing[0]}, which is not in {model_dir}; download the missing shard")
        return files
    if not found:
        raise CheckpointError(f"no *.safetensors files in {model_dir}; marlin-pack reads safetensors checkpoints only")
    return found
