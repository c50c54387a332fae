"""Greedy sampling's argmax: each row's index of its largest logit, in two small launches.

A greedy decode step ends with ``logits.argmax(dim=-1)`` over ``[requests, vocabulary]``
(SmolLM2: 49,152 columns). The logits were just written by the output projection and sit in the
L2 cache, so the work is one read of a few megabytes; what costs is waiting for it. Leaving
torch's reduction out of an H100 decode step of 64 requests saved 14 us of GPU time. Here the
read is spread over many programs, each reading its part of a row in one go:

* ``_argmax_part_kernel``: program (row, part) reads ``CHUNK`` columns and keeps their largest
  value and its first index;
* ``_argmax_reduce_kernel``: program ``row`` compares its parts' winners (a dozen numbers).

The answer is torch's, ties included: the first index of the largest value, and a row holding a
NaN answers the first NaN's index (torch orders NaN above every number); a row of -inf answers 0.
Values are compared as they are stored (bf16 logits with equal bf16 values are a tie).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton import pdl as _pdl
from paged_attention.kernels.triton.common import check_triton_runs

CHUNK = 4096
"""The columns one program reads (a power of two): SmolLM2's row is 12 parts, so 64 rows are 768
programs, all on the GPU at once."""

MAX_PARTS = 65535
"""The most parts a row may have (a CUDA grid's second dimension)."""


@triton.jit
def row_winners(x, cols, V):
    """Each row's winner in a float32 tile ``x`` ``[rows, columns]`` whose columns are ``cols``
    (those at ``V`` or past it, padding, hold -inf): ``(value, column)``, the largest value and
    the first column holding it, or NaN and the first NaN's column (torch's order: NaN above
    every number). A row of -inf answers its first real column: -inf == -inf too."""
    nan = x != x
    nan_at = tl.min(tl.where(nan, cols[None, :], V), axis=1)
    x = tl.where(nan, -float("inf"), x)
    top = tl.max(x, axis=1)
    at = tl.min(tl.where(x == top[:, None], cols[None, :], V), axis=1)
    has_nan = nan_at < V
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_at, at)


@triton.jit
def _argmax_part_kernel(x_ptr, val_ptr, idx_ptr, V, stride_m, stride_v, CHUNK: tl.constexpr, PDL: tl.constexpr):
    # Program (row, part): columns [part * CHUNK, (part + 1) * CHUNK) of the row, as a tile of
    # one row. Its winner (row_winners) goes to val/idx [rows, parts].
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    _pdl.launch_dependents(PDL)
    c = part * CHUNK + tl.arange(0, CHUNK)
    mask = c < V
    x = tl.load(x_ptr + row * stride_m + c.to(tl.int64) * stride_v, mask=mask, other=-float("inf"))
    top, at = row_winners(x.to(tl.float32)[None, :], c, V)     # float32: exact for every float input
    at_part = row * parts + part + tl.zeros([1], tl.int64)
    tl.store(val_ptr + at_part, top)
    tl.store(idx_ptr + at_part, at)


@triton.jit
def _argmax_reduce_kernel(val_ptr, idx_ptr, out_ptr, parts, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # Program row: the parts' winners, in column order. A NaN part wins (the first such part
    # holds the row's first NaN); else the largest value, and among equal ones the first part.
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    _pdl.wait(PDL)
    mask = p < parts
    v = tl.load(val_ptr + row * parts + p, mask=mask, other=-float("inf"))
    i = tl.load(idx_ptr + row * parts + p, mask=mask, other=2**31 - 1)
    nan = v != v
    nan_at = tl.min(tl.where(nan, i, 2**31 - 1), axis=0)
    v = tl.where(nan, -float("inf"), v)
    top = tl.max(v, axis=0)
    at = tl.min(tl.where(mask & (v == top), i, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, tl.where(nan_at < 2**31 - 1, nan_at, at).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D float tensor (any strides), int64 ``[rows]``."""
    args.tensor("logits", logits, ndim=2, dtypes=args.FLOAT_DTYPES)
    M, V = logits.shape
    if V == 0:
        raise ValueError("logits must have at least one column: an empty row has no argmax")
    check_triton_runs("logits are", logits)
    # Tiles of at least 2 (Triton's interpreter cannot reduce a tile of one). A grid's second
    # dimension holds at most 65,535 parts: 268 million columns of 4,096.
    chunk = max(2, min(CHUNK, triton.next_power_of_2(V)))
    parts = triton.cdiv(V, chunk)
    if parts > MAX_PARTS:
        raise ValueError(f"logits have {V} columns: at most {MAX_PARTS * chunk} fit the kernel's grid")
    out = torch.empty(M, dtype=torch.int64, device=logits.device)
    if M:
        val = torch.empty(M, parts, dtype=torch.float32, device=logits.device)
        idx = torch.empty(M, parts, dtype=torch.int32, device=logits.device)
        pdl_on = _pdl.enabled(logits.device)
        _argmax_part_kernel[(M, parts)](logits, val, idx, V, logits.stride(0), logits.stride(1), CHUNK=chunk,
                                        PDL=pdl_on, num_warps=4)
        _argmax_reduce_kernel[(M,)](val, idx, out, parts, BLOCK=max(2, triton.next_power_of_2(parts)),
                                    num_warps=1, **_pdl.launch_options(pdl_on))
    return out


__all__ = ["argmax", "row_winners", "CHUNK", "MAX_PARTS"]
