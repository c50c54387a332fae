"""Our CUDA kernels for vLLM's cache and attention ops, built on first use.

The sources are in ``csrc/``, written to be read:

* ``cache_kernels.cu``: ``reshape_and_cache`` (v0 layout), ``reshape_and_cache_flash`` (NHD and
  HND), ``copy_blocks`` (all layers in one launch) and ``swap_blocks`` (one memcpy per block);
* ``attention.cuh``: ``paged_attention_v1`` and ``v2``, one thread block per (head, sequence
  [, 512-token partition]) as in vLLM, or per four query heads of one KV head (GQA: every K/V
  load serves all four), and v2's reduction; ``attention_launch.cu`` picks the instance, each
  compiled in its own ``attention_<type>_g<heads>.cu`` so that they build in parallel.

The first call builds the extension with ``torch.utils.cpp_extension.load`` for the GPUs of this
machine (about a minute), which then stays cached in ``~/.cache/torch_extensions``. Each function
here has the signature of its namesake in ``paged_attention.kernels.reference``, checks its
arguments with the same checks (``kernels.args``: ``ValueError``/``TypeError`` before anything
runs), adds what the kernels need (contiguous caches) and launches. What they cannot run (CPU
tensors, fp8 attention, a head or block size not compiled, a context longer than v1's shared
memory holds) raises ``KernelUnavailable``.

Importing this module never fails. Without a CUDA device every kernel raises
``CudaUnavailableError`` (a ``KernelUnavailable``) saying so and naming the Triton and reference
versions.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from paged_attention.kernels import KernelUnavailable, args

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "cache_kernels.cu", "attention_launch.cu",
           *(f"attention_{t}_g{g}.cu" for t in ("float", "half", "bfloat16") for g in (1, 4)))
# What the attention kernels are compiled for: the head and block sizes vLLM compiles its own for.
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
NUM_WARPS = 4            # threads per attention thread block: 128
# kv_cache_dtype -> the code the kernels dispatch on (csrc/common.cuh, KvDtype).
_KV_CODES = {"auto": 0, "float16": 0, "bfloat16": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_ds_mla": 1, "fp8_e5m2": 2}


class CudaUnavailableError(KernelUnavailable):
    """The CUDA kernels cannot run on this machine (no GPU, or no CUDA toolkit to build them)."""


def _why_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return ("the CUDA kernels need an NVIDIA GPU and there is none here; use "
                "paged_attention.kernels.triton (Triton's interpreter runs on a CPU) or "
                "paged_attention.kernels.reference (plain torch) instead")
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME is None:
        return ("the CUDA kernels are compiled on first use, but no CUDA toolkit (nvcc) was found; "
                "install one or set CUDA_HOME")
    return None


@functools.cache
def _extension() -> Any:
    """Build (first time) and load the extension; raise CudaUnavailableError where impossible."""
    why = _why_unavailable()
    if why is not None:
        raise CudaUnavailableError(why)
    from torch.utils.cpp_extension import load
    # cpp_extension compiles for the GPUs it sees unless TORCH_CUDA_ARCH_LIST says otherwise.
    return load(
        name="paged_attention_cuda",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
        verbose=os.environ.get("PAGED_ATTENTION_VERBOSE_BUILD") == "1",
    )


def available() -> tuple[bool, str]:
    """``(True, what was loaded)`` or ``(False, why not)``. Builds the extension if needed."""
    why = _why_unavailable()
    if why is not None:
        return False, why
    try:
        ext = _extension()
    except Exception as e:  # a failed build: say so rather than crash a notebook
        return False, f"building the CUDA extension failed: {type(e).__name__}: {e}"
    return True, f"{ext.__name__} built for {torch.cuda.get_device_name()}"


# --------------------------------------------------------------------------------------------
# What the kernels need beyond the shared checks
# --------------------------------------------------------------------------------------------

def _on_cuda(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type != "cuda":
            raise KernelUnavailable(f"{name} is on {t.device}: the CUDA kernels run on tensors on a CUDA device; "
                                    f"use paged_attention.kernels.reference or .triton for these")


_WHY = "the CUDA kernels"


def _contiguous(**tensors: torch.Tensor) -> None:
    args.contiguous(_WHY, **tensors)


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Tables and lengths as the kernels index them: int32, row-major (a copy only if needed)."""
    return t.to(torch.int32).contiguous()


