"""vLLM's own compiled kernels, loaded without installing vLLM: a second oracle, and the bar to beat.

vLLM's wheel carries its kernels as libraries built on PyTorch's stable ABI, so they load into
the torch of this project. Two of them are used here:

* ``_vllm_fa3_C.abi3.so``: FlashAttention 3, vLLM's production attention on Hopper GPUs. Its
  ``fwd`` op, given a block table, is a paged decode over the flash layout. Wrapped here as
  ``paged_attention_decode``, with the signature of the Triton kernel of the same name.
* ``_C_stable_libtorch.abi3.so``: the cache ops ``reshape_and_cache``, ``reshape_and_cache_flash``
  and ``swap_blocks``, wrapped with the signatures of ours.

Where they are looked for: the folder named by ``PAGED_ATTENTION_VLLM_KERNELS`` (what
``tools/vllm_kernels.py`` fetches and unpacks), else an installed ``vllm`` package (found, not
imported). vLLM 0.33 no longer ships the classic ``paged_attention_v1``/``v2``: ours are the
readable ones, FA3 is the production one.

Importing this module never fails. Without the libraries (or without a GPU) ``available()``
says why, and every function raises ``VllmUnavailableError`` (a ``KernelUnavailable``). Each
wrapper first runs the same argument checks as the reference (``kernels.args``), so bad input
raises ``ValueError``/``TypeError`` before vLLM's code sees it. What vLLM's kernels cannot take
(ALiBi or float32 in FA3, CPU tensors) raises ``KernelUnavailable``, and so does what FA3 itself
refuses, with FA3's message.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable

import torch

from paged_attention.kernels import KernelUnavailable, args

ENV_VAR = "PAGED_ATTENTION_VLLM_KERNELS"
FA3_LIBRARY = "_vllm_fa3_C.abi3.so"
CACHE_LIBRARY = "_C_stable_libtorch.abi3.so"
# Where each library sits inside an installed vllm package.
_IN_PACKAGE = {FA3_LIBRARY: ("vllm_flash_attn", FA3_LIBRARY), CACHE_LIBRARY: (CACHE_LIBRARY,)}
# What FA3's decode takes (it has no ALiBi, and runs in 16 bits).
DECODE_DTYPES = (torch.float16, torch.bfloat16)
DECODE_ALIBI = False


class VllmUnavailableError(KernelUnavailable):
    """vLLM's kernels cannot run here: not found, no GPU, or they failed to load."""


# --------------------------------------------------------------------------------------------
# Finding and loading the libraries
# --------------------------------------------------------------------------------------------

def find_library(name: str) -> tuple[Path | None, str]:
    """``(path, where it was found)`` or ``(None, why not)`` for one of the two libraries."""
    folder = os.environ.get(ENV_VAR)
    if folder:
        path = Path(folder) / name
        if path.is_file():
            return path, f"{ENV_VAR}={folder}"
        return None, f"{name} is not in {ENV_VAR}={folder} (python tools/vllm_kernels.py unpack SRC {folder})"
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_IN_PACKAGE[name])
        if path.is_file():
            return path, "the installed vllm package"
        return None, f"the installed vllm package has no {path.name}"
    return None, (f"vLLM's kernels were not found: set {ENV_VAR} to a folder holding {FA3_LIBRARY} and "
                  f"{CACHE_LIBRARY} (make vllm-kernels; README), or install vllm")


def _check_gpu() -> None:
    if not torch.cuda.is_available():
        raise VllmUnavailableError("vLLM's kernels need an NVIDIA GPU and there is none here; use "
                                   "paged_attention.kernels.triton or paged_attention.kernels.reference")


