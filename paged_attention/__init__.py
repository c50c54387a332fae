"""paged-attention: a runnable reference for how vLLM manages the KV cache.

Importing the package decides the device (``runtime``) before any Triton kernel is defined, so
that on a machine without a GPU the kernels run in Triton's interpreter. Nothing else happens
at import time; the sections are imported on demand (``paged_attention.kernels.triton`` ...).
"""
from paged_attention import runtime  # noqa: F401  (first: sets TRITON_INTERPRET on a CPU)
from paged_attention.runtime import DEVICE, HAS_CUDA, TRITON_INTERPRET
from paged_attention.utils import PAD_SLOT_ID, Device, cdiv, chunk_list

__version__ = "0.1.0"

__all__ = [
    "DEVICE", "HAS_CUDA", "TRITON_INTERPRET", "PAD_SLOT_ID", "Device", "cdiv", "chunk_list",
    "__version__",
]