def _scales(k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head scales are read as ``scale[h]``: a strided view becomes a (tiny) contiguous copy."""
    return k_scale.contiguous(), v_scale.contiguous()


# --------------------------------------------------------------------------------------------
# Cache writes
# --------------------------------------------------------------------------------------------

def reshape_and_cache(
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
    """Scatter new tokens' keys and values into the v0-layout caches (``csrc/cache_kernels.cu``).
    ``check_slots=False``: the slots are not read back to check their range (see the Triton
    front-end)."""
    ext = _extension()
    args.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                 k_scale, v_scale, check_slots=check_slots)
    _on_cuda(key=key, k_scale=k_scale, v_scale=v_scale)
    args.rows_of_heads(_WHY, key=key, value=value)
    _contiguous(key_cache=key_cache, value_cache=value_cache)
    ext.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous(),
                          _KV_CODES[kv_cache_dtype], *_scales(k_scale, v_scale))


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
    """Scatter new tokens into flash-layout caches, NHD or HND, scales per tensor or per head.
    ``check_slots=False``: the slots are not read back to check their range (see the Triton
    front-end)."""
    ext = _extension()
    args.check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale, check_slots=check_slots)
    _on_cuda(key=key, k_scale=k_scale, v_scale=v_scale)
    args.unit_last_stride(key=key, value=value)
    # The kernel takes the token and head strides of key and value, the block, token and head
    # strides of the caches (one block stride for both, checked above); the slots and scales
    # are read by index, so strided views of those are made contiguous (they are small).
    ext.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping.contiguous(),
                                _KV_CODES[kv_cache_dtype], *_scales(k_scale, v_scale))


# --------------------------------------------------------------------------------------------
# Block copies
# --------------------------------------------------------------------------------------------

def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy block ``src`` over block ``dst`` for every pair, in every layer, in one launch.

    The pairs run in parallel, so a block that is both a source and a destination would make
    the result depend on the order: vLLM leaves that undefined; here it is refused (the legacy
    block manager's copy-on-write pairs never do it). ``block_mapping`` may be on any device.
    """
    ext = _extension()
    if not args.check_copy_blocks(key_caches, value_caches, block_mapping):
        return
    caches = [*key_caches, *value_caches]
    device = caches[0].device
    for i, t in enumerate(caches):
        kind, layer = ("key_caches", i) if i < len(key_caches) else ("value_caches", i - len(key_caches))
        _on_cuda(**{f"{kind}[{layer}]": t})
        _contiguous(**{f"{kind}[{layer}]": t})
        if t.device != device:
            raise ValueError(f"{kind}[{layer}] is on {t.device}, but key_caches[0] is on {device}")
    block_bytes = {t[0].numel() * t.element_size() for t in caches}
    if len(block_bytes) != 1:
        raise ValueError(f"every key and value cache must have blocks of the same size in bytes, got {sorted(block_bytes)}")
    pairs = block_mapping.cpu()
    src, dst = set(pairs[:, 0].tolist()), pairs[:, 1].tolist()
    if len(set(dst)) != len(dst) or src & set(dst):
        raise ValueError("block_mapping must not name a destination twice, nor a block that is both a source "
                         "and a destination: the CUDA copies run in parallel")
    nbytes = block_bytes.pop()
    ptrs = [t.data_ptr() for t in caches]
    aligned16 = nbytes % 16 == 0 and all(p % 16 == 0 for p in ptrs)
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    ext.copy_blocks(as_tensor(ptrs[:len(key_caches)]), as_tensor(ptrs[len(key_caches):]),
                    block_mapping.to(device).contiguous(), nbytes, aligned16)


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_size_in_bytes: int | torch.Tensor | None = None,
    block_mapping: torch.Tensor | None = None,
) -> None:
    """Copy whole blocks GPU -> CPU, CPU -> GPU or GPU -> GPU, one ``cudaMemcpyAsync`` each.

    Both of vLLM's signatures work, as in the reference. Use pinned CPU memory for the copies to
    run asynchronously on the current stream; with pageable memory they still work, synchronously.
    """
    ext = _extension()
    nbytes, block_mapping = args.check_swap_blocks(src, dst, block_size_in_bytes, block_mapping)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        raise KernelUnavailable("Invalid device combination: swap_blocks copies to or from a GPU; for CPU-to-CPU "
                                "use paged_attention.kernels.reference.swap_blocks")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise KernelUnavailable(f"src and dst are on {src.device} and {dst.device}: the CUDA swap_blocks copies "
                                f"within one GPU or between it and the CPU")
    ext.swap_blocks(src, dst, nbytes, block_mapping.contiguous())


