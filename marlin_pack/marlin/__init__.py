"""vLLM's Marlin layout (the same in every release served), as pure functions over plain facts.

``sharding``: which checkpoint modules vLLM fuses into one layer and what each tensor-parallel
rank holds of it. ``rank_tensors``: the tensors of one layer on one rank (their specs, how to
build them, how to decode them). ``repack``: the tensor transforms themselves. No vLLM import.
"""
