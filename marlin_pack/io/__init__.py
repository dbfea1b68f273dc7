"""Files on disk: safetensors headers and streaming writes, hashes and stamps, which files make a checkpoint.

No torch import at package import; nothing here knows about Marlin or vLLM.
"""
