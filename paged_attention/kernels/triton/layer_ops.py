"""Small fused kernels for the model's layers: the residual add with RMSNorm, RoPE, and SwiGLU's
``silu(gate) * up``.

Not paged attention, but what a decode step spends its launches on. Written out in torch, one
layer's norm is six kernels and its rotary embedding ten; a 30-layer decode step launched some
1,300 kernels, and even replayed from a CUDA graph each costs about two microseconds. These
kernels do the same arithmetic, in the same order and precision as the torch lines in
``model/llama.py`` (which the tests compare them with), in one launch each.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_attention.utils import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per token row. With a residual: h = x + residual (rounded to the model's dtype,
    # as torch's add is) is written back into residual, the stream the next layer adds to.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32))
        h = h.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * hidden + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / hidden + eps)
    # Normalise in float32, round to the dtype, then scale by the weight (Hugging Face's order).
    y = (hf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x + residual)`` (``rms_norm(x)`` without one); the sum is stored into
    ``residual`` in place. ``x``, ``residual``: contiguous ``[tokens, hidden]``; ``weight`` ``[hidden]``."""
    if x.dim() != 2 or not x.is_contiguous() or (residual is not None and (
            residual.shape != x.shape or not residual.is_contiguous() or residual.dtype != x.dtype)):
        raise ValueError("add_rms_norm takes contiguous [tokens, hidden] tensors of one shape and dtype")
    out = torch.empty_like(x)
    if x.size(0):
        _add_rms_norm_kernel[(x.size(0),)](x, residual if residual is not None else x, weight, out, x.size(1),
                                           float(eps), HAS_RESIDUAL=residual is not None,
                                           BLOCK=next_power_of_2(x.size(1)))
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_sin_ptr, pos_ptr, row_stride, num_heads,
                   HALF: tl.constexpr, HEADS: tl.constexpr):
    # One program per token: every head of the token turns by the same angles. Dimension j < D/2
    # pairs with j + D/2 (rotate-half). cos_sin is [positions, 2, D/2]: cos then sin.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    h = tl.arange(0, HEADS)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + j)[None, :]
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + j)[None, :]
    mask = (h < num_heads)[:, None]
    base = x_ptr + t * row_stride + h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, D]`` in place by each token's position (float32 maths).
    ``x`` may be a view with any token stride (the query and key columns of the fused QKV
    output) but each token's heads must be contiguous; ``cos_sin`` ``[max_position, 2, D/2]`` float32."""
    tokens, heads, dim = x.shape
    if dim % 2 or (dim // 2) & (dim // 2 - 1):
        raise ValueError(f"rotary_ needs a head size of twice a power of two, got {dim}")
    if x.stride(2) != 1 or x.stride(1) != dim or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() \
            or cos_sin.shape[1:] != (2, dim // 2) or positions.shape != (tokens,):
        raise ValueError("rotary_ needs x [tokens, heads, D] with contiguous heads, float32 cos_sin "
                         "[positions, 2, D/2] and one position per token")
    if tokens:
        _rotary_kernel[(tokens,)](x, cos_sin, positions, x.stride(0), heads, HALF=dim // 2,
                                  HEADS=next_power_of_2(heads))
    return x


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    # Program (token, column block). A row of x is [gate | up], each ``inter`` wide.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Torch rounds silu(gate) to the dtype before the product: so do we.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` = ``[tokens, 2 * intermediate]`` contiguous, gate columns
    first (the fused gate/up projection's output): ``[tokens, intermediate]``, in one launch."""
    if x.dim() != 2 or x.size(1) % 2 or not x.is_contiguous():
        raise ValueError(f"silu_and_mul takes a contiguous [tokens, 2 * intermediate] tensor, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    inter = x.size(1) // 2
    out = torch.empty(x.size(0), inter, dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(inter))
    if x.size(0):
        _silu_and_mul_kernel[(x.size(0), triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out
