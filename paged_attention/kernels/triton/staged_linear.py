"""Small-batch projections whose weights wait in shared memory before the kernel before them ends.

``fused_linear``'s kernel, launched with programmatic dependent launch (``pdl.py``), reads its
first chunk of weights before it waits for the kernel before it; the rest of its K loop runs after
the wait, one chunk of weights and activations at a time. At 16 to 64 token rows that loop is a
third to a half of a projection's time: with down_proj's K halved (timing only) a 64-request
decode step of SmolLM2 was 1.7 us a layer shorter, with gate_up's 1.8, of ~5.3 each (H100). Triton puts a pipelined loop's
loads where it likes, after whatever precedes the loop, the wait included, so a Triton kernel
cannot have its weights on the chip when the wait ends.

Gluon, Triton's lower-level language (``triton.experimental.gluon``), lets a kernel say where each
copy goes and in which layout. Program (column tile, row tile) here:

1. before the wait, copies its whole weight slice, ``[BLOCK_N, K]`` rows of ``weight`` (and the up
   projection's rows with SwiGLU), into shared memory with ``cp.async``, which only issues the
   copies: they arrive while the previous kernel still runs;
2. waits (``griddepcontrol.wait``), lets the next kernel launch, and copies its ``[BLOCK_M, K]``
   rows of the activations (the previous kernel's output) into shared memory the same way;
3. with a norm, scales those rows in place (each thread the elements it copied);
4. multiplies from shared memory only: operands to registers in the tensor cores' layout
   (``ldmatrix``), ``mma.sync`` 16 x 8 x 16, float32 accumulators;
5. ends as ``fused_linear`` does: SwiGLU, or the residual add and the rows' sums of squares.

The arithmetic is ``fused_linear``'s: the same roundings, and the same float32 sums along K in
the same order (16 columns a ``mma.sync`` step either way), so without a norm the two give the same
bits (o_proj and down_proj on an H100). With a norm, its factor ``1 / rms`` adds the pieces of the
rows' sums of squares in an order each kernel's register layout decides: a last-bit difference
there can move an output by one rounding (a few hundred of SmolLM2's 61,440 QKV outputs at 64
rows in bfloat16). Shared memory holds the whole K, so the weights take
``BLOCK_N * K * 2`` bytes (twice with SwiGLU) and the rows ``16 * K * 2``: ``supported`` says
which shapes fit the device; others stay with ``fused_linear``. Buffers must be powers of two, so
K is split as ``K1 + K2`` (576 = 512 + 64, 1536 = 1024 + 512).

Gluon kernels do not run in Triton's interpreter: on a CPU the model keeps ``fused_linear``, and
``tests/test_pdl.py`` compiles this kernel for sm_90 there (``tests/pdl_ptx.py``) to check where
its copies and stores fall around the wait.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from paged_attention.kernels import args
from paged_attention.kernels.triton import pdl as _pdl
from paged_attention.kernels.triton.fused_linear import _normalise, residual_added, swiglu_rounded
from paged_attention.utils import cdiv

# Names that moved between the Triton releases in use (3.6 on the GPU machine, 3.9 on the CPUs).
_async_load = cp.async_load if hasattr(cp, "async_load") else cp.async_copy_global_to_shared
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_wait = _pdl.gdc_wait
_launch_dependents = _pdl.gdc_launch_dependents

COPY = 64       # columns a copy (and a product) takes at a time: 8 threads x 8 16-bit elements
BLOCK_M = 16    # rows a program: the height of one mma.sync tile
_COPY = gl.constexpr(COPY)          # (the kernels read globals only as constexprs)
_BLOCK_M = gl.constexpr(BLOCK_M)


@gluon.jit
def _copy_rows(part1, part2, rows_ptr, mask, cols, K1: gl.constexpr, K2: gl.constexpr):
    """``cp.async`` of K columns of some rows (``rows_ptr``: each row's start) into two shared
    buffers, columns ``[0, K1)`` and ``[K1, K1 + K2)``, ``COPY`` columns at a time."""
    for k0 in gl.static_range(0, K1, _COPY):
        _async_load(part1.slice(k0, _COPY, dim=1), rows_ptr + (k0 + cols)[None, :], mask=mask)
    if K2 > 0:
        for k0 in gl.static_range(0, K2, _COPY):
            _async_load(part2.slice(k0, _COPY, dim=1), rows_ptr + (K1 + k0 + cols)[None, :], mask=mask)


@gluon.jit
def _normalise_in_place(part, norm_weight_ptr, k_off, inv_rms, WIDTH: gl.constexpr, layout: gl.constexpr):
    """The stream's columns ``[k_off, k_off + WIDTH)`` in shared memory replaced by the GEMM's
    input: ``fused_linear._normalise`` of them (its roundings, the same Triton function)."""
    k = k_off + gl.arange(0, WIDTH, gl.SliceLayout(0, layout))
    part.store(_normalise(part.load(layout), inv_rms, gl.load(norm_weight_ptr + k)))


@gluon.jit
def _mma_part(acc, rows, weights, WIDTH: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr):
    """``acc + rows @ weights^T`` over one shared buffer's ``WIDTH`` columns, ``COPY`` at a time (the
    weights' ``[BLOCK_N, COPY]`` slice read transposed: the product's ``[K, N]`` operand)."""
    for k0 in gl.static_range(0, WIDTH, _COPY):
        a = rows.slice(k0, _COPY, dim=1).load(a_layout)
        b = weights.slice(k0, _COPY, dim=1).permute((1, 0)).load(b_layout)
        acc = mma_v2(a, b, acc)
    return acc


@gluon.jit
def _staged_linear_kernel(x_ptr, weight_ptr, norm_weight_ptr, sum_sq_ptr, add_ptr, out_ptr, sums_out_ptr,
                          M, eps, num_sums,
                          N: gl.constexpr, K: gl.constexpr, K1: gl.constexpr, K2: gl.constexpr,
                          BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, NUM_WARPS: gl.constexpr,
                          NORM: gl.constexpr, SILU_AND_MUL: gl.constexpr, ADD_RESIDUAL: gl.constexpr,
                          PDL: gl.constexpr):
    # x [M, K], weight [N, K] ([2N, K] with SwiGLU: gate rows, then up rows), out [M, N], all
    # contiguous. NORM: rms_norm with the rows' sums of squares given in num_sums pieces
    # (sum_sq [M, num_sums]). ADD_RESIDUAL: out = projection + add, and sums_out [M, column
    # tiles] gets each row's squares of out summed over this program's columns.
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    # Copies: 16 bytes (8 elements) a thread, 8 threads along a row's 64 columns, 4 rows a warp.
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    # Shared rows are K * 2 bytes long: without a swizzle every row would start in the same bank
    # and ldmatrix's eight rows would queue for it. XOR-ing each 16-byte vector's position with
    # the row (mod 8) spreads them over all banks.
    smem: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    # The product: mma.sync 16 x 8 tiles, the warps side by side along N.
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)

    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, copy_layout))
    rm = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, gl.SliceLayout(1, copy_layout))
    cols = gl.arange(0, _COPY, gl.SliceLayout(0, copy_layout))
    n_mask = (rn < N)[:, None] & (cols < _COPY)[None, :]
    m_mask = (rm < M)[:, None] & (cols < _COPY)[None, :]

    # 1. The weights, before the wait: no kernel of a model's step writes them.
    w1 = gl.allocate_shared_memory(dtype, [BLOCK_N, K1], smem)
    w2 = gl.allocate_shared_memory(dtype, [BLOCK_N, K2 if K2 > 0 else _COPY], smem)
    _copy_rows(w1, w2, weight_ptr + rn[:, None] * K, n_mask, cols, K1, K2)
    if SILU_AND_MUL:
        u1 = gl.allocate_shared_memory(dtype, [BLOCK_N, K1], smem)
        u2 = gl.allocate_shared_memory(dtype, [BLOCK_N, K2 if K2 > 0 else _COPY], smem)
        _copy_rows(u1, u2, weight_ptr + (N + rn)[:, None] * K, n_mask, cols, K1, K2)
    cp.commit_group()

    # 2. The rows: the previous kernel's output, after the wait.
    if PDL:
        _wait()
        _launch_dependents()
    x1 = gl.allocate_shared_memory(dtype, [_BLOCK_M, K1], smem)
    x2 = gl.allocate_shared_memory(dtype, [_BLOCK_M, K2 if K2 > 0 else _COPY], smem)
    _copy_rows(x1, x2, x_ptr + rm[:, None] * K, m_mask, cols, K1, K2)
    cp.commit_group()
    if NORM:
        # The rows' sums of squares, in pieces, while the copies fly.
        s = gl.arange(0, BLOCK_S, gl.SliceLayout(0, copy_layout))
        pieces = gl.load(sum_sq_ptr + rm[:, None] * num_sums + s[None, :],
                         mask=(rm < M)[:, None] & (s < num_sums)[None, :], other=0.0)
        inv_rms = 1.0 / gl.sqrt(gl.sum(pieces, axis=1) / K + eps)
    cp.wait_group(0)

    # 3. The norm, in place: each thread reads back what it copied (the copy's layout).
    if NORM:
        _normalise_in_place(x1, norm_weight_ptr, 0, inv_rms, K1, copy_layout)
        if K2 > 0:
            _normalise_in_place(x2, norm_weight_ptr, K1, inv_rms, K2, copy_layout)
    _barrier()          # every thread's copies (and norms) done before any warp reads them

    # 4. The products, from shared memory only.
    acc = gl.zeros([_BLOCK_M, BLOCK_N], gl.float32, mma)
    acc = _mma_part(acc, x1, w1, K1, a_layout, b_layout)
    if K2 > 0:
        acc = _mma_part(acc, x2, w2, K2, a_layout, b_layout)
    if SILU_AND_MUL:
        acc_up = gl.zeros([_BLOCK_M, BLOCK_N], gl.float32, mma)
        acc_up = _mma_part(acc_up, x1, u1, K1, a_layout, b_layout)
        if K2 > 0:
            acc_up = _mma_part(acc_up, x2, u2, K2, a_layout, b_layout)

    # 5. The epilogue: fused_linear's own helpers (Triton functions, which Gluon calls as they are,
    #    as step 3 calls its norm).
    rm_o = pid_m * _BLOCK_M + gl.arange(0, _BLOCK_M, gl.SliceLayout(1, mma))
    rn_o = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, mma))
    out_mask = (rm_o < M)[:, None] & (rn_o < N)[None, :]
    if SILU_AND_MUL:
        result = swiglu_rounded(acc, acc_up, dtype)
    else:
        result = acc.to(dtype)
    if ADD_RESIDUAL:
        r = gl.load(add_ptr + rm_o[:, None] * N + rn_o[None, :], mask=out_mask, other=0.0)
        result, sums = residual_added(result, r, dtype)
        gl.store(sums_out_ptr + rm_o * gl.num_programs(0) + pid_n, sums, mask=rm_o < M)
    gl.store(out_ptr + rm_o[:, None] * N + rn_o[None, :], result, mask=out_mask)


# --------------------------------------------------------------------------------------------
# Which shapes, and the front-end
# --------------------------------------------------------------------------------------------

class StagedConfig(NamedTuple):
    """A launch: ``BLOCK_N`` output columns a program (16 rows each), ``K = K1 + K2`` split into
    two power-of-two shared buffers, on ``num_warps`` warps."""
    BLOCK_N: int
    K1: int
    K2: int
    num_warps: int = 4


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def split_k(K: int) -> Optional[tuple[int, int]]:
    """``(K1, K2)``: K as a power of two plus 0 or a smaller power of two, both multiples of
    ``COPY`` (576 -> (512, 64)); None for other K."""
    if K < COPY or K % COPY:
        return None
    k1 = 1 << (K.bit_length() - 1)
    k2 = K - k1
    return (k1, k2) if k2 == 0 or k2 & (k2 - 1) == 0 else None


def supported(N: int, K: int, silu_and_mul: bool, dtype: torch.dtype, device: torch.device
              ) -> Optional[StagedConfig]:
    """The launch for an ``[N, K]`` projection (``[2N, K]`` weights with SwiGLU), or None where
    this kernel cannot take it: not a CUDA GPU of compute capability 8.0 or later (``cp.async``,
    ``mma.sync``), Triton's interpreter, a dtype other than float16/bfloat16, a K that is not
    ``split_k``'s, or weights and rows that do not fit the device's shared memory with 32 (else
    16) columns a program."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or N < 1:
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _capability(index) < (8, 0):
        return None
    parts = split_k(K)
    if parts is None:
        return None
    limit = _shared_memory_limit(index)
    k_buffers = parts[0] + max(parts[1], COPY)          # an unused second buffer is one COPY wide
    for block_n in (32, 16):
        if ((2 if silu_and_mul else 1) * block_n + BLOCK_M) * k_buffers * 2 <= limit:
            return StagedConfig(block_n, *parts)
    return None


