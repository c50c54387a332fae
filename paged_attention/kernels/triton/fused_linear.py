"""A projection with the residual add and RMSNorm fused in front of it, and SwiGLU behind it.

At a small batch a decode step is latency-bound: each of a layer's four GEMMs takes about four
microseconds in cuBLAS whatever its size, though its weights (0.4 to 3.5 MB for SmolLM2-135M) are
read in well under one, and the norm and the SwiGLU product are launches of their own. Here the
work between two projections becomes one kernel:

* ``norm_linear(x, norm_weight, weight, eps, residual)``: ``linear(rms_norm(x + residual), W)``.
  Every program recomputes the norm of its own rows (a hidden size of 576 is a few kilobytes):
  that costs a re-read from the L2 cache, and saves the launch of a separate norm;
* ``act="silu_and_mul"``: the gate/up projection with SwiGLU as its epilogue: each program
  computes the gate and the up columns of the same indices and writes only ``silu(gate) * up``,
  so the ``[tokens, 2 * intermediate]`` product never goes to memory;
* ``linear_add(x, weight, residual)``: a projection that ends a sub-layer (o_proj, down_proj)
  with the residual add as its epilogue. Each program also sums the squares of the stream it
  stores over its own columns and stores that piece: the next ``norm_linear(sum_sq=...)`` adds a
  row's pieces (a handful of floats) instead of reading the row twice, so no norm launch is left
  between two projections: with the rotary embedding and the cache write in the decode attention
  kernel, a small-batch decode layer is five launches (four projections, the attention);
* ``linear(x, weight)``: the same kernel without the norm, a plain small-M GEMM.

``pdl=True`` launches any of them early where the GPU has programmatic dependent launch
(``pdl.py``): a program reads its weight tile, asks the L2 cache for the rest of its weights, and
only then waits for the kernel before it, whose output it reads next. For a caller whose previous
kernel writes none of the weights (a model's step).

``benchmarks/bench_fused_linear.py`` measures each against the unfused operations (norm kernel,
cuBLAS, SwiGLU kernel), and a whole layer both ways (``--layer``).

What makes it fast at a few rows is reading everything once, in one go, on many programs:

* one pass over K. A program loads its weight tile first (the longest wait), then its rows of
  the stream, computes the norm from those registers and multiplies: with ``BLOCK_K >= K`` (576
  here) nothing is read twice and no loop waits on the one before. Tiles are powers of two, so
  a K of 576 is one chunk of 1024, 44% of it masked, or two unpadded ones read together
  (``BLOCK_K2``: 512 + 64), which is what the tuned tiles of 16 to 64 rows take for QKV. A
  larger K goes on in chunks, and then the stream is read again (sum of squares first, then the
  product);
* no padding to tensor-core tiles. ``tl.dot`` multiplies 16 rows at least: for one token that is
  15 rows of zeros, and a detour through shared memory. Below 16 rows the product runs on the CUDA
  cores instead (``_mma``): a broadcast multiply and a sum over K, in the registers the loads
  filled;
* narrow column tiles (4 to 16 columns at one row), so that a hundred programs or more share the
  weights' read across the GPU's SMs.

The arithmetic is that of the unfused path (``layer_ops.add_rms_norm`` then ``F.linear`` then
``layer_ops.silu_and_mul``), rounding for rounding: the sum rounded to the model's dtype, the norm
in float32, the normalised value rounded before the weight multiply and the product rounded, a
float32 accumulation (on the tensor cores or the CUDA cores alike: each product exact in float32
for 16-bit inputs, one IEEE rounding for float32 ones), the GEMM's outputs rounded to the dtype
before SwiGLU, silu rounded before the product. Only the order of the float32 sums differs, so
results agree to a float32 rounding before the last cast.

The residual stream. ``add_rms_norm`` stores ``x + residual`` back into ``residual``. Here many
programs (one per tile of output columns) read the same rows of ``residual``, and no program can
wait for the others: if one of them wrote the sum in place, another could still be about to read
the old value, and would add twice. So the sum goes to a new tensor, written once (by the programs
of the first column tile), and the front-end returns it as the stream; ``residual`` is only read.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from paged_attention.kernels import args
from paged_attention.kernels.triton import pdl as _pdl
from paged_attention.kernels.triton.common import check_triton_runs
from paged_attention.utils import next_power_of_2


@triton.jit
def tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of an ``[M, N]`` output that program (column tile, row tile) computes:
    ``(rm, rn, m_mask, n_mask, rows, cols)``, indices, in-range masks and the indices as int64
    offsets (a GEMM's program prologue; ``lm_head.py``'s kernel shares it)."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, rm < M, rn < N, rm.to(tl.int64), rn.to(tl.int64)


@triton.jit
def _load_stream(x_ptr, residual_ptr, rows, row_mask, k, K, stride_xm, stride_xk, stride_rm, stride_rk,
                 HAS_RESIDUAL: tl.constexpr):
    """Columns ``k`` of rows ``rows`` of the stream: ``x + residual`` rounded to x's dtype (as
    torch's add is), or ``x`` itself. Out-of-range rows and columns read as 0."""
    mask = row_mask[:, None] & (k < K)[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_rm + k[None, :] * stride_rk, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def _load_weight(weight_ptr, cols, col_mask, k, K, stride_wn, stride_wk, BLOCK_M: tl.constexpr):
    """The weight tile: element (n, k) is ``weight[cols[n], k]``, 0 outside; ``[BLOCK_N, BLOCK_K]``,
    or ``[1, BLOCK_N, BLOCK_K]`` for a product with 2 to 8 rows (see ``_mma``: loaded in that shape,
    the load's layout is the product's, and the tile needs no reshuffle through shared memory)."""
    if BLOCK_M > 1 and BLOCK_M < 16:
        mask = col_mask[None, :, None] & (k < K)[None, None, :]
        return tl.load(weight_ptr + cols[None, :, None] * stride_wn + k[None, None, :] * stride_wk, mask=mask,
                       other=0.0)
    else:
        mask = col_mask[:, None] & (k < K)[None, :]
        return tl.load(weight_ptr + cols[:, None] * stride_wn + k[None, :] * stride_wk, mask=mask, other=0.0)


@triton.jit
def _normalise(h, inv_rms, norm_weight):
    """The GEMM's input: the stream in float32 times its row's ``1 / rms``, rounded to the dtype,
    times the norm weight, rounded again (as ``add_rms_norm`` does)."""
    y = (h.to(tl.float32) * inv_rms[:, None]).to(h.dtype).to(tl.float32)
    return (y * norm_weight.to(tl.float32)[None, :]).to(h.dtype)


@triton.jit
def _mma(a, w, acc, BLOCK_M: tl.constexpr):
    """``acc + a @ w^T`` in float32, ``a`` ``[BLOCK_M, BLOCK_K]``, ``w`` the weight tile.

    From 16 rows on the tensor cores (``tl.dot``; ``w`` ``[BLOCK_N, BLOCK_K]``); float32 inputs
    multiply in IEEE float32, as F.linear does (by default tl.dot would round them to TF32 on the
    GPU). Below 16 rows on the CUDA cores, which spares padding a few rows to tl.dot's 16: every
    product in float32 (exact for 16-bit inputs, one IEEE rounding for float32 ones), summed over
    K; one row against ``w`` ``[BLOCK_N, BLOCK_K]``, several against ``w`` ``[1, BLOCK_N, BLOCK_K]``.
    """
    if BLOCK_M >= 16:
        if a.dtype == tl.float32:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(w), acc)
    elif BLOCK_M == 1:
        return acc + tl.sum(a.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
    else:
        return acc + tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32), axis=2)


