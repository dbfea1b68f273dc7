"""Files on disk: safetensors headers and streaming writes, hashes and stamps, which files make a checkpoint,
and this user's home directory (``~`` in path settings).

No torch import at package import; nothing here knows about Marlin or vLLM.
"""
