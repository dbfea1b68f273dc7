"""Bytes from files into GPU memory: torch or ctypes on the CUDA driver, never vLLM.

``plan`` decides how a bundle reaches the GPU (in-process staged or registered copies, or copy helper
processes) once, from plain facts; ``reader`` obeys that plan; ``host_map`` gives a file's bytes as CPU
tensors; ``helpers`` starts and drives the copy helper processes, ``helper_main`` is one such process
and ``helper_protocol`` the lines both sides speak.
"""
