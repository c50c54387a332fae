"""The greedy output projection: each row's most likely token, without the logits going to memory.

A greedy decode step ends with ``argmax(hidden @ lm_head^T)``: SmolLM2's output projection is a
[49,152 x 576] matrix, 57 MB in bf16, read whole every step to produce logits that are only ever
compared. Done as cuBLAS's GEMM then ``argmax.py``'s two launches, the logits (6 MB at 64 rows)
are written, read back, and the three kernels wait for one another. Here the projection's
programs compare their own tile of logits as they finish it:

* ``_head_argmax_kernel``: program (column tile, row tile) multiplies ``BLOCK_M`` hidden rows by
  ``BLOCK_N`` rows of the weight (K in chunks, on the tensor cores), rounds the products to the
  model's dtype as ``F.linear`` returns them, and keeps, for each row, the largest and its first
  column (or the first NaN): ``argmax.row_winners``, which ``argmax.py``'s part kernel applies
  to a chunk of logits;
* ``argmax.py``'s reduce kernel then compares a row's tile winners (one a tile).

The answer is ``argmax(F.linear(hidden, weight), dim=-1)`` computed with this kernel's own
products: the first index among equal maxima, the first NaN where there is one, 0 for a row of
-inf. Only the order in which a row's float32 products are summed differs from a GEMM library's,
so the bf16 logits may differ in their last bit, as any two GEMMs' may.

On an H100 (bf16, SmolLM2's 57 MB projection, in a CUDA graph) the two launches take 25.0, 25.3
and 27.2 us at 1, 16 and 64 rows, against 26.2, 28.3 and 32.8 for cuBLAS's GEMM and
``argmax.py``; the weights stream at about 2.3 TB/s either way, so what is saved is the logits'
round trip and a launch. In the engine's greedy decode steps (``profile_engine``, four rounds
alternating with the GEMM path, medians of the GPU time a step, these tiles four stages deep):
0.498 against 0.501 ms at one request, 0.864 against 0.876 at 64, the same at 16.

The projection is not launched with PDL: with each program asking the L2 cache for its weight
tile before waiting (as ``fused_linear.py``'s programs do), an H100's decode step was 40 us
slower at one request and 45 at 64: the prefetches double the requests of a read that already
streams at the memory's pace.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton import argmax as _argmax
from paged_attention.kernels.triton.common import check_triton_runs
from paged_attention.kernels.triton.fused_linear import tile_rows_cols
from paged_attention.utils import next_power_of_2


@triton.jit
def _head_argmax_kernel(h_ptr, w_ptr, val_ptr, idx_ptr, M, V, K,
                        stride_hm, stride_hk, stride_wv, stride_wk,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (column tile, row tile): logits of rows rm for vocabulary entries rn, compared at
    # once. Its winners go to val/idx [M, parts], parts = the column tiles (argmax.py's layout).
    pid_n = tl.program_id(0)
    parts = tl.num_programs(0)
    rm, rn, m_mask, n_mask, rows, cols = tile_rows_cols(M, V, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_mask = kk < K
        w = tl.load(w_ptr + cols[:, None] * stride_wv + kk[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        h = tl.load(h_ptr + rows[:, None] * stride_hm + kk[None, :] * stride_hk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if h.dtype == tl.float32:           # IEEE float32 products, as F.linear (not TF32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)

    # The logits as F.linear hands them back (rounded to the dtype), compared exactly: columns
    # past the vocabulary count as -inf, a NaN wins at its first column.
    x = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    top, at = _argmax.row_winners(tl.where(n_mask[None, :], x, -float("inf")), rn, V)
    tl.store(val_ptr + rows * parts + pid_n, top, mask=m_mask)
    tl.store(idx_ptr + rows * parts + pid_n, at, mask=m_mask)


class HeadConfig(NamedTuple):
    """Tiles of ``_head_argmax_kernel``: rows, vocabulary entries and K columns a program takes
    at a time (powers of two; ``BLOCK_M`` and ``BLOCK_N`` at least 16, tl.dot's least), and its
    launch options."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


MAX_ROWS = 64
"""The most hidden rows the projection takes here (``FusedLayerOps`` sends larger batches to the
GEMM library and ``argmax.py``): one row tile of 64 reads the weights once; beyond, the product
is large enough that a GEMM library's tensor-core kernels are the better tool."""

MAX_PARTS = 16384
"""The most column tiles a row may have: the reduce compares a row's winners in one tile."""


def takes(rows: int, vocab: int) -> bool:
    """Whether ``lm_head_argmax`` takes a projection of ``rows`` hidden rows onto ``vocab`` tokens
    with its default tiles."""
    return rows <= MAX_ROWS and triton.cdiv(vocab, default_config(max(rows, 1)).BLOCK_N) <= MAX_PARTS


def default_config(M: int) -> HeadConfig:
    """One row tile for up to 64 rows (every weight read once), 64 vocabulary entries and 64 K
    columns a step, three deep: the fastest of 24 tilings at 1, 16 and 64 rows on an H100
    (SmolLM2's bf16 projection, in a CUDA graph; the others within 1 to 15 us of it)."""
    return HeadConfig(min(MAX_ROWS, max(16, next_power_of_2(M))), 64, 64, 4, 3)


def _check_config(config: object) -> HeadConfig:
    if not isinstance(config, HeadConfig):
        raise TypeError(f"config must be a HeadConfig, got {args.type_name(config)}")
    for name, least in (("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16), ("num_warps", 1), ("num_stages", 1)):
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"config.{name} must be an int >= {least}, got {v!r}")
        if name != "num_stages" and v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v}")
    return config


def lm_head_argmax(hidden: torch.Tensor, weight: torch.Tensor, *, config: Optional[HeadConfig] = None
                   ) -> torch.Tensor:
    """``argmax(F.linear(hidden, weight), dim=-1)``, int64 ``[rows]``, in two launches and no logits.

    ``hidden`` ``[M, K]`` (at most ``MAX_ROWS`` rows), ``weight`` ``[V, K]`` (F.linear's layout):
    one float dtype, one device, any strides. ``config``: the tiles (``default_config(M)`` if
    None)."""
    args.tensor("hidden", hidden, ndim=2, dtypes=args.FLOAT_DTYPES)
    args.tensor("weight", weight, ndim=2, dtypes=args.FLOAT_DTYPES)
    args.same_device(hidden=hidden, weight=weight)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    M, K = hidden.shape
    V = weight.size(0)
    if weight.size(1) != K:
        raise ValueError(f"weight must be [V, K={K}] (F.linear's layout), got {list(weight.shape)}")
    if K == 0 or V == 0:
        raise ValueError(f"the projection needs K >= 1 and V >= 1 (an empty row has no argmax), got K={K}, V={V}")
    if M > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows go through this kernel, got {M}")
    config = _check_config(config if config is not None else default_config(M))
    parts = triton.cdiv(V, config.BLOCK_N)
    if parts > MAX_PARTS:
        raise ValueError(f"a vocabulary of {V} is {parts} tiles of {config.BLOCK_N}: at most {MAX_PARTS} fit the "
                         f"reduce; use a larger BLOCK_N")
    check_triton_runs("the tensors are", hidden)
    out = torch.empty(M, dtype=torch.int64, device=hidden.device)
    if M:
        val = torch.empty(M, parts, dtype=torch.float32, device=hidden.device)
        idx = torch.empty(M, parts, dtype=torch.int32, device=hidden.device)
        _head_argmax_kernel[(parts, triton.cdiv(M, config.BLOCK_M))](
            hidden, weight, val, idx, M, V, K, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
            num_warps=config.num_warps, num_stages=config.num_stages)
        _argmax._argmax_reduce_kernel[(M,)](val, idx, out, parts, BLOCK=max(2, next_power_of_2(parts)),
                                           num_warps=4, PDL=False)
    return out


__all__ = ["HeadConfig", "MAX_PARTS", "MAX_ROWS", "default_config", "lm_head_argmax", "takes"]