@functools.cache
def _fa3() -> Any:
    """``torch.ops._vllm_fa3_C`` (importing the library registers it)."""
    _check_gpu()
    path, why = find_library(FA3_LIBRARY)
    if path is None:
        raise VllmUnavailableError(why)
    try:
        torch.ops._vllm_fa3_C.fwd      # already registered (vllm imported in this process)
    except (AttributeError, RuntimeError):
        try:
            spec = importlib.util.spec_from_file_location("_vllm_fa3_C", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception as e:
            raise VllmUnavailableError(f"loading {path} failed: {type(e).__name__}: {e}") from e
    return torch.ops._vllm_fa3_C


@functools.cache
def _cache_ops() -> Any:
    """``torch.ops._C_cache_ops`` (``torch.ops.load_library`` registers it)."""
    _check_gpu()
    path, why = find_library(CACHE_LIBRARY)
    if path is None:
        raise VllmUnavailableError(why)
    try:
        torch.ops._C_cache_ops.reshape_and_cache_flash
    except (AttributeError, RuntimeError):
        try:
            torch.ops.load_library(str(path))
        except Exception as e:
            raise VllmUnavailableError(f"loading {path} failed: {type(e).__name__}: {e}") from e
    return torch.ops._C_cache_ops


LIBRARIES = {"fa3": ("FA3", _fa3, FA3_LIBRARY), "cache_ops": ("cache ops", _cache_ops, CACHE_LIBRARY)}


def available(library: str | None = None) -> tuple[bool, str]:
    """``(True, where it came from)`` or ``(False, why not)``, for one library (``"fa3"``: the decode
    kernel; ``"cache_ops"``: the cache writes and ``swap_blocks``) or, by default, for both. Each
    is loaded and reported on its own: with FA3's library alone (the cache ops are 60 MB and
    travel apart), ``available("fa3")`` is True and only the cache ops are skipped."""
    if library is not None and library not in LIBRARIES:
        raise ValueError(f"library must be one of {', '.join(LIBRARIES)} or None, got {library!r}")
    found = []
    for key in ([library] if library is not None else list(LIBRARIES)):
        label, loader, name = LIBRARIES[key]
        try:
            loader()
        except VllmUnavailableError as e:
            return False, f"{label}: {e}"
        found.append(f"{label} from {find_library(name)[1]}")
    return True, "; ".join(found)


# --------------------------------------------------------------------------------------------
# Cache writes and swaps
# --------------------------------------------------------------------------------------------

_WHY = "vLLM's kernels"


def _to_kernel(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor,
               v_scale: torch.Tensor):
    """vLLM's cache kernels read int64 slots and float32 scales on the GPU of the keys, by index
    (strided views of these small tensors become contiguous copies), and each token's keys and
    values as one run of ``heads * head_size`` elements (only the token stride is theirs)."""
    if key.device.type != "cuda":
        raise KernelUnavailable(f"key is on {key.device}: vLLM's kernels run on tensors on a CUDA device")
    args.rows_of_heads(_WHY, key=key, value=value)
    return (slot_mapping.to(key.device, torch.int64).contiguous(),
            k_scale.to(key.device, torch.float32).contiguous(), v_scale.to(key.device, torch.float32).contiguous())


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """vLLM's scatter of new tokens into the v0-layout caches (which it indexes by shape: they
    must be contiguous)."""
    ops = _cache_ops()
    args.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    slots, ks, vs = _to_kernel(key, value, slot_mapping, k_scale, v_scale)
    args.contiguous(_WHY, key_cache=key_cache, value_cache=value_cache)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype, ks, vs)


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
    """vLLM's scatter of new tokens into flash-layout caches (NHD, or HND through strides).

    vLLM addresses both caches with the key cache's block, token and head strides, so the value
    cache must have the same strides (K and V views of one cache tensor do). ``check_slots=False``:
    the slots are not read back to check their range (see the Triton front-end)."""
    ops = _cache_ops()
    args.check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale, check_slots=check_slots)
    slots, ks, vs = _to_kernel(key, value, slot_mapping, k_scale, v_scale)
    if key_cache.stride() != value_cache.stride():
        raise KernelUnavailable(f"key_cache and value_cache must have the same strides for vLLM's kernels, got "
                         f"{list(key_cache.stride())} and {list(value_cache.stride())}")
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, kv_cache_dtype, ks, vs)


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_size_in_bytes: int | torch.Tensor | None = None,
    block_mapping: torch.Tensor | None = None,
) -> None:
    """vLLM's block copy between a GPU cache and a (pinned) CPU cache; both of its signatures."""
    ops = _cache_ops()
    nbytes, block_mapping = args.check_swap_blocks(src, dst, block_size_in_bytes, block_mapping)
    if not (src.is_cuda or dst.is_cuda):
        raise KernelUnavailable("swap_blocks copies to or from a GPU; for CPU-to-CPU use "
                         "paged_attention.kernels.reference.swap_blocks")
    ops.swap_blocks(src, dst, nbytes, block_mapping.to("cpu", torch.int64).contiguous())


