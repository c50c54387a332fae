"""What the Triton attention kernels share: finding and reading keys and values through a block
table (``kv_position``, ``load_kv_tile``), the base-2 scale (``LOG2E``), the reach of a strided
cache (``span``) and what Triton cannot run here (``check_triton_runs``: a CPU tensor without the
interpreter, and the one dtype the interpreter cannot run, ``check_triton_dtype``). The decode
and the prefill kernels both import these; neither imports the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_attention.kernels import KernelUnavailable

LOG2E = 1.4426950408889634
"""log2(e): scores are kept in base 2 (``exp2`` is the GPU's native instruction), so the query
scale is multiplied by it; the softmax is unchanged by the change of base."""


@triton.jit
def kv_position(table, bt_stride_b, n, n_mask, BLOCK_SIZE: tl.constexpr, OFFSETS_64: tl.constexpr):
    """Where token positions ``n`` of a sequence sit in the cache, through its block table: token
    n is in physical block ``table[n // BLOCK_SIZE]``, at row ``n % BLOCK_SIZE``. Returns ``(block,
    row)``. In a cache of 2^31 elements or more, ``block * block_stride`` needs 64 bits
    (``OFFSETS_64``)."""
    block = tl.load(table + (n // BLOCK_SIZE) * bt_stride_b, mask=n_mask, other=0)
    row = n % BLOCK_SIZE
    if OFFSETS_64:
        block = block.to(tl.int64)
        row = row.to(tl.int64)
    return block, row


@triton.jit
def load_kv_tile(k_head, v_head, table, bt_stride_b, n, n_mask, d, d_mask,
                 k_stride_blk, k_stride_tok, v_stride_blk, v_stride_tok,
                 BLOCK_SIZE: tl.constexpr, OFFSETS_64: tl.constexpr):
    """The keys and values of token positions ``n`` of one KV head, read through the block table
    (``kv_position``). Shared by the decode and the prefill kernels."""
    block, row = kv_position(table, bt_stride_b, n, n_mask, BLOCK_SIZE=BLOCK_SIZE, OFFSETS_64=OFFSETS_64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + block[:, None] * k_stride_blk + row[:, None] * k_stride_tok + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_head + block[:, None] * v_stride_blk + row[:, None] * v_stride_tok + d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


def span(t: torch.Tensor) -> int:
    """One past the largest element offset a tensor view reaches from its first element (a cache
    that reaches 2^31 or more needs 64-bit offsets)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def check_triton_runs(what: str, t: torch.Tensor) -> None:
    """ValueError unless Triton can run on ``t``'s device (a GPU, or any device under the
    interpreter; ``what`` names the tensors in the message), then ``check_triton_dtype``."""
    if t.device.type != "cuda":
        from paged_attention import runtime
        if not runtime.TRITON_INTERPRET:
            raise ValueError(f"{what} on {t.device.type}, but Triton compiles for the GPU here: move them to cuda")
    check_triton_dtype(t)


def check_triton_dtype(t: torch.Tensor) -> None:
    """Triton's interpreter has no bf16 arithmetic (compiled Triton has): there, bf16 input is
    something this implementation cannot run."""
    if t.dtype == torch.bfloat16 and t.device.type != "cuda":
        raise KernelUnavailable("Triton's interpreter (on a CPU) has no bfloat16 arithmetic; use float32 or "
                                "float16 here, or paged_attention.kernels.reference")
