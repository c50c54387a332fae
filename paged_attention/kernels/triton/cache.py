"""Triton ``reshape_and_cache_flash``: scatter new tokens' keys and values into their slots.

Every step of a model, each new token's key and value vectors (``[num_heads, head_size]`` each)
must be stored in the slot the scheduler gave it. The slot mapping says where: slot ``s`` is
offset ``s % block_size`` of physical block ``s // block_size``. One program handles a few
tokens; for each it reads the slot, and copies the ``[num_heads, head_size]`` tile of keys and
of values to the cache, unless the slot is negative (a padding token).

The caches are flash layout ``[num_blocks, block_size, num_heads, head_size]`` with any strides,
so the same kernel writes NHD memory (heads inside a token) and HND memory (tokens inside a
head): only the strides passed in differ. The keys, values and slot mapping may be strided views
too (a slice of a fused qkv tensor, every other slot of a longer mapping): every tensor is
addressed through its own strides, except that a head's elements must be contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_attention.kernels import KernelUnavailable, args
from paged_attention.kernels.triton.launch import Launcher, cached_plan, check_planned, tensor_signature


@triton.jit
def _reshape_and_cache_flash_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_tokens, slot_stride,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h,
    kc_stride_blk, kc_stride_tok, kc_stride_head,
    vc_stride_blk, vc_stride_tok, vc_stride_head,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A [BLOCK_H, BLOCK_D] tile covers one token's heads x head dims (padded to powers of two).
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    in_tile = (h < NUM_HEADS) & (d < HEAD_SIZE)
    for i in range(TOKENS_PER_PROGRAM):
        t = tl.program_id(0) * TOKENS_PER_PROGRAM + i
        # Tokens past the end, and padding tokens (slot < 0), load and store nothing.
        slot = tl.load(slot_mapping_ptr + t * slot_stride, mask=t < num_tokens, other=-1).to(tl.int64)
        mask = in_tile & (tl.full([BLOCK_H, BLOCK_D], 0, tl.int64) + slot >= 0)
        blk = slot // BLOCK_SIZE    # physical block
        off = slot % BLOCK_SIZE     # token's row inside that block
        # Source: token t's heads; the head dimension is contiguous (unit stride).
        k = tl.load(key_ptr + t * key_stride_t + h * key_stride_h + d, mask=mask)
        v = tl.load(value_ptr + t * value_stride_t + h * value_stride_h + d, mask=mask)
        # Destination: cache[blk, off, h, d], placed by the cache's own strides (NHD or HND).
        tl.store(key_cache_ptr + blk * kc_stride_blk + off * kc_stride_tok + h * kc_stride_head + d, k, mask=mask)
        tl.store(value_cache_ptr + blk * vc_stride_blk + off * vc_stride_tok + h * vc_stride_head + d, v, mask=mask)


class CacheWritePlan:
    """``reshape_and_cache_flash`` checked once for one set of shapes, strides and dtypes; ``run``
    takes tensors like the planned ones (new contents, e.g. the next step's keys, another layer's
    cache) and only launches. See ``DecodePlan`` for the idea."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, *, check_slots: bool = True) -> None:
        args.check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                           k_scale, v_scale, check_slots=check_slots)
        if kv_cache_dtype not in args.UNQUANTIZED_KV_DTYPES:
            raise KernelUnavailable(f"the Triton reshape_and_cache_flash writes unquantized caches only "
                                    f"(kv_cache_dtype 'auto'); got {kv_cache_dtype!r}: use kernels.reference or "
                                    f"kernels.cuda")
        check_triton_dtype(key)
        args.unit_last_stride(key=key, value=value)
        self.signature = tuple(map(tensor_signature, (key, value, key_cache, value_cache, slot_mapping)))
        # The bytes a cache and an input span (their shapes and strides are the plan's), and the
        # gaps between two caches whose spans meet but were found to share no element.
        self._cache_bytes = max(args.byte_range(key_cache)[1] - key_cache.data_ptr(), 1)
        self._input_bytes = max(args.byte_range(t)[1] - t.data_ptr() for t in (key, value))
        self._gaps_apart: set[int] = set()
        num_blocks, block_size, num_heads, head_size = key_cache.shape
        self.num_tokens = num_tokens = slot_mapping.size(0)
        tokens_per_program = 1 if key.is_cuda else 16   # the interpreter pays per program: batch tokens
        self._grid = (triton.cdiv(num_tokens, tokens_per_program),)
        self._write = Launcher(
            _reshape_and_cache_flash_kernel, ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr",
                                              "slot_mapping_ptr"),
            num_tokens=num_tokens, slot_stride=slot_mapping.stride(0),
            key_stride_t=key.stride(0), key_stride_h=key.stride(1),
            value_stride_t=value.stride(0), value_stride_h=value.stride(1),
            kc_stride_blk=key_cache.stride(0), kc_stride_tok=key_cache.stride(1), kc_stride_head=key_cache.stride(2),
            vc_stride_blk=value_cache.stride(0), vc_stride_tok=value_cache.stride(1),
            vc_stride_head=value_cache.stride(2),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size, TOKENS_PER_PROGRAM=tokens_per_program,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_size))

    def run(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            slot_mapping: torch.Tensor) -> None:
        """Write the tokens; each tensor must match the plan (``ValueError`` if not). The slots are
        not checked again."""
        tensors = (key, value, key_cache, value_cache, slot_mapping)
        check_planned("CacheWritePlan", ("key", "value", "key_cache", "value_cache", "slot_mapping"), tensors,
                      self.signature)
        self._check_apart(key, value, key_cache, value_cache)
        self._launch(*tensors)

    def _check_apart(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor) -> None:
        """The caches of a run must share memory with nothing else passed (the same tensor as
        both would have the values overwrite the keys): the plan's signatures fix shapes and
        strides, not where the tensors are. Where every span lies apart, the usual case, this
        costs four pointer reads."""
        kc, vc, k, v = key_cache.data_ptr(), value_cache.data_ptr(), key.data_ptr(), value.data_ptr()
        cb, ib = self._cache_bytes, self._input_bytes
        inputs_apart = not (kc - ib < k < kc + cb or vc - ib < k < vc + cb
                            or kc - ib < v < kc + cb or vc - ib < v < vc + cb)
        gap = vc - kc
        if inputs_apart and (not -cb < gap < cb or gap in self._gaps_apart):
            return
        args.no_shared_memory({"key_cache": key_cache, "value_cache": value_cache}, {"key": key, "value": value})
        if inputs_apart:
            self._gaps_apart.add(gap)         # same strides, same gap: apart again next time

    def _launch(self, *tensors: torch.Tensor) -> None:
        if self.num_tokens:
            self._write.pinned(self._grid, *tensors)   # the plan's signatures fix dtypes and alignment


