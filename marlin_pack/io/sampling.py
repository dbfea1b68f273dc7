"""A checkpoint file told from another with the same header without reading it whole: samples of every tensor.

A bundle is a cache of its checkpoint, and a start must know the checkpoint under MODEL_DIR is still the one the
bundle was made from (a re-quantized or re-downloaded checkpoint keeps its names, shapes and sizes: only its bytes
move). Hashing the whole checkpoint proves it, at the cost of reading it, which is what vLLM's own start spends
its time on: on a fresh node (no stamps, page cache cold) that read doubled the bytes a prepacked start took from
the disk. So ``convert`` also records, per source file, the SHA-256 of a few bytes of every tensor
(:func:`sample_digest`), and the loader compares those: kilobytes per tensor, read in parallel, against tens of GB.

What it proves: every tensor of the file holds, at the places sampled, the bytes it held when the bundle was made.
A checkpoint quantized again, or another revision, differs nearly everywhere and is told apart; a change of a few
bytes between the samples is not (``marlin-pack verify`` hashes the checkpoint whole). The places are fixed by the
tensor's name (a hash of it), one per started 64 MiB of the tensor, 4 KiB each (the whole tensor if smaller).

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from marlin_pack.io.files import FileChangedError, identity_of, open_regular, pread_full
from marlin_pack.io.safetensors_io import SafetensorsHeader, parse_header, read_header_bytes_of

__all__ = ["SAMPLE_BYTES", "SAMPLE_STRIDE", "sample_spans", "sample_digest"]

SAMPLE_BYTES = 4096  # one page: a cold read costs one request
SAMPLE_STRIDE = 64 << 20  # one sample per started 64 MiB of a tensor
_READERS = 16  # requests in flight: a cold network disk answers each in ~1 ms, a local NVMe in ~0.1 ms


def sample_spans(header: SafetensorsHeader) -> list[tuple[int, int]]:
    """``(offset, length)`` of every sample of the file, absolute, in the order their bytes are digested (tensors
    by name, then sample index). Deterministic: the same header gives the same places on every machine."""
    spans: list[tuple[int, int]] = []
    for name in sorted(header.tensors):
        t = header.tensors[name]
        n = t.end - t.start
        if n <= SAMPLE_BYTES:
            if n:
                spans.append((t.start, n))
            continue
        for i in range(1 + (n - 1) // SAMPLE_STRIDE):
            h = int.from_bytes(hashlib.sha256(f"{name}\0{i}".encode()).digest()[:8], "little")
            spans.append((t.start + h % (n - SAMPLE_BYTES + 1), SAMPLE_BYTES))
    return spans


def sample_digest(path: Path, expected_header_sha256: str | None = None) -> tuple[str, str]:
    """``(header SHA-256, samples SHA-256)`` of the safetensors file ``path``, header and samples read from one open file.

    The header's digest is of the length prefix and the JSON (as the manifest's ``header_sha256``); the samples'
    is over the bytes of :func:`sample_spans`, concatenated. ``expected_header_sha256``: no sample is read when the
    header already differs (the digest returned is then empty).

    Raises:
        FileChangedError: the file was replaced, truncated or written while it was read.
        SafetensorsFormatError: not a safetensors file.
        OSError: unreadable.
    """
    with open(open_regular(path), "rb", buffering=0) as f:  # unbuffered: the header's reads take its bytes only
        fd = f.fileno()
        before = identity_of(os.fstat(fd))
        size = before[0]
        raw = read_header_bytes_of(f, size, path)
        header_sha = hashlib.sha256(raw).hexdigest()
        if expected_header_sha256 is not None and header_sha != expected_header_sha256:
            return header_sha, ""
        spans = sample_spans(parse_header(raw, size, path))
        with contextlib.suppress(AttributeError, OSError):  # no read-ahead: each sample is one page of a cold disk
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

        def read(span: tuple[int, int]) -> bytes:
            buf = bytearray(span[1])
            if pread_full(fd, memoryview(buf), span[0]) < span[1]:
                raise FileChangedError(0, "changed while it was read (it ends early)", str(path))
            return bytes(buf)

        digest = hashlib.sha256()
        with ThreadPoolExecutor(min(_READERS, max(1, len(spans)))) as pool:
            for chunk in pool.map(read, spans):
                digest.update(chunk)
        if identity_of(os.fstat(fd)) != before:
            raise FileChangedError(0, "changed while it was read", str(path))
        return header_sha, digest.hexdigest()