@triton.jit
def swiglu_rounded(acc, acc_up, dtype: tl.constexpr):
    """``silu(gate) * up`` from the gate and up projections' float32 sums, rounded as the unfused
    path rounds: each projection's output to the dtype, silu to the dtype, then the product."""
    gate = acc.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def residual_added(result, r, dtype: tl.constexpr):
    """``(result + r, sums)``: the residual added as the unfused path adds it (in float32, rounded
    once, as torch's add), and each row's squares of that sum, summed in float32 (zeros outside
    the tile add nothing): the next norm's piece for this tile's columns."""
    out = (result.to(tl.float32) + r.to(tl.float32)).to(dtype)
    outf = out.to(tl.float32)
    return out, tl.sum(outf * outf, axis=1)


@triton.jit(do_not_specialize=["M"])     # one compiled kernel for every token count
def _fused_linear_kernel(x_ptr, residual_ptr, norm_weight_ptr, weight_ptr, out_ptr, stream_ptr,
                         sum_sq_ptr, add_ptr, sums_out_ptr, prefetch_ptr,
                         M, N, K, eps, num_sums,
                         stride_xm, stride_xk, stride_rm, stride_rk, stride_nw, stride_wn, stride_wk,
                         stride_sm, stride_sk, stride_am, stride_an,
                         HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_AND_MUL: tl.constexpr,
                         NORM_FROM_SUMS: tl.constexpr, BLOCK_S: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_K2: tl.constexpr, PDL: tl.constexpr, PREFETCH_NUMEL: tl.constexpr):
    # Program (column tile, row tile): output columns rn of rows rm. out is [M, N] contiguous;
    # weight row n holds output column n's K coefficients (F.linear's [N, K]); with SwiGLU, weight
    # is [2N, K]: the gate's row n, then the up projection's row N + n. NORM_FROM_SUMS: the rows'
    # sums of squares come in pieces (sum_sq [M, num_sums], a linear_add's), not from a first pass
    # over x. ADD_RESIDUAL: the output is the projection plus add_ptr's [M, N], and each program
    # stores its rows' sums of squares over its columns (sums_out [M, column tiles], contiguous).
    # BLOCK_K2 > 0: a second first chunk, K columns [BLOCK_K, BLOCK_K + BLOCK_K2), loaded with the
    # first (a K of 576 as 512 + 64: all of it read before the wait, no padding to 1024).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm, rn, m_mask, n_mask, rows, cols = tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    k = tl.arange(0, BLOCK_K)

    # The first K chunk (all of K when BLOCK_K >= K: then everything is read once). The weight
    # tiles first, the longest wait; the stream's rows and the norm are worked out meanwhile.
    w = _load_weight(weight_ptr, cols, n_mask, k, K, stride_wn, stride_wk, BLOCK_M)
    if SILU_AND_MUL:
        w_up = _load_weight(weight_ptr + N * stride_wn, cols, n_mask, k, K, stride_wn, stride_wk, BLOCK_M)
    if HAS_NORM:
        norm_w = tl.load(norm_weight_ptr + k * stride_nw, mask=k < K, other=0.0)
    if BLOCK_K2 > 0:
        k2 = BLOCK_K + tl.arange(0, BLOCK_K2)
        w2 = _load_weight(weight_ptr, cols, n_mask, k2, K, stride_wn, stride_wk, BLOCK_M)
        if SILU_AND_MUL:
            w2_up = _load_weight(weight_ptr + N * stride_wn, cols, n_mask, k2, K, stride_wn, stride_wk, BLOCK_M)
        if HAS_NORM:
            norm_w2 = tl.load(norm_weight_ptr + k2 * stride_nw, mask=k2 < K, other=0.0)
    # Launched with PDL, this kernel may be running before the previous one has finished: the
    # weights are no kernel's output, everything below (the stream, its sums) is. The K chunks
    # after the first are asked of the L2 cache meanwhile, for the loop below to find there (by
    # the first row tile's programs: the others read the same weights). PREFETCH_NUMEL > 0: the
    # programs also ask for that many elements at prefetch_ptr (a later kernel's weights), each
    # program its share.
    if PDL:
        if pid_m == 0:
            _pdl.prefetch_rows(weight_ptr, cols, n_mask, BLOCK_K + BLOCK_K2, K, stride_wn, stride_wk, STEP=32)
            if SILU_AND_MUL:
                _pdl.prefetch_rows(weight_ptr + N * stride_wn, cols, n_mask, BLOCK_K + BLOCK_K2, K, stride_wn, stride_wk,
                                   STEP=32)
        if PREFETCH_NUMEL > 0:
            _pdl.prefetch_share(prefetch_ptr, PREFETCH_NUMEL, pid_m * tl.num_programs(0) + pid_n,
                                tl.num_programs(0) * tl.num_programs(1))
    _pdl.wait(PDL)
    _pdl.launch_dependents(PDL)
    a = _load_stream(x_ptr, residual_ptr, rows, m_mask, k, K, stride_xm, stride_xk, stride_rm, stride_rk,
                     HAS_RESIDUAL)
    if BLOCK_K2 > 0:
        a2 = _load_stream(x_ptr, residual_ptr, rows, m_mask, k2, K, stride_xm, stride_xk, stride_rm, stride_rk,
                          HAS_RESIDUAL)

    if HAS_NORM and NORM_FROM_SUMS:
        # The stream is x itself, and its rows' sums of squares were summed in pieces by the kernel
        # that wrote it: add the pieces up, no pass over x.
        s = tl.arange(0, BLOCK_S)
        pieces = tl.load(sum_sq_ptr + rows[:, None] * stride_sm + s[None, :] * stride_sk,
                         mask=m_mask[:, None] & (s < num_sums)[None, :], other=0.0)
        inv_rms = 1.0 / tl.sqrt(tl.sum(pieces, axis=1) / K + eps)
        a = _normalise(a, inv_rms, norm_w)
        if BLOCK_K2 > 0:
            a2 = _normalise(a2, inv_rms, norm_w2)
    elif HAS_NORM:
        # Each row's sum of squares; the programs of the first column tile also store the stream
        # (x + residual) into the new stream tensor, [M, K] contiguous.
        store_rows = m_mask & (tl.zeros([BLOCK_M], dtype=tl.int32) + pid_n == 0)
        af = a.to(tl.float32)
        sum_sq = tl.sum(af * af, axis=1)
        if HAS_RESIDUAL:
            tl.store(stream_ptr + rows[:, None] * K + k[None, :], a, mask=store_rows[:, None] & (k < K)[None, :])
        if BLOCK_K2 > 0:
            a2f = a2.to(tl.float32)
            sum_sq += tl.sum(a2f * a2f, axis=1)
            if HAS_RESIDUAL:
                tl.store(stream_ptr + rows[:, None] * K + k2[None, :], a2,
                         mask=store_rows[:, None] & (k2 < K)[None, :])
        for k0 in range(BLOCK_K + BLOCK_K2, K, BLOCK_K):   # the rest of the rows, if any
            kk = k0 + k
            h = _load_stream(x_ptr, residual_ptr, rows, m_mask, kk, K, stride_xm, stride_xk, stride_rm, stride_rk,
                             HAS_RESIDUAL)
            hf = h.to(tl.float32)
            sum_sq += tl.sum(hf * hf, axis=1)
            if HAS_RESIDUAL:
                tl.store(stream_ptr + rows[:, None] * K + kk[None, :], h,
                         mask=store_rows[:, None] & (kk < K)[None, :])
        inv_rms = 1.0 / tl.sqrt(sum_sq / K + eps)
        a = _normalise(a, inv_rms, norm_w)
        if BLOCK_K2 > 0:
            a2 = _normalise(a2, inv_rms, norm_w2)

    acc = _mma(a, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_M)
    if SILU_AND_MUL:
        acc_up = _mma(a, w_up, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), BLOCK_M)
    if BLOCK_K2 > 0:
        acc = _mma(a2, w2, acc, BLOCK_M)
        if SILU_AND_MUL:
            acc_up = _mma(a2, w2_up, acc_up, BLOCK_M)

    # The other K chunks, if any: the stream read again (from the cache), normalised on the way in.
    for k0 in range(BLOCK_K + BLOCK_K2, K, BLOCK_K):
        kk = k0 + k
        w = _load_weight(weight_ptr, cols, n_mask, kk, K, stride_wn, stride_wk, BLOCK_M)
        if SILU_AND_MUL:
            w_up = _load_weight(weight_ptr + N * stride_wn, cols, n_mask, kk, K, stride_wn, stride_wk, BLOCK_M)
        a = _load_stream(x_ptr, residual_ptr, rows, m_mask, kk, K, stride_xm, stride_xk, stride_rm, stride_rk,
                         HAS_RESIDUAL)
        if HAS_NORM:
            norm_w = tl.load(norm_weight_ptr + kk * stride_nw, mask=kk < K, other=0.0)
            a = _normalise(a, inv_rms, norm_w)
        acc = _mma(a, w, acc, BLOCK_M)
        if SILU_AND_MUL:
            acc_up = _mma(a, w_up, acc_up, BLOCK_M)

    dtype = x_ptr.dtype.element_ty
    if SILU_AND_MUL:
        result = swiglu_rounded(acc, acc_up, dtype)
    else:
        result = acc.to(dtype)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:
        # The projection rounded to the dtype, then the residual added; the squares of what is
        # stored, over this program's columns, are the next norm's pieces.
        r = tl.load(add_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an, mask=out_mask, other=0.0)
        result, sums = residual_added(result, r, dtype)
        tl.store(sums_out_ptr + rows * tl.num_programs(0) + pid_n, sums, mask=m_mask)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], result, mask=out_mask)


