"""Kernels that read and write a paged KV cache.

``reference`` (plain torch, runs anywhere) is the oracle; ``triton`` runs compiled on a GPU and
in Triton's interpreter on a CPU; ``cuda`` holds CUDA C++ kernels built on first use on a GPU.
"""