# --------------------------------------------------------------------------------------------
# Decode attention: FlashAttention 3 with a block table
# --------------------------------------------------------------------------------------------

def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    check_ids: bool = True,
) -> None:
    """One decode step with vLLM's FA3 over a flash-layout cache, written into ``out``.

    Arguments as ``paged_attention.kernels.triton.paged_attention_decode``. Each sequence is one
    query token, so FA3 sees a variable-length batch with ``cu_seqlens_q = [0, 1, ..., num_seqs]``,
    the lengths as ``seqused_k`` and the block table as its page table. fp16/bf16 only, no ALiBi.
    ``num_splits=None`` lets FA3 choose how to split long contexts (vLLM's default). FA3 takes
    the strides of the query and the caches (head dimension contiguous); ``out`` must be
    contiguous; the lengths and the table are passed as contiguous int32 copies where they are
    not already. ``max_seq_len``: as in the Triton kernel (an upper bound, checked when
    ``check_ids=True``).
    """
    fa3 = _fa3()
    max_seq_len = args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                                               check_ids=check_ids, scale=scale, out=out, max_seq_len=max_seq_len,
                                               num_splits=num_splits)
    if query.dtype not in DECODE_DTYPES:
        raise KernelUnavailable(f"vLLM's FA3 runs in float16 or bfloat16 only, got {query.dtype}")
    if alibi_slopes is not None:
        raise KernelUnavailable("alibi_slopes: vLLM's FA3 has no ALiBi; use the Triton, CUDA or reference kernels")
    if query.device.type != "cuda":
        raise KernelUnavailable(f"query is on {query.device}: vLLM's FA3 runs on tensors on a CUDA device")
    args.unit_last_stride(query=query, out=out, key_cache=key_cache, value_cache=value_cache)
    args.contiguous("vLLM's FA3", out=out)
    num_seqs = query.size(0)
    if num_seqs == 0:
        return
    cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    try:
        _fa3_fwd(fa3, out, query, key_cache, value_cache, cu_seqlens_q, seq_lens.to(torch.int32).contiguous(),
                 block_tables.to(torch.int32).contiguous(), float(scale), max_seq_len, num_splits or 0)
    except RuntimeError as e:
        if "CUDA error" in str(e):       # a fault, not a refusal
            raise
        raise KernelUnavailable(f"vLLM's FA3 refused these arguments: {e}") from e


def _fa3_fwd(fa3: Any, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
             max_seq_len: int, num_splits: int) -> None:
    """FA3's op as a decode: one query per sequence (``cu_seqlens_q`` = 0, 1, ..., num_seqs), the
    block table as its page table (int32, unit-stride rows), the lengths as ``seqused_k``."""
    fa3.fwd(query, key_cache, value_cache,
            None, None, None,                  # k_new, v_new, q_v
            out, cu_seqlens_q,
            None, None, None,                  # cu_seqlens_k (the page table gives the keys), _k_new, seqused_q
            seq_lens, 1, max_seq_len, block_tables,
            None, None, None, None, None,      # kv_batch_idx, leftpad_k, rotary cos/sin/seqlens
            None, None, None,                  # q/k/v descale (fp8 only)
            scale,
            True, -1, -1,                      # causal (a lone last query sees every key), no window
            0.0, True,                         # no softcap; rotary_interleaved (unused)
            None, num_splits,                  # scheduler_metadata, num_splits (0: FA3 decides)
            None, 0, None,                     # pack_gqa (FA3 decides), sm_margin, s_aux
            1, 0, None)                        # no context parallelism


def fa3_decode_call(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    max_seq_len: int) -> Callable[[], None]:
    """A callable making FA3's op call for this decode and nothing else, as vLLM's FlashAttention
    backend makes it (its metadata, ``cu_seqlens_q`` included, prepared beforehand): what a
    benchmark times as FA3's call. Checks the arguments once, here."""
    paged_attention_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                           max_seq_len=max_seq_len)
    fa3 = _fa3()
    cu_seqlens_q = torch.arange(query.size(0) + 1, dtype=torch.int32, device=query.device)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    scale = float(scale)
    return lambda: _fa3_fwd(fa3, out, query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                            max_seq_len, 0)
