"""GPU tests: pytest rewrites the asserts of the engine harness (shared helpers) as it does a test module's.

Without this, a failing assert in a shared helper (e.g. ``check_logprobs_close``) would
report a bare ``AssertionError`` instead of the compared values, as it did when the helpers
lived in the test modules. The helpers live in ``marlin_pack.testing.engine_harness`` (the test
modules import them through ``_harness``). The fixtures and the CUDA skip live in ``tests/conftest.py``.
"""

import pytest

pytest.register_assert_rewrite("_harness", "marlin_pack.testing.engine_harness")
