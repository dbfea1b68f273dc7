"""Helpers for tests, examples and benchmarks: ``synthetic`` writes small random AWQ/GPTQ checkpoints.

Not used by conversion or serving; ``synthetic.write_tokenizer`` needs the ``tokenizers``
package (the ``test`` extra).
"""