# --------------------------------------------------------------------------------------------
# Meta-parameters
# --------------------------------------------------------------------------------------------

class FusedLinearConfig(NamedTuple):
    """The kernel's tile sizes and launch options, powers of two. ``BLOCK_M`` rows a program: from
    16 on, the product runs on the tensor cores (``tl.dot``, whose smallest tile is 16 x 16 x 16:
    then ``BLOCK_N`` >= 16 too), below 16 on the CUDA cores (any ``BLOCK_N``). ``BLOCK_K`` (>= 16):
    K in chunks of that many; at least K, the stream and the weights are read once. ``BLOCK_K2``
    (0, or a power of two >= 16): a second chunk of that many read with the first, before the
    wait, so that a K which is not a power of two is read whole without padding (576 as 512 +
    64); the chunks after those two, if any, are ``BLOCK_K`` long."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3
    BLOCK_K2: int = 0


CUDA_CORE_ROWS = 4
"""Up to this many rows, ``default_config``'s rule takes the CUDA-core product (``_mma``)."""

PDL_ROWS = 64
"""Up to this many rows a model's layer takes these kernels where they launch with PDL (measured:
``FusedLayerOps``'s docstring); without PDL, up to ``CUDA_CORE_ROWS``."""

TUNED: dict[tuple[int, int, bool], dict[int, FusedLinearConfig]] = {
    (960, 576, False): {
        1: FusedLinearConfig(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
        2: FusedLinearConfig(BLOCK_M=2, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
        4: FusedLinearConfig(BLOCK_M=4, BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=1),
        8: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=1),
        16: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=1, BLOCK_K2=64),
        32: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=1, BLOCK_K2=64),
        64: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=1, BLOCK_K2=64),
        128: FusedLinearConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    },
    (1536, 576, True): {
        1: FusedLinearConfig(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1),
        2: FusedLinearConfig(BLOCK_M=2, BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1),
        4: FusedLinearConfig(BLOCK_M=4, BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=1),
        8: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
        16: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=1, BLOCK_K2=64),
        32: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=1, BLOCK_K2=64),
        64: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3),
        128: FusedLinearConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    },
    (576, 576, False): {
        1: FusedLinearConfig(BLOCK_M=1, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
        2: FusedLinearConfig(BLOCK_M=2, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
        4: FusedLinearConfig(BLOCK_M=4, BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
        8: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=1),
        16: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=1),
        32: FusedLinearConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=1, BLOCK_K2=64),
        64: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
        128: FusedLinearConfig(BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
    },
    (576, 1536, False): {
        1: FusedLinearConfig(BLOCK_M=1, BLOCK_N=8, BLOCK_K=2048, num_warps=8, num_stages=1),
        2: FusedLinearConfig(BLOCK_M=2, BLOCK_N=2, BLOCK_K=2048, num_warps=4, num_stages=1),
        4: FusedLinearConfig(BLOCK_M=4, BLOCK_N=2, BLOCK_K=2048, num_warps=8, num_stages=1),
        8: FusedLinearConfig(BLOCK_M=8, BLOCK_N=2, BLOCK_K=2048, num_warps=8, num_stages=1),
        16: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
        32: FusedLinearConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
        64: FusedLinearConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
        128: FusedLinearConfig(BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=3),
    },
}
"""Measured best tiles, ``{(N, K, silu_and_mul): {M: config}}``, for the shapes a model runs:
SmolLM2-135M's four projections as the model calls them (QKV and gate-up normalising a stream
from a ``linear_add``'s sums of squares; o_proj and down as ``linear_add``), measured by
``benchmarks/bench_fused_linear.py --sweep`` on an NVIDIA H200 (bf16, in CUDA graphs, each call
reading its own layer's weights from memory, as in a model's step, and launched with PDL, as the
model launches them). The entries of 1 to 4 rows are those of the sweep before PDL: the PDL sweep's
own were at most 0.7 us faster, and another tile sums a row's products in another order, which is
enough to turn a greedy token (in notebook 08, a tight pool's outputs then differed from a roomy
one's, where these give the same).
Four entries were then chosen in the engine's own decode steps (``profile_engine``, SmolLM2 shape,
each change against the table before it, alternating, on the H200): QKV and o_proj at 8 and 16
rows with K in one chunk on 8 warps (GPU time a step -7% at 8 requests, -6% at 16; at 32 rows
and 64 the same tiles were slower), and down_proj at 64 rows with 32 columns a program (-1.5%).
Six entries read all of K before the wait in two unpadded chunks (``BLOCK_K2``, 512 + 64), chosen
on an H100 (each faster alone, ``bench_fused_linear.py``; then in the engine's decode steps,
``profile_engine``, against the table before them, alternating): QKV at 16, 32 and 64 rows,
gate-up at 16 and 32, o_proj at 32 (GPU time a step -12% at 16 requests, -13% at 32, -7% at 64;
at 64 rows the same for gate-up, o_proj or down was slower, alone or in the engine). Then
down_proj at 64 rows loads four chunks ahead instead of three (in the engine, on an H100, against
the table before it, alternating: GPU time a step 0.870/0.873 ms against 0.884/0.890; other
stage counts and tiles for gate-up and down at 64 rows were no faster, or slower).
``default_config`` takes the entry of the smallest measured M at or above the token count;
shapes and token counts not in it get the rule."""


