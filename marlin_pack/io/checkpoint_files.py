"""Which ``*.safetensors`` files make up a checkpoint, and its quantization settings.

Torch-free: also used by the loader's checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from marlin_pack.errors import CheckpointError, UnsupportedCheckpointError
from marlin_pack.io.files import NotRegularFileError, read_limited
from marlin_pack.schemas import (
    AwqSettings,
    CompressedTensorsGroup,
    CompressedTensorsSettings,
    CompressedTensorsWeights,
    GptqSettings,
    QuantSettings,
    SettingsFile,
    weight_file_name_problem,
)

__all__ = [
    "INDEX_NAME",
    "QUANTIZE_CONFIG_NAME",
    "FoundSettings",
    "unreadable",
    "read_json",
    "quantization_config",
    "parse_quant_settings",
    "quant_settings",
    "weight_files",
]

INDEX_NAME = "model.safetensors.index.json"
# Older AutoGPTQ keeps the settings only here; vLLM reads it (with --quantization gptq).
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


def _find_quantization_config(model_dir: Path, config: dict) -> tuple[dict, SettingsFile] | None:
    """The raw quantization settings and the file they came from, or None if not quantized."""
    found = config.get("quantization_config")
    if isinstance(found, dict):
        return found, "config.json"
    path = model_dir / QUANTIZE_CONFIG_NAME
    if not path.exists():
        return None
    settings = read_json(path, QUANTIZE_CONFIG_NAME)
    return {"quant_method": "gptq", **settings}, QUANTIZE_CONFIG_NAME


def quantization_config(model_dir: Path, config: dict) -> dict | None:
    """A checkpoint's quantization settings: ``config.json``'s ``quantization_config``, else
    ``quantize_config.json`` (older AutoGPTQ: ``quant_method`` gptq unless it says otherwise), else None."""
    found = _find_quantization_config(model_dir, config)
    return None if found is None else found[0]


def _typed(key: str, value: object, expected: type, what: str) -> None:
    # bool is an int to Python, not to a quantizer: "bits": true is malformed, not 1.
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UnsupportedCheckpointError(
            f"quantization_config {key} is {value!r}, expected {what}; the checkpoint's quantization settings are "
            "malformed, restore its config"
        )


def _setting(qc: dict, keys: tuple[str, ...], expected: type, what: str, default: object = None) -> object:
    """The first of ``keys`` that ``qc`` holds (vLLM's ``get_from_keys`` order), type-checked;
    ``default`` if it holds none of them, or null."""
    key = next((k for k in keys if k in qc), None)
    if key is None or qc[key] is None:
        return default
    _typed(key, qc[key], expected, what)
    return qc[key]


def _names(qc: dict, key: str) -> list[str]:
    """A list of module names, nested lists flattened (as vLLM reads them); empty when unset."""
    out: list[str] = []

    def walk(value: object) -> None:
        _typed(key, value, list, "a list of module names")
        for item in value:  # type: ignore[attr-defined]
            if isinstance(item, list):
                walk(item)
            else:
                _typed(key, item, str, "a list of module names")
                out.append(item)

    if qc.get(key) is not None:
        walk(qc[key])
    return out


def _dynamic(qc: dict) -> dict[str, dict]:
    """GPTQModel's ``dynamic`` rules, in order (vLLM applies the first that matches); empty when unset."""
    rules = qc.get("dynamic")
    if rules is None:
        return {}
    _typed("dynamic", rules, dict, "an object of regex -> settings")
    for pattern, overrides in rules.items():
        _typed(f"dynamic[{pattern!r}]", overrides, dict, "an object of settings")
        for key, value in overrides.items():
            # GPTQModel writes float settings there too (mse, damp_percent): any JSON scalar
            if value is not None and not isinstance(value, (int, float, bool, str)):
                _typed(f"dynamic[{pattern!r}].{key}", value, int, "a number, boolean or string")
    return rules


def _lower(qc: dict, key: str, default: str) -> str:
    return str(_setting(qc, (key,), str, "a string", default)).lower()


def parse_quant_settings(qc: dict) -> QuantSettings:
    """The settings of a ``quantization_config`` that decide a bundle; everything else is dropped.

    The one place that knows which keys matter and under which names: what vLLM's
    ``AutoAWQConfig.from_config`` / ``AutoGPTQConfig.from_config`` and marlin-pack's readers
    read. Calibration data, paths, dates and tool versions are left out, so that they neither
    bloat the manifest nor make a bundle stale. Values are type-checked, not range-checked:
    the source readers decide what is supported.

    Raises:
        UnsupportedCheckpointError: ``quant_method`` is not awq or gptq, or a setting has the wrong JSON type.
    """
    method = _lower(qc, "quant_method", "")
    # Only its truth matters, to vLLM and to the readers alike (absent or null: false).
    common = {"lm_head": bool(qc.get("lm_head"))}
    if method == "awq":
        return AwqSettings(
            bits=_setting(qc, ("w_bit", "bits"), int, "an integer"),  # type: ignore[arg-type]
            group_size=_setting(qc, ("q_group_size", "group_size"), int, "an integer"),  # type: ignore[arg-type]
            zero_point=_setting(qc, ("zero_point",), bool, "true or false"),  # type: ignore[arg-type]
            version=_lower(qc, "version", "gemm"),
            modules_to_not_convert=_names(qc, "modules_to_not_convert"),
            dynamic=bool(qc.get("dynamic")),  # AutoAWQ ignores it; its presence is refused
            **common,
        )
    if method == "gptq":
        return GptqSettings(
            bits=_setting(qc, ("bits",), int, "an integer"),  # type: ignore[arg-type]
            group_size=_setting(qc, ("group_size",), int, "an integer"),  # type: ignore[arg-type]
            sym=_setting(qc, ("sym",), bool, "true or false"),  # type: ignore[arg-type]
            desc_act=_setting(qc, ("desc_act",), bool, "true or false"),  # type: ignore[arg-type]
            checkpoint_format=_lower(qc, "checkpoint_format", "gptq"),
            modules_in_block_to_quantize=_names(qc, "modules_in_block_to_quantize"),
            dynamic=_dynamic(qc),
            **common,
        )
    if method == "compressed-tensors":
        return _compressed_tensors(qc, common["lm_head"])
    raise UnsupportedCheckpointError(
        f"quant_method is {method or 'missing'!r}, expected 'awq', 'gptq' or 'compressed-tensors' (the weight-only int4/int8 "
        "schemes vLLM serves with Marlin or Machete kernels, whose post-processing a bundle saves); a checkpoint of another "
        "method has nothing to convert: serve it with vLLM as it is (no --load-format marlin_prepacked), or use an AWQ or "
        "GPTQ checkpoint of the model"
    )


# compressed-tensors' ActivationOrdering aliases (and a bare true: group ordering).
_ACTORDER = {"static": "weight", "dynamic": "group", "weight": "weight", "group": "group"}


def _ct_weights(where: str, w: object) -> CompressedTensorsWeights | None:
    """A group's ``weights`` as compressed-tensors' ``QuantizationArgs`` reads them (defaults, aliases, inferred strategy)."""
    if w is None:
        return None
    _typed(where, w, dict, "an object of quantization arguments")
    assert isinstance(w, dict)
    bits = _setting(w, ("num_bits",), int, "an integer", 8)
    group_size = _setting(w, ("group_size",), int, "an integer")
    strategy = _setting(w, ("strategy",), str, "a string")
    if strategy is None:  # QuantizationArgs.validate_model_after
        strategy = "tensor" if group_size is None else "group" if group_size > 0 else "channel" if group_size == -1 else None  # type: ignore[operator]
    actorder = w.get("actorder")
    if isinstance(actorder, bool):
        actorder = "group" if actorder else None
    elif actorder is not None:
        _typed(f"{where}.actorder", actorder, str, "a string, true or false")
        actorder = _ACTORDER.get(actorder.lower(), actorder.lower())
    dynamic = w.get("dynamic", False)
    return CompressedTensorsWeights(
        num_bits=bits,  # type: ignore[arg-type]
        type=_lower(w, "type", "int"),
        symmetric=_setting(w, ("symmetric",), bool, "true or false", True),  # type: ignore[arg-type]
        strategy=None if strategy is None else str(strategy).lower(),
        group_size=group_size,  # type: ignore[arg-type]
        actorder=actorder,
        dynamic=dynamic is not False and dynamic is not None,
    )


def _compressed_tensors(qc: dict, lm_head: bool) -> CompressedTensorsSettings:
    """compressed-tensors settings, read as ``CompressedTensorsConfig.from_config`` reads them."""
    groups_raw = qc.get("config_groups") or {}
    _typed("config_groups", groups_raw, dict, "an object of name -> group")
    groups: dict[str, CompressedTensorsGroup] = {}
    for name, g in groups_raw.items():
        _typed(f"config_groups[{name!r}]", g, dict, "an object")
        targets = _names(g, "targets")
        # vLLM skips a group whose only target is an attention module (KV-cache quantization).
        if len(targets) == 1 and targets[0].endswith("Attention"):
            continue
        groups[name] = CompressedTensorsGroup(
            targets=targets,
            format=_setting(g, ("format",), str, "a string"),  # type: ignore[arg-type]
            weights=_ct_weights(f"config_groups[{name!r}].weights", g.get("weights")),
            input_activations=bool(g.get("input_activations")),
            output_activations=bool(g.get("output_activations")),
        )
    sparsity = qc.get("sparsity_config")
    return CompressedTensorsSettings(
        format=_setting(qc, ("format",), str, "a string"),  # type: ignore[arg-type]
        config_groups=groups,
        ignore=_names(qc, "ignore"),
        sparsity=bool(isinstance(sparsity, dict) and sparsity.get("targets")),
        transform=bool(qc.get("transform_config")),
        lm_head=lm_head,
    )


class FoundSettings(NamedTuple):
    """A checkpoint's relevant quantization settings and the file they came from."""

    settings: QuantSettings
    file: SettingsFile


def quant_settings(model_dir: Path, config: dict) -> FoundSettings | None:
    """The settings that decide a bundle (:func:`parse_quant_settings`) and their file, or None if not quantized.

    Raises:
        CheckpointError: ``quantize_config.json`` unreadable.
        UnsupportedCheckpointError: as :func:`parse_quant_settings`.
    """
    found = _find_quantization_config(model_dir, config)
    return None if found is None else FoundSettings(parse_quant_settings(found[0]), found[1])


def weight_files(model_dir: Path) -> list[str]:
    """The weight files, as vLLM finds them: those the index names if there is one (others, e.g.
    Mistral's ``consolidated.safetensors``, are not part of the checkpoint), else every top-level one
    but hidden ones (vLLM's ``glob`` skips names starting with a dot).

    Raises:
        CheckpointError: no weight file, an index naming a file that is not there, or a weight file
            whose name a manifest cannot record (``weight_file_name_problem``).
    """
    index = model_dir / INDEX_NAME
    found = sorted(p.name for p in model_dir.glob("*.safetensors") if not p.name.startswith("."))
    if index.exists():
        weight_map = read_json(index, INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map; restore the index file")
        files = sorted(set(map(str, weight_map.values())))
        _check_names(files, f"{INDEX_NAME} names")
        missing = [f for f in files if f not in found]
        if missing:
            raise CheckpointError(f"{INDEX_NAME} names {missing[0]}, which is not in {model_dir}; download the missing shard")
        return files
    if not found:
        raise CheckpointError(_no_safetensors(model_dir))
    _check_names(found, f"{model_dir} holds")
    return found


def _no_safetensors(model_dir: Path) -> str:
    """Why a directory without safetensors files has nothing to convert, naming what it holds instead."""
    def held(pattern: str) -> list[str]:
        return sorted(p.name for p in model_dir.glob(pattern) if not p.name.startswith("."))

    if gguf := held("*.gguf"):
        return (f"{model_dir} holds GGUF weights ({gguf[0]}{', ...' if len(gguf) > 1 else ''}), no *.safetensors files; "
                "marlin-pack converts AWQ, GPTQ and compressed-tensors safetensors checkpoints, and vLLM loads GGUF itself "
                f"(`vllm serve {model_dir / gguf[0]}`): use an AWQ or GPTQ checkpoint of the model for a bundle")
    if pickled := held("*.bin") + held("*.pt") + held("*.pth"):
        return (f"{model_dir} holds PyTorch pickle weights ({pickled[0]}), no *.safetensors files; marlin-pack reads "
                "safetensors checkpoints only: save the checkpoint as safetensors (save_pretrained(..., safe_serialization=True))")
    return f"no *.safetensors files in {model_dir}; marlin-pack reads safetensors checkpoints only (AWQ, GPTQ, compressed-tensors)"


def _check_names(names: list[str], where: str) -> None:
    """A one-line refusal for the first weight file name vLLM would not load or a manifest cannot record."""
    for name in names:
        why = weight_file_name_problem(name)
        if why is not None:
            raise CheckpointError(f"{where} weight file {name!r}, which {why}; rename the file (and its index entries)")