# Plans made by calls with check_slots=False, by everything their checks depend on.
_PLANS: dict[tuple, CacheWritePlan] = {}
_MAX_PLANS = 64


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    check_slots: bool = True,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_heads, head_size]`` into flash-layout caches.

    Same arguments and semantics as vLLM's op (``csrc/cache_kernels.cu``) for unquantized caches:
    only ``slot_mapping.size(0)`` tokens are written, negative slots are skipped. fp8 caches, and
    bf16 in the interpreter, raise ``KernelUnavailable`` (use ``kernels.reference``, or the CUDA
    kernels). ``check_slots=False`` skips the one check that reads the slots back from the device
    (a wait for the GPU): for a caller that built them, as the model does once per step. Such
    calls are also checked only once per combination of shapes, strides and dtypes (a
    ``CacheWritePlan``, kept and reused), and later ones only launch.
    """
    if args.flag("check_slots", check_slots):
        CacheWritePlan(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                       check_slots=True)._launch(key, value, key_cache, value_cache, slot_mapping)
        return
    plan = cached_plan(
        _PLANS, _MAX_PLANS,
        lambda: (tuple(map(tensor_signature, (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale))),
                 kv_cache_dtype),
        lambda: CacheWritePlan(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                               check_slots=False))
    plan._check_apart(key, value, key_cache, value_cache)     # the plan was found by shapes, not by memory
    plan._launch(key, value, key_cache, value_cache, slot_mapping)


def check_triton_dtype(t: torch.Tensor) -> None:
    """Triton's interpreter has no bf16 arithmetic (compiled Triton has): there, bf16 input is
    something this implementation cannot run."""
    if t.dtype == torch.bfloat16 and t.device.type != "cuda":
        raise KernelUnavailable("Triton's interpreter (on a CPU) has no bfloat16 arithmetic; use float32 or "
                                "float16 here, or paged_attention.kernels.reference")