def kernel_constants(N: int, K: int, config: StagedConfig, *, norm: bool, silu_and_mul: bool, add: bool,
                     num_sums: int, pdl_on: bool) -> dict:
    """The kernel's constant arguments (``PDL`` included) and launch options for one kind of launch."""
    return dict(N=N, K=K, K1=config.K1, K2=config.K2, BLOCK_N=config.BLOCK_N,
                BLOCK_S=max(2, 1 << (max(num_sums, 1) - 1).bit_length()), NUM_WARPS=config.num_warps,
                NORM=norm, SILU_AND_MUL=silu_and_mul, ADD_RESIDUAL=add, num_warps=config.num_warps,
                **_pdl.launch_options(pdl_on))


def launch_tensors(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                   sum_sq: torch.Tensor | None, add: torch.Tensor | None, N: int, config: StagedConfig
                   ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int], tuple[torch.Tensor, ...]]:
    """``(out, sums, grid, tensors)`` of one launch: its output ``[M, N]``, the rows' sums of squares
    in pieces (with ``add``, else None), the grid, and the kernel's seven tensor arguments in order,
    where an absent one's place is taken by a tensor the kernel then does not read."""
    M = x.size(0)
    out = x.new_empty(M, N)
    col_tiles = cdiv(N, config.BLOCK_N)
    sums = None if add is None else torch.empty(M, col_tiles, dtype=torch.float32, device=x.device)
    tensors = (x, weight, x if norm_weight is None else norm_weight, out if sum_sq is None else sum_sq,
               x if add is None else add, out, out if sums is None else sums)
    return out, sums, (col_tiles, cdiv(M, BLOCK_M)), tensors