def default_config(M: int, N: int, K: int, silu_and_mul: bool = False) -> FusedLinearConfig:
    """Tiles for ``M`` rows (the token count), ``N`` output columns, ``K`` inputs: ``TUNED``'s if
    it has the shape, else by rule.

    A decode step of a few requests is latency-bound: the kernel should read everything in one
    go and spread the weights' read over the whole GPU. So, up to ``CUDA_CORE_ROWS`` rows: one row
    tile, the CUDA-core product, K whole up to 2048 (one pass: the norm from the same registers),
    and column tiles narrow enough to make about a hundred programs or more (an H100 has 132
    SMs), fewer columns still if the product tile (rows x columns x K) would pass 16K elements
    (then 8 warps hold it, else 4). Above: tl.dot on 16-row tiles, K in pipelined chunks of 64.
    """
    tuned = TUNED.get((N, K, bool(silu_and_mul)))
    if tuned:
        measured = [m for m in tuned if m >= M]
        if measured:
            return tuned[min(measured)]
    if M <= CUDA_CORE_ROWS:
        block_m = next_power_of_2(M)
        block_k = min(2048, max(16, next_power_of_2(K)))
        block_n = 16
        while block_n > 4 and triton.cdiv(N, block_n) < 100:
            block_n //= 2
        while block_n > 1 and block_m * block_n * block_k > 16384:
            block_n //= 2
        num_warps = 4 if block_m * block_n * block_k <= 8192 else 8
        return FusedLinearConfig(block_m, block_n, block_k, num_warps, 1)
    return FusedLinearConfig(16, 16 if M <= 16 else 32, 64, 4, 3)


