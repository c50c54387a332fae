"""Programmatic dependent launch (PDL): the next kernel starts while this one finishes.

A decode step on a small batch is a chain of short kernels, each waiting for the one before: a
kernel's programs are placed on the SMs only when its predecessor has finished, and then spend
their first microsecond waiting for the weights they read from memory. On Hopper (compute
capability 9.0) and later a kernel launched with PDL may start early, and each kernel splits in
two:

* before ``wait(PDL)``: reads of what no kernel of the step writes (a layer's weights), so that
  they are already on their way when the predecessor ends;
* ``wait(PDL)`` (``griddepcontrol.wait``): blocks until the previous kernel has completed and its
  writes are visible; everything that reads the previous kernel's output comes after it.

``launch_dependents(PDL)`` tells the GPU that the next kernel may be placed now. Where a kernel
calls it does not change what it computes (the next kernel's own ``wait`` still waits for this one
to complete); it only lets the next kernel's reads overlap this one's work. The kernels here call
it right after their ``wait``, so a kernel that starts early runs beside one kernel only, the one
just before it, and every earlier kernel has finished: before its ``wait`` a kernel may read
anything that one kernel does not write (weights; the step's lengths and block tables; the cache
of earlier tokens), and ``prefetch`` lines it will read later into the L2 cache. Everything it
writes comes after the ``wait`` (``tests/pdl_ptx.py`` checks the compiled code for that).

A kernel launched without PDL (cuBLAS, torch's) simply waits for its predecessor, as always, and a
PDL kernel after it starts when it ends. CUDA graphs keep these edges, so a captured decode step
replays with them.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
import triton
import triton.language as tl

try:    # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # pragma: no cover - an older Triton: no PDL
    gdc_launch_dependents = gdc_wait = None

_enabled = True


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a GPU of compute capability 9.0 or later,
    a Triton that has grid dependency control, not Triton's interpreter, and not switched off
    (``set_enabled(False)``, or ``PAGED_ATTENTION_PDL=0`` in the environment)."""
    if not _enabled or device.type != "cuda" or gdc_wait is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def set_enabled(on: bool) -> None:
    """Switch PDL on or off for kernels planned or launched from now on (an ablation's knob;
    plans and CUDA graphs made before keep the launches they were made with)."""
    global _enabled
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    _enabled = on


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """``with pdl.disabled():`` launches made inside go without PDL."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def launch_options(on: bool) -> dict:
    """A kernel's launch arguments for PDL on or off: its ``PDL`` constexpr (which compiles in its
    ``wait`` and ``launch_dependents``) and, when on, Triton's ``launch_pdl`` launch option."""
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if os.environ.get("PAGED_ATTENTION_PDL", "1") == "0":
    set_enabled(False)


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the previous kernel's completion (and see its writes), when launched with PDL."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel be placed on the GPU now, when launched with PDL."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch(ptrs, mask, base):
    """Ask the L2 cache for the lines at ``ptrs`` (where ``mask``; ``base``, an address in bounds,
    elsewhere) without waiting for them: a PDL kernel's way to have what it will read on its way
    while it waits for the previous kernel (``prefetch.global.L2``, a hint: no data comes back)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, base)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(ptr, rows, row_mask, start, length, stride_row, stride_col, STEP: tl.constexpr):
    """``prefetch`` elements ``[start, length)`` of rows ``rows`` (where ``row_mask``) of a matrix
    at ``ptr``, every ``STEP``-th column (a 64-byte sector's worth or less)."""
    c = tl.arange(0, STEP)
    for c0 in range(start, length, STEP * STEP):
        cols = c0 + c * STEP
        prefetch(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
                 row_mask[:, None] & (cols < length)[None, :], ptr)


@triton.jit
def prefetch_share(ptr, NUMEL: tl.constexpr, pid, num_programs):
    """``prefetch`` program ``pid``'s share of ``NUMEL`` contiguous elements at ``ptr`` (a later
    kernel's weights), the ``num_programs`` programs of a launch together covering them: its
    64-byte sectors pid * 128 + i, then num_programs * 128 further on, ... (the programs' vectors
    interleave, so that together they sweep the region from its start)."""
    STEP: tl.constexpr = 512 // ptr.dtype.element_ty.primitive_bitwidth       # elements a sector
    SECTORS: tl.constexpr = (NUMEL + STEP - 1) // STEP
    lane = tl.arange(0, 128)
    for first in range(pid * 128, SECTORS, num_programs * 128):
        sector = first + lane
        prefetch(ptr + sector.to(tl.int64) * STEP, sector < SECTORS, ptr)


__all__ = ["enabled", "set_enabled", "disabled", "launch_options", "wait", "launch_dependents", "prefetch", "prefetch_rows",
           "prefetch_share"]
