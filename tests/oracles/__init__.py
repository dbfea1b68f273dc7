"""vLLM reference oracles: vLLM's own classes, run on the CPU, compute what a bundle must hold.

* ``oracles.vllm_reference``: dense AWQ/GPTQ/compressed-tensors Marlin linears, per TP rank.
* ``oracles.vllm_moe_reference``: mixture-of-experts checkpoints (routed experts on Marlin MoE).
* ``oracles.oracle_compare``: a bundle's rank files against them (shared by the exactness tests).

The tests of the oracles themselves (``test_vllm_reference.py``, ``test_vllm_moe_reference.py``)
live here too (as ``oracles.test_*``). Every test imports the oracles as ``from oracles.vllm_reference
import ...``: pytest's default ``prepend`` import mode puts ``tests/`` on ``sys.path`` (the folder of
``tests/conftest.py``, and the first folder above this package without an ``__init__.py``).
"""