def _check_config(config: object) -> FusedLinearConfig:
    if not isinstance(config, FusedLinearConfig):
        raise TypeError(f"config must be a FusedLinearConfig, got {args.type_name(config)}")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"):
        v = getattr(config, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"config.{name} must be a positive int, got {v!r}")
    k2 = config.BLOCK_K2
    if not isinstance(k2, int) or isinstance(k2, bool) or (k2 and (k2 < 16 or k2 & (k2 - 1))):
        raise ValueError(f"config.BLOCK_K2 must be 0 or a power of two >= 16, got {k2!r}")
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"):
        v = getattr(config, name)
        if v & (v - 1):
            raise ValueError(f"config.{name} must be a power of two, got {v!r}")
    if config.BLOCK_K < 16:
        raise ValueError(f"config.BLOCK_K must be at least 16, got {config.BLOCK_K}")
    if config.BLOCK_M >= 16 and config.BLOCK_N < 16:
        raise ValueError(f"with BLOCK_M >= 16 (tl.dot) BLOCK_N must be at least 16, got {config.BLOCK_N}")
    return config


# --------------------------------------------------------------------------------------------
# Front-ends
# --------------------------------------------------------------------------------------------

ACTIVATIONS = (None, "silu_and_mul")


def _check(x: object, weight: object, norm_weight: object, residual: object, act: object
           ) -> tuple[int, int, int]:
    """Typed errors for anything the kernel cannot run, before any launch: ``(M, N, K)``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    tensors = {"x": x, "weight": weight}
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if residual is not None:
        tensors["residual"] = residual
    args.same_device(**tensors)
    args.tensor("x", x, ndim=2, dtypes=args.FLOAT_DTYPES)
    args.tensor("weight", weight, ndim=2)
    M, K = x.shape
    for name, t in tensors.items():
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    if K == 0:
        raise ValueError("x must have at least one column (the hidden size)")
    if weight.size(1) != K:
        raise ValueError(f"weight must be [N, K={K}] (F.linear's layout), got {list(weight.shape)}")
    if act == "silu_and_mul" and weight.size(0) % 2:
        raise ValueError(f"with act='silu_and_mul', weight holds the gate rows then as many up rows: an even "
                         f"number of rows, got {weight.size(0)}")
    if norm_weight is not None:
        args.shape("norm_weight", norm_weight, (K,))
    if residual is not None:
        args.shape("residual", residual, (M, K))
    check_triton_runs("the tensors are", x)
    N = weight.size(0) // 2 if act == "silu_and_mul" else weight.size(0)
    return M, N, K


def _check_sum_sq(sum_sq: object, x: torch.Tensor, residual: object) -> None:
    """A ``linear_add``'s pieces of the stream's sums of squares: float32 ``[M, pieces]``, on x's device."""
    if residual is not None:
        raise ValueError("with sum_sq, x is the whole stream: pass no residual")
    args.tensor("sum_sq", sum_sq, ndim=2, dtypes=(torch.float32,))
    args.same_device(x=x, sum_sq=sum_sq)
    if sum_sq.size(0) != x.size(0) or sum_sq.size(1) < 1:
        raise ValueError(f"sum_sq must be [M={x.size(0)}, pieces >= 1] (a linear_add's), got {list(sum_sq.shape)}")