def staged_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                  sum_sq: torch.Tensor | None = None, eps: float = 1e-6, act: str | None = None,
                  add: torch.Tensor | None = None, pdl: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, sums)``: ``fused_linear``'s projection with the weights staged in shared memory.

    ``out`` = ``linear(rms_norm(x) * norm_weight, weight)`` with ``norm_weight`` (the rows' sums
    of squares given as ``sum_sq`` pieces, float32 ``[M, pieces]``, as ``fused_linear.linear_add``
    returns them), else ``linear(x, weight)``; with ``act="silu_and_mul"`` (weight ``[2N, K]``)
    ``silu(gate) * up``; with ``add`` (``[M, N]``) the residual add, and then ``sums`` holds each
    row's squares of ``out`` in pieces (float32 ``[M, cdiv(N, BLOCK_N)]``; None without ``add``).

    Every tensor contiguous, on one CUDA device, in ``x``'s dtype (``sum_sq`` float32); the shape
    must be ``supported`` (a ``ValueError`` names what is not, before anything is launched).
    ``pdl=True``: launched with programmatic dependent launch where the GPU has it.
    """
    args.tensor("x", x, ndim=2)
    args.tensor("weight", weight, ndim=2)
    if act not in (None, "silu_and_mul"):
        raise ValueError(f"act must be None or 'silu_and_mul', got {act!r}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    silu = act == "silu_and_mul"
    M, K = x.shape
    if weight.size(1) != K or (silu and weight.size(0) % 2):
        raise ValueError(f"weight must be [{'2N' if silu else 'N'}, {K}] for x {list(x.shape)}, got {list(weight.shape)}")
    N = weight.size(0) // 2 if silu else weight.size(0)
    tensors = {"x": x, "weight": weight}
    if norm_weight is not None or sum_sq is not None:
        if norm_weight is None or sum_sq is None:
            raise ValueError("the norm needs both norm_weight and sum_sq (its rows' sums of squares in pieces)")
        args.tensor("norm_weight", norm_weight, ndim=1)
        args.shape("norm_weight", norm_weight, (K,))
        args.tensor("sum_sq", sum_sq, ndim=2, dtypes=(torch.float32,))
        if sum_sq.size(0) != M or sum_sq.size(1) < 1:
            raise ValueError(f"sum_sq must be float32 [{M}, pieces >= 1], got {list(sum_sq.shape)}")
        tensors.update(norm_weight=norm_weight, sum_sq=sum_sq)
    if add is not None:
        args.tensor("add", add, ndim=2)
        args.shape("add", add, (M, N))
        tensors["add"] = add
    args.same_device(**tensors)
    for name, t in tensors.items():
        if name != "sum_sq" and t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads whole rows), got strides {list(t.stride())}")
    config = supported(N, K, silu, x.dtype, x.device)
    if config is None:
        raise ValueError(f"staged_linear does not take a [{N}, {K}] projection in {x.dtype} on {x.device} "
                         f"(see supported: a CUDA GPU, 16-bit floats, K = a power of two (+ a smaller one), "
                         f"both multiples of {COPY}, within the shared memory)")
    norm = norm_weight is not None
    pdl_on = args.flag("pdl", pdl) and _pdl.enabled(x.device)
    out, sums, grid, tensors = launch_tensors(x, weight, norm_weight, sum_sq, add, N, config)
    if M:
        constants = kernel_constants(N, K, config, norm=norm, silu_and_mul=silu, add=add is not None,
                                     num_sums=sum_sq.size(1) if norm else 1, pdl_on=pdl_on)
        _staged_linear_kernel[grid](*tensors, M, float(eps), sum_sq.size(1) if norm else 1, **constants)
    return out, sums


__all__ = ["COPY", "BLOCK_M", "StagedConfig", "split_k", "supported", "kernel_constants", "launch_tensors",
           "staged_linear"]
