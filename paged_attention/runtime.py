"""Where kernels run: one decision, made once, before any Triton kernel is defined.

On a machine with an NVIDIA GPU, tensors live on ``cuda`` and Triton compiles kernels for it.
On a machine without one (a laptop, CI), tensors live on the CPU and Triton runs its kernels in
its interpreter. The interpreter is chosen by the environment variable ``TRITON_INTERPRET=1``,
which Triton reads when ``@triton.jit`` decorates a function; so this module must be imported
before any module that defines a kernel. ``paged_attention/__init__.py`` imports it first.

Set ``PAGED_ATTENTION_DEVICE=cpu`` to take the CPU path on a GPU machine (for instance to see
what students without a GPU will see).
"""
from __future__ import annotations

import os
import platform

import torch

_ENV_DEVICE = "PAGED_ATTENTION_DEVICE"


def _choose_device() -> torch.device:
    wanted = os.environ.get(_ENV_DEVICE, "").strip().lower()
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{_ENV_DEVICE} must be 'cpu' or 'cuda', got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{_ENV_DEVICE}=cuda but torch sees no CUDA device")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


DEVICE: torch.device = _choose_device()
"""The device every notebook and test puts its tensors on."""

HAS_CUDA: bool = DEVICE.type == "cuda"
"""True when kernels run on a GPU (Triton compiled; CUDA sources can be built)."""

if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
    # Must happen before the first @triton.jit: Triton reads it at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
"""True when Triton kernels run in the interpreter (on NumPy, one program at a time)."""


def device_name() -> str:
    """A human-readable name of the compute device (GPU model, or the CPU's architecture)."""
    if HAS_CUDA:
        return torch.cuda.get_device_name(DEVICE)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def describe() -> dict[str, str]:
    """What this machine is and which software runs the kernels, for ``check`` and notebooks."""
    import triton  # imported late: after TRITON_INTERPRET has been decided above

    info = {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton mode": "interpreter (CPU)" if TRITON_INTERPRET else "compiled (GPU)",
        "python": platform.python_version(),
    }
    if HAS_CUDA:
        info["cuda"] = str(torch.version.cuda)
        major, minor = torch.cuda.get_device_capability(DEVICE)
        info["compute capability"] = f"{major}.{minor}"
    return info
