"""A tensor kept twice: on the host, where Python and numpy fill it cheaply, and on the device,
where kernels read it (``vllm/v1/utils.py``).

vLLM's model runner prepares its per-step inputs (block tables, slot mappings, positions) on
the CPU, through numpy, and then ships only the rows in use to the GPU with one asynchronous
copy. ``CpuGpuBuffer`` is that pattern as a small object:

* ``.cpu``  a zero tensor in host memory, page-locked ("pinned") when asked, so that the copy
  to the GPU can run asynchronously (the DMA engine needs memory the OS will not move);
* ``.np``   a numpy array over the *same* memory as ``.cpu`` (writing one writes the other);
* ``.gpu``  a zero tensor of the same shape and dtype on ``device``.

Nothing moves between ``.cpu`` and ``.gpu`` until ``copy_to_gpu`` (or ``copy_to_cpu``) is
called: the device copy is a snapshot taken at the last copy.

Without CUDA (a laptop, CI) the "GPU" side is simply a second CPU tensor and pinning is turned
off (pinned memory needs a CUDA driver); the semantics, two separate copies that only meet
when you copy, stay the same.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from paged_attention.utils import check_device, is_int


class CpuGpuBuffer:
    """A host tensor, its numpy view, and a device tensor of the same shape and dtype.

    ``CpuGpuBuffer(*size, dtype, device, pin_memory, with_numpy=True)``, as in vLLM:

    * ``size`` is the shape, given as separate ints (``CpuGpuBuffer(4, 8, ...)``), like
      ``torch.zeros``;
    * ``pin_memory=True`` pins ``.cpu`` when CUDA is available; on a machine without CUDA it is
      quietly turned off (``self.pin_memory`` then reads False) instead of failing;
    * ``with_numpy=False`` leaves out ``.np`` (accessing it then raises AttributeError, as in
      vLLM); bfloat16 needs it, since numpy has no bfloat16 (ValueError otherwise).
    """

    def __init__(self, *size: int, dtype: torch.dtype, device: Union[torch.device, str],
                 pin_memory: bool, with_numpy: bool = True) -> None:
        # One sequence argument is a shape too (torch.zeros((2, 3)) works the same way).
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        for n in size:
            if not is_int(n):
                raise TypeError(f"CpuGpuBuffer sizes must be ints, got {n!r} in {size!r}")
            if n < 0:
                raise ValueError(f"CpuGpuBuffer sizes must be >= 0, got {size!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if with_numpy and dtype == torch.bfloat16:
            raise ValueError("numpy has no bfloat16, so a bfloat16 CpuGpuBuffer cannot have a numpy view: "
                             "pass with_numpy=False")
        device = check_device("device", device)
        if not isinstance(pin_memory, (bool, np.bool_)):
            raise TypeError(f"pin_memory must be a bool, got {pin_memory!r}")

        # Pinning needs a CUDA driver; without one it is turned off rather than failing, so the
        # same code runs on a laptop.
        self.pin_memory: bool = bool(pin_memory) and torch.cuda.is_available()
        shape = tuple(int(n) for n in size)
        self.cpu: torch.Tensor = torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
        self.gpu: torch.Tensor = torch.zeros_like(self.cpu, device=device)
        self.np: np.ndarray
        if with_numpy:
            # A view, not a copy: self.np and self.cpu are the same bytes.
            self.np = self.cpu.numpy()

    # ---- Moving data ---------------------------------------------------------------------------
    def copy_to_gpu(self, n: Optional[int] = None) -> torch.Tensor:
        """Copy the host tensor to the device, all of it or only its first ``n`` rows (along
        dim 0), and return the device tensor or slice that was written.

        The copy is non-blocking: with pinned memory on a GPU it is queued on the current CUDA
        stream and the host may go on preparing the next step (kernels later queued on that
        stream see the data). Copying only the rows in use keeps the transfer small.
        """
        n = self._check_rows(n)
        if n is None:
            return self.gpu.copy_(self.cpu, non_blocking=True)
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)

    def copy_to_cpu(self, n: Optional[int] = None) -> torch.Tensor:
        """Copy the device tensor back to the host (all of it, or its first ``n`` rows) and
        return the host tensor or slice that was written.

        Non-blocking, as in vLLM: on a GPU the caller must synchronise (for instance
        ``torch.cuda.current_stream().synchronize()``) before reading ``.cpu`` or ``.np``.
        On the CPU the copy is done when the call returns.
        """
        n = self._check_rows(n)
        if n is None:
            return self.cpu.copy_(self.gpu, non_blocking=True)
        return self.cpu[:n].copy_(self.gpu[:n], non_blocking=True)

    def _check_rows(self, n: Optional[int]) -> Optional[int]:
        """``n`` must be None or a row count between 0 and the buffer's first dimension."""
        if n is None:
            return None
        if not is_int(n):
            raise TypeError(f"n must be an int or None, got {n!r}")
        if self.cpu.dim() == 0:
            raise ValueError("a 0-dimensional CpuGpuBuffer has no rows: call copy with n=None")
        if not 0 <= n <= self.cpu.shape[0]:
            raise ValueError(f"n must be between 0 and {self.cpu.shape[0]} (the buffer's rows), got {n}")
        return int(n)

    def __repr__(self) -> str:
        # Shape and dtype only: the same on every machine, so a notebook's output is too.
        return f"CpuGpuBuffer(shape={tuple(self.cpu.shape)}, dtype={self.cpu.dtype})"