# --------------------------------------------------------------------------------------------
# Paged attention v1 / v2
# --------------------------------------------------------------------------------------------

def v1_max_seq_len(head_size: int, device: torch.device | None = None) -> int:
    """The longest context ``paged_attention_v1`` can take on this GPU: it keeps a float score
    per token in shared memory, next to the query and a reduction scratch (``attention.cuh``)."""
    optin = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    static = 4 * (head_size + NUM_WARPS)
    return (optin - static) // 4


def _check_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                     max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, blocksparse_vert_stride,
                     check_ids):
    """The shared checks, then what the kernels need. Strides: the query's token and head
    strides go to the kernel; the caches (indexed by shape) and ``out`` (written) must be
    contiguous; the tables, lengths and slopes are passed as contiguous copies where they are not."""
    args.check_v0_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                            block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                            blocksparse_vert_stride, scale=scale, check_ids=check_ids)
    if kv_cache_dtype not in args.UNQUANTIZED_KV_DTYPES:
        raise KernelUnavailable(f"kv_cache_dtype={kv_cache_dtype!r}: the CUDA attention kernels read unquantized "
                                f"caches only; paged_attention.kernels.reference handles fp8")
    head_size = query.size(2)
    if head_size not in HEAD_SIZES:
        raise KernelUnavailable(f"Unsupported head size: {head_size}; the CUDA kernels are compiled for "
                                f"{HEAD_SIZES}")
    if block_size not in BLOCK_SIZES:
        raise KernelUnavailable(f"Unsupported block size: {block_size}; the CUDA kernels are compiled for "
                                f"{BLOCK_SIZES}")
    _on_cuda(query=query)
    args.unit_last_stride(query=query)
    _contiguous(out=out, key_cache=key_cache, value_cache=value_cache)


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
    *,
    check_ids: bool = True,
) -> None:
    """One decode step, one thread block per (head, sequence) over the whole context.

    The context is limited by shared memory (``v1_max_seq_len``). ``check_ids=False`` skips the
    host-side block-id checks, e.g. inside a CUDA-graph capture whose tables are known good; the
    caller then also promises that ``max_seq_len`` bounds ``seq_lens`` (shared memory is sized
    by it; with ``check_ids=True`` a smaller one is refused).
    """
    ext = _extension()
    _check_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                     max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, blocksparse_vert_stride,
                     check_ids)
    limit = v1_max_seq_len(query.size(2), query.device)
    if max_seq_len > limit:
        raise KernelUnavailable(f"max_seq_len={max_seq_len} is more than paged_attention_v1 can hold in shared "
                                f"memory on this GPU ({limit} tokens for head size {query.size(2)}); use "
                                f"paged_attention_v2")
    ext.paged_attention(out, None, None, None, query, key_cache, value_cache, num_kv_heads, float(scale),
                        _int32(block_tables), _int32(seq_lens), block_size, int(max_seq_len),
                        None if alibi_slopes is None else alibi_slopes.contiguous())


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
    *,
    check_ids: bool = True,
) -> None:
    """One decode step in 512-token partitions (grid: head, sequence, partition), then a reduction.

    ``exp_sums``/``max_logits`` (float32) and ``tmp_out`` are ``[num_seqs, num_heads,
    ceil(max_seq_len / 512)(, head_size)]`` scratch, filled as the reference fills them.
    ``check_ids=False``: as in ``paged_attention_v1``; ``max_seq_len`` sets the partitions.
    """
    ext = _extension()
    _check_attention(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                     max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, blocksparse_vert_stride,
                     check_ids)
    args.check_v2_buffers(exp_sums, max_logits, tmp_out, query, max_seq_len)
    _contiguous(exp_sums=exp_sums, max_logits=max_logits, tmp_out=tmp_out)
    ext.paged_attention(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                        float(scale), _int32(block_tables), _int32(seq_lens), block_size, int(max_seq_len),
                        None if alibi_slopes is None else alibi_slopes.contiguous())
