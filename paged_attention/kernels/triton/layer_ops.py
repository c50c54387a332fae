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


@triton.jit
def _rotary_and_cache_kernel(qkv_ptr, cos_sin_ptr, pos_ptr, slot_ptr, key_cache_ptr, value_cache_ptr,
                             qkv_stride, num_heads, num_kv_heads, block_size,
                             kc_stride_blk, kc_stride_tok, kc_stride_head,
                             vc_stride_blk, vc_stride_tok, vc_stride_head,
                             HALF: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr):
    # One program per token. Its row of qkv is [query heads | key heads | value heads], D = 2 * HALF
    # each. The queries turn in place (attention reads them from there); the keys turn on their way
    # into the cache and the values are copied there, at the token's slot (none for slot < 0).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + j)[None, :]
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + j)[None, :]
    row = qkv_ptr + t * qkv_stride
    h = tl.arange(0, HEADS)
    q_mask = (h < num_heads)[:, None]
    q = row + h[:, None] * (2 * HALF) + j[None, :]
    q1 = tl.load(q, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q, (q1 * cos - q2 * sin).to(qkv_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q + HALF, (q2 * cos + q1 * sin).to(qkv_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    kh = tl.arange(0, KV_HEADS)
    kv_mask = ((kh < num_kv_heads) & (tl.zeros([KV_HEADS], tl.int64) + slot >= 0))[:, None]
    k = row + (num_heads + kh[:, None]) * (2 * HALF) + j[None, :]
    k1 = tl.load(k, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    blk = slot // block_size
    off = slot % block_size
    kc = key_cache_ptr + blk * kc_stride_blk + off * kc_stride_tok + kh[:, None] * kc_stride_head + j[None, :]
    tl.store(kc, (k1 * cos - k2 * sin).to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc + HALF, (k2 * cos + k1 * sin).to(key_cache_ptr.dtype.element_ty), mask=kv_mask)
    v = row + (num_heads + num_kv_heads + kh[:, None]) * (2 * HALF) + j[None, :]
    vc = value_cache_ptr + blk * vc_stride_blk + off * vc_stride_tok + kh[:, None] * vc_stride_head + j[None, :]
    tl.store(vc, tl.load(v, mask=kv_mask), mask=kv_mask)
    tl.store(vc + HALF, tl.load(v + HALF, mask=kv_mask), mask=kv_mask)


def rotary_and_cache_(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The rotary embedding and the cache write in one launch: ``qkv`` ``[tokens, (heads + 2 *
    kv_heads) * D]`` (the fused projection's output, rows contiguous) has its query columns rotated
    in place; each token's rotated key and its value go to ``key_cache``/``value_cache`` (flash
    layout ``[num_blocks, block_size, kv_heads, D]``, any strides with a contiguous head) at its
    slot, none where the slot is negative. Returns the queries, ``[tokens, heads, D]``, a view of
    ``qkv``. The same arithmetic as ``rotary_`` followed by ``reshape_and_cache_flash``."""
    tokens = qkv.size(0) if qkv.dim() == 2 else -1
    dim = key_cache.size(-1) if key_cache.dim() == 4 else 0
    half = dim // 2
    if qkv.dim() != 2 or qkv.stride(1) != 1 or dim % 2 or half & (half - 1) or \
            qkv.size(1) != (num_heads + 2 * num_kv_heads) * dim:
        raise ValueError(f"rotary_and_cache_ needs qkv [tokens, (heads + 2 * kv_heads) * D] with contiguous rows "
                         f"and a head size of twice a power of two, got {tuple(qkv.shape)} with caches "
                         f"{tuple(key_cache.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.size(2) != num_kv_heads or key_cache.stride(3) != 1 \
            or value_cache.stride(3) != 1 or key_cache.dtype != qkv.dtype or value_cache.dtype != qkv.dtype:
        raise ValueError("rotary_and_cache_ needs key and value caches [num_blocks, block_size, kv_heads, D] "
                         "of qkv's dtype, with contiguous heads")
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1:] != (2, half) \
            or positions.shape != (tokens,) or slot_mapping.shape != (tokens,) \
            or (tokens > 1 and (positions.stride(0) != 1 or slot_mapping.stride(0) != 1)):
        raise ValueError("rotary_and_cache_ needs float32 cos_sin [positions, 2, D/2] and one position and one "
                         "slot per token (contiguous)")
    if tokens:
        _rotary_and_cache_kernel[(tokens,)](
            qkv, cos_sin, positions, slot_mapping, key_cache, value_cache, qkv.stride(0), num_heads, num_kv_heads,
            key_cache.size(1), *key_cache.stride()[:3], *value_cache.stride()[:3], HALF=half,
            HEADS=next_power_of_2(num_heads), KV_HEADS=next_power_of_2(num_kv_heads))
    return qkv[:, :num_heads * dim].view(tokens, num_heads, dim)
