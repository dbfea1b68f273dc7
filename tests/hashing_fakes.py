"""A BLAKE3 whose hashers call back after each buffer they hash: a test changes a file *while* it is hashed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3


class HookedBlake3:
    """Stands for ``blake3.blake3`` (``monkeypatch.setattr(blake3, "blake3", HookedBlake3(after))``): each hasher
    it makes hashes as the real one, then calls ``after(len(buffer))`` once the buffer's bytes were hashed."""

    def __init__(self, after: Callable[[int], None]) -> None:
        self.after, self.real = after, blake3.blake3
        self.AUTO = blake3.blake3.AUTO

    def __call__(self, *args: object, **kwargs: object) -> object:
        hook, h = self.after, self.real(*args, **kwargs)

        class Hasher:
            def update(self, data: Any) -> None:
                h.update(data)
                hook(len(data))

            def hexdigest(self) -> str:
                return h.hexdigest()

        return Hasher()
