"""The words several commands share (``MODEL``, ``--revision``, ``--dtype``, ``--json``...) and their parsing:
each a usage error (exit 2, one line naming the option) when it cannot be read."""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from marlin_pack.commands.console import BadParameter
from marlin_pack.errors import MarlinPackError
from marlin_pack.remote.url import parse_url, refuse_url, url_scheme

__all__ = [
    "Device", "Dtype", "DtypeOpt", "JsonOpt", "Kernel", "ModelArg", "RevisionOpt", "TargetArg", "VerifyMode",
    "bundle_of", "bundle_or_url", "check_dtype_word", "engine_dtype", "local_dir", "local_or_repo", "parse_tp", "unconvertible",
    "why_no_bundle",
]

ModelArg = Annotated[
    str, typer.Argument(metavar="MODEL", help="Checkpoint directory, or a Hugging Face model id (org/name) as given to vllm serve.")
]
TargetArg = Annotated[
    str, typer.Argument(metavar="MODEL|BUNDLE", help="A bundle directory, or MODEL (a checkpoint directory or a model id): its bundle.")
]
RevisionOpt = Annotated[str | None, typer.Option("--revision", help="Branch, tag or commit of a model id \\[default: main].")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


class Dtype(str, Enum):
    """vLLM's --dtype words (float/float32 are refused: these layers run 16-bit activations)."""

    auto = "auto"
    half = "half"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float = "float"
    float32 = "float32"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class Kernel(str, Enum):
    """The layout of the bundle's layers: vLLM's choice on SM90 per layer (machete), or Marlin for every layer."""

    marlin = "marlin"
    machete = "machete"


class VerifyMode(str, Enum):
    auto = "auto"
    full = "full"
    size = "size"


DtypeOpt = Annotated[
    Dtype, typer.Option("--dtype", help="The engine's --dtype, as vllm serve takes it (auto: what vLLM picks from config.json).")
]


def parse_tp(value: str) -> list[int]:
    """``--tp 1,2,4``: positive sizes, comma-separated, each written once (``1,,2``, ``2,2``, ``1,`` are refused: a
    typo, not a wish)."""
    words = [w.strip() for w in value.split(",")]
    if not all(w.isascii() and w.isdigit() for w in words):
        raise BadParameter(f"{value!r}: expected positive sizes separated by commas, like 1 or 1,2,4,8", param_hint="--tp")
    sizes = [int(w) for w in words]
    if min(sizes) < 1:
        raise BadParameter(f"{value!r}: expected positive sizes like 1 or 1,2,4,8 (0 is no size)", param_hint="--tp")
    if len(set(sizes)) != len(sizes):
        raise BadParameter(f"{value!r}: each size once, like {','.join(map(str, sorted(set(sizes))))}", param_hint="--tp")
    return sorted(sizes)


# What to do with a URL where a path is expected: a word per option (refuse_url's ``todo``; {url} is the URL, {sync} the
# command that copies it down).
_COPY_DOWN = "copy it to a local directory first (`{sync} DIR`) and pass DIR"
URL_ADVICE = {
    "MODEL": ("a checkpoint directory or a Hugging Face model id (org/name)", _COPY_DOWN),
    "MODEL|BUNDLE": ("a bundle directory, a checkpoint directory or a model id", _COPY_DOWN),
    "-o": ("a directory", "convert writes a local bundle: convert to a directory, then publish it with `marlin-pack push DIR {url}`"),
    "--bundle": ("a directory", _COPY_DOWN),
    "--source": ("a checkpoint directory", _COPY_DOWN),
}


def local_dir(value: Path | str | None, option: str) -> Path | None:
    """An option's path, refusing an object-storage URL in one line (a Path would have made ``s3://b/x`` the local
    folder ``s3:``).

    Raises:
        UrlNotPathError: ``value`` is written as a URL (``s3://...``).
    """
    expected, todo = URL_ADVICE[option]
    refuse_url(value, option, expected, todo)
    return None if value is None else Path(value)


def bundle_or_url(value: Path | str | None, option: str = "--bundle") -> Path | str | None:
    """A bundle option: a local directory as a Path, or a bundle published in object storage as its URL
    (``s3://bucket/prefix``, as written).

    Raises:
        UrlNotPathError: a URL of a scheme marlin-pack does not read (``gs://`` with advice), or malformed.
    """
    if value is not None and url_scheme(value) is not None:
        return str(parse_url(value))
    return local_dir(value, option)


def local_or_repo(model: str, revision: str | None) -> str:
    """A local directory as an absolute path (what vLLM and the bundle record see); a repo id as it is.

    Raises:
        typer.BadParameter: ``--revision`` given with a local directory (it names a commit of a model id).
        UrlNotPathError: MODEL is an object-storage URL.
    """
    local_dir(model, "MODEL")
    if Path(model).is_dir():
        if revision is not None:
            raise BadParameter(
                f"{model} is a local directory; --revision names a branch, tag or commit of a model id: drop it",
                param_hint="--revision",
            )
        return str(Path(model).resolve())
    return model


def bundle_of(target: str, revision: str | None) -> tuple[Path, str | None]:
    """The bundle a command was pointed at, and the model it belongs to when MODEL was given (else None).

    ``target``: a bundle directory (it holds manifest.json), a checkpoint directory (its default bundle) or a
    model id (its bundle in marlin-pack's cache; nothing is downloaded).
    """
    from marlin_pack._constants import MANIFEST_NAME
    from marlin_pack.sources.hub import is_repo_id, locate_bundle

    local_dir(target, "MODEL|BUNDLE")
    if Path(target).is_dir() and (Path(target) / MANIFEST_NAME).is_file():
        if revision is not None:
            raise BadParameter(f"{target} is a bundle directory; --revision is for a model id: drop it", param_hint="--revision")
        return Path(target).resolve(), None
    if not Path(target).is_dir() and not is_repo_id(target):
        return Path(target), None  # a bundle path that is not there: reading its manifest says so
    model = local_or_repo(target, revision)
    bundle = locate_bundle(model, revision)
    if not bundle.exists():
        raise MarlinPackError(f"no bundle at {bundle}: {why_no_bundle(model, revision)}")
    return bundle, model


def why_no_bundle(model: str, revision: str | None) -> str:
    """Why MODEL has no bundle, and what to do: the checkpoint's refusal where it cannot have one, else the command
    that writes it."""
    why = unconvertible(model, revision)
    if why is not None:
        return f"{model} cannot have one: {why}"
    command = shlex.join(["marlin-pack", "convert", model, *(["--revision", revision] if revision else [])])
    return f"run `{command}` first"


def unconvertible(model: str, revision: str | None) -> str | None:
    """Why MODEL's checkpoint cannot have a bundle (not quantized, GGUF, another method: as ``convert`` would refuse
    it, read from its headers and config only), or None."""
    from marlin_pack.io.checkpoint_files import weight_files
    from marlin_pack.sources import source_from_quant_config
    from marlin_pack.sources.checkpoint import Checkpoint
    from marlin_pack.sources.hub import resolve_model

    try:
        model_dir = resolve_model(model, revision, download=False).dir
        weight_files(model_dir)
        source_from_quant_config(Checkpoint(model_dir).quantization_config())
    except MarlinPackError as e:
        return str(e)
    return None


def check_dtype_word(word: str) -> None:
    """A --dtype word vLLM takes but these layers cannot run in (float, float32) is a usage error, before any work."""
    from marlin_pack.dtypes import serving_dtype_for

    try:
        serving_dtype_for(word, {})
    except ValueError as e:
        raise BadParameter(str(e), param_hint="--dtype") from None


def engine_dtype(model: str, revision: str | None, word: str) -> str:
    """The dtype `vllm serve MODEL --dtype WORD` runs in (auto: what vLLM picks from the config)."""
    from marlin_pack.dtypes import serving_dtype_for
    from marlin_pack.errors import CheckpointError
    from marlin_pack.io.checkpoint_files import read_json, weight_files
    from marlin_pack.io.safetensors_io import read_header
    from marlin_pack.sources.hub import resolve_model

    check_dtype_word(word)
    try:
        model_dir = resolve_model(model, revision, download=False).dir
        config = read_json(model_dir / "config.json", "config.json")
        codes = {t.dtype for f in weight_files(model_dir) for t in read_header(model_dir / f).tensors.values()}
    except (CheckpointError, OSError, ValueError):
        return serving_dtype_for(word, {"dtype": "float16"}).value  # the source check reports what is wrong
    return serving_dtype_for(word, config, codes).value