def _pieces_block(pieces: int) -> int:
    """The tile that loads a row's sums-of-squares pieces: a power of two, at least 2 (Triton 3.6's
    interpreter cannot reduce a tile of one)."""
    return max(2, next_power_of_2(pieces))


def _launch(x, weight, norm_weight, residual, eps, act, config, M, N, K, sum_sq=None, add=None, pdl_on=False):
    silu = act == "silu_and_mul"
    config = _check_config(config if config is not None else default_config(M, N, K, silu))
    out = x.new_empty(M, N)
    stream = x.new_empty(M, K) if residual is not None else x
    sums_out = torch.empty(M, triton.cdiv(N, config.BLOCK_N), dtype=torch.float32, device=x.device) \
        if add is not None else None
    if M and N:
        r = residual if residual is not None else x
        nw = norm_weight if norm_weight is not None else x
        sq = sum_sq if sum_sq is not None else out
        ad = add if add is not None else x
        grid = (triton.cdiv(N, config.BLOCK_N), triton.cdiv(M, config.BLOCK_M))
        _fused_linear_kernel[grid](
            x, r, nw, weight, out, stream, sq, ad, sums_out if sums_out is not None else out, x,
            M, N, K, float(eps), sum_sq.size(1) if sum_sq is not None else 1,
            x.stride(0), x.stride(1), r.stride(0), r.stride(1), nw.stride(0), weight.stride(0), weight.stride(1),
            sq.stride(0), sq.stride(1), ad.stride(0), ad.stride(1),
            HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, SILU_AND_MUL=silu,
            NORM_FROM_SUMS=sum_sq is not None,
            BLOCK_S=_pieces_block(sum_sq.size(1) if sum_sq is not None else 1), ADD_RESIDUAL=add is not None,
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, BLOCK_K2=config.BLOCK_K2,
            PREFETCH_NUMEL=0, num_warps=config.num_warps, num_stages=config.num_stages,
            **_pdl.launch_options(pdl_on and _pdl.enabled(x.device)))
    elif sums_out is not None:
        sums_out.zero_()                        # no columns: every row's sum is 0
    return out, stream, sums_out


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None, *, act: str | None = None,
                config: FusedLinearConfig | None = None, sum_sq: torch.Tensor | None = None,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual) * norm_weight, weight), x + residual)`` in one launch.

    ``x``, ``residual``: ``[M, K]``; ``norm_weight``: ``[K]``; ``weight``: ``[N, K]`` (F.linear's),
    or with ``act="silu_and_mul"`` ``[2N, K]`` (gate rows, then up rows) and the output is
    ``silu(gate) * up``, ``[M, N]``. All of one dtype and device; any strides. The output and the
    new stream are new contiguous tensors; ``residual`` is left as it was (see the module
    docstring). Without ``residual`` (a model's first layer) only the norm, and the stream
    returned is ``x`` itself. ``config``: tile sizes, ``default_config(M, N, K)`` if None.

    ``sum_sq``: ``x``'s rows' sums of squares in pieces (float32 ``[M, pieces]``, what
    ``linear_add`` returns with the stream it wrote): the norm adds the pieces up instead of
    reading ``x`` twice (no ``residual`` then: ``x`` is the whole stream).
    """
    M, N, K = _check(x, weight, norm_weight, residual, act)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if sum_sq is not None:
        _check_sum_sq(sum_sq, x, residual)
    return _launch(x, weight, norm_weight, residual, eps, act, config, M, N, K, sum_sq=sum_sq,
                   pdl_on=args.flag("pdl", pdl))[:2]


def linear(x: torch.Tensor, weight: torch.Tensor, *, act: str | None = None,
           config: FusedLinearConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` (``x`` ``[M, K]``, ``weight`` ``[N, K]``, one dtype, any strides) by
    the same kernel without the norm, for a small M; with ``act="silu_and_mul"`` (weight ``[2N, K]``)
    ``silu(gate) * up``. A float32 accumulation, the output in x's dtype."""
    M, N, K = _check(x, weight, None, None, act)
    return _launch(x, weight, None, None, 0.0, act, config, M, N, K, pdl_on=args.flag("pdl", pdl))[0]


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, *,
               config: FusedLinearConfig | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(x, weight) + residual, sum_sq)`` in one launch: a projection that ends a
    sub-layer (o_proj, down_proj) with the residual add as its epilogue.

    ``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``residual`` ``[M, N]``: one dtype, any strides. The
    sum is the new residual stream (a new contiguous tensor), rounded as torch rounds
    ``residual + F.linear(x, weight)``. ``sum_sq`` (float32 ``[M, cdiv(N, BLOCK_N)]``): each row's
    squares of that stream summed over each program's columns, which the next ``norm_linear``
    takes as ``sum_sq=`` and adds up, so the norm costs no launch and no second pass over the
    stream. The pieces are stored, not added atomically, so the result does not depend on the
    order in which programs finish.
    """
    M, N, K = _check(x, weight, None, None, None)
    args.tensor("residual", residual, ndim=2)
    args.same_device(x=x, residual=residual)
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    args.shape("residual", residual, (M, N))
    out, _, sums = _launch(x, weight, None, None, 0.0, None, config, M, N, K, add=residual,
                           pdl_on=args.flag("pdl", pdl))
    return out, sums


__all__ = ["FusedLinearConfig", "TUNED", "default_config", "norm_linear", "linear", "linear_add"]
