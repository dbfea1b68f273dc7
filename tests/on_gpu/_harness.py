"""The GPU tests' name for the engine harness, :mod:`marlin_pack.testing.engine_harness` (shared with the benchmarks).

The test modules import it as ``from _harness import ...``: tests/on_gpu has no ``__init__.py``,
so pytest puts this folder on ``sys.path``. Everything lives in the harness module (the engine
subprocess runs it as ``python -m marlin_pack.testing.engine_harness engine SPEC.json``); this
file only re-exports its public names. Importing it imports neither vLLM nor torch.
"""

from __future__ import annotations

from marlin_pack.testing.engine_harness import *  # noqa: F403
from marlin_pack.testing.engine_harness import __all__  # noqa: F401
