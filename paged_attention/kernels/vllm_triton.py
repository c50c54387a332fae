"""vLLM's own Triton paged attention, loaded from its source at run time: a peer for ours.

vLLM's Triton attention backend runs ``unified_attention`` (``vllm/v1/attention/ops/
triton_unified_attention.py``), pure Triton like ours, compiled by the same compiler: the fairest
comparison there is. Nothing of vLLM's is part of this project. ``tools/vllm_kernels.py fetch``
takes the two source files out of the pinned vllm wheel, next to the compiled kernels; this
module executes them with small stand-ins for the five vLLM modules they import (settings, a
logger, the platform, Triton's re-export, an enum). Where they are looked for: the folder named by
``PAGED_ATTENTION_VLLM_KERNELS``, else an installed ``vllm`` package.

``VllmTritonDecode`` sets the kernel up as vLLM's Triton backend does for a decode batch (one
query token per sequence): split-K ("3D", 16 segments) for batches up to ``128 // num_kv_heads``
sequences, one pass ("2D") above, scratch allocated once. ``available()`` says whether it can
run; without the sources every call raises ``VllmUnavailableError``. In Triton's interpreter (a
CPU) it runs as well, in float32, slowly.
"""
from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

from paged_attention.kernels import args
from paged_attention.kernels.vllm import ENV_VAR, VllmUnavailableError

SOURCES = ("triton_attention_helpers.py", "triton_unified_attention.py")
_IN_PACKAGE = ("v1", "attention", "ops")
# vLLM's Triton backend: below this many programs the one-pass grid leaves the GPU idle, and the
# decode is split into NUM_SEGMENTS segments per sequence (MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS).
MIN_GRID_2D = 128
NUM_SEGMENTS = 16


def find_sources() -> tuple[Path | None, str]:
    """``(folder holding both sources, where)`` or ``(None, why not)``."""
    folder = os.environ.get(ENV_VAR)
    if folder:
        if all((Path(folder) / name).is_file() for name in SOURCES):
            return Path(folder), f"{ENV_VAR}={folder}"
        return None, f"{' and '.join(SOURCES)} are not in {ENV_VAR}={folder} (python tools/vllm_kernels.py fetch)"
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_IN_PACKAGE)
        if all((path / name).is_file() for name in SOURCES):
            return path, "the installed vllm package"
    return None, (f"vLLM's Triton attention source was not found: set {ENV_VAR} to a folder holding "
                  f"{' and '.join(SOURCES)} (python tools/vllm_kernels.py fetch), or install vllm")


class _KVQuantMode(enum.IntEnum):
    """Stand-in for ``vllm.v1.kv_cache_interface.KVQuantMode`` (same values; only NONE is used)."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5


class _Platform:
    """Stand-in for ``vllm.platforms.current_platform``: the three questions the kernel file asks."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == family

    @staticmethod
    def is_cuda() -> bool:
        return torch.cuda.is_available()


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg: str, *a: Any) -> None:
        self.debug(msg, *a)


def _stand_ins() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []                      # a package, so that submodules import
        return m
    return {
        "vllm": module("vllm"),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": module("vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {})),
        "vllm.platforms": module("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": module("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.attention": module("vllm.v1.attention"),
        "vllm.v1.attention.ops": module("vllm.v1.attention.ops"),
        "vllm.v1.kv_cache_interface": module("vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode),
    }


@functools.cache
def _module() -> types.ModuleType:
    """vLLM's ``triton_unified_attention`` module, executed with the stand-ins (loaded once)."""
    import paged_attention.runtime  # noqa: F401  (TRITON_INTERPRET before any @triton.jit)
    folder, why = find_sources()
    if folder is None:
        raise VllmUnavailableError(why)
    # The stand-ins are in sys.modules only while the two files execute; what was there before
    # (a real vllm, or nothing) is put back afterwards.
    stand_ins = _stand_ins()
    names = [*stand_ins, *(f"vllm.v1.attention.ops.{source[:-3]}" for source in SOURCES)]
    saved = {name: sys.modules.get(name) for name in names}
    try:
        sys.modules.update(stand_ins)
        loaded = None
        for source in SOURCES:
            name = f"vllm.v1.attention.ops.{source[:-3]}"
            spec = importlib.util.spec_from_file_location(name, folder / source)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded
            spec.loader.exec_module(loaded)
        return loaded
    except Exception as e:
        raise VllmUnavailableError(f"loading vLLM's Triton attention from {folder} failed: "
                                   f"{type(e).__name__}: {e}") from e
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def available() -> tuple[bool, str]:
    """``(True, where the source came from)`` or ``(False, why not)``."""
    try:
        _module()
    except VllmUnavailableError as e:
        return False, str(e)
    return True, find_sources()[1]


class VllmTritonDecode:
    """vLLM's ``unified_attention`` set up for decode batches as vLLM's Triton backend sets it up.

    Made once per model shape (vLLM's metadata builder allocates the split-K scratch once);
    ``__call__`` has the signature of our ``paged_attention_decode`` minus ALiBi, and checks its
    arguments as ours does. ``max_num_seqs`` bounds the batches it takes.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, max_num_seqs: int,
                 device: torch.device | str) -> None:
        self._unified_attention = _module().unified_attention
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.seq_threshold_3d = MIN_GRID_2D // num_kv_heads
        rows = min(self.seq_threshold_3d, max_num_seqs)
        padded = 1 << (head_size - 1).bit_length()
        self._segm_output = torch.empty(rows, num_heads, NUM_SEGMENTS, padded, dtype=torch.float32, device=device)
        self._segm_max = torch.empty(rows, num_heads, NUM_SEGMENTS, dtype=torch.float32, device=device)
        self._segm_expsum = torch.empty_like(self._segm_max)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device)
        self._cu_seqlens_q = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.max_num_seqs = max_num_seqs

    def __call__(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 alibi_slopes: torch.Tensor | None = None, *, max_seq_len: int | None = None,
                 check_ids: bool = True) -> None:
        """Checked as our ``paged_attention_decode``. vLLM's kernel steps through a table row and
        through ``seq_lens`` with unit stride, so strided ones are passed as contiguous copies;
        ``query`` and ``out`` need a contiguous head dimension (the caches may have any strides)."""
        max_seq_len = args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                                                   alibi_slopes, check_ids=check_ids, scale=scale, out=out,
                                                   max_seq_len=max_seq_len)
        args.unit_last_stride(query=query, out=out)
        num_seqs = query.size(0)
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_seqs} sequences, more than max_num_seqs={self.max_num_seqs}")
        if num_seqs:
            self.run(out, query, key_cache, value_cache, block_tables.to(torch.int32).contiguous(),
                     seq_lens.to(torch.int32).contiguous(), float(scale), max_seq_len,
                     None if alibi_slopes is None else alibi_slopes.float().contiguous())

    def run(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
            alibi_slopes: torch.Tensor | None = None) -> None:
        """The call vLLM's backend makes, unchecked (what is timed)."""
        num_seqs = query.size(0)
        descale = self._scale_one.expand(num_seqs, self.num_kv_heads)
        self._unified_attention(
            q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=self._cu_seqlens_q[:num_seqs + 1],
            max_seqlen_q=1, seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
            window_size=(-1, -1), block_table=block_tables, softcap=0, q_descale=None, k_descale=descale,
            v_descale=descale, seq_threshold_3D=self.seq_threshold_3d, num_par_softmax_segments=NUM_SEGMENTS,
            softmax_segm_output=self._segm_output, softmax_segm_max=self._segm_max,
            softmax_segm_expsum=self._segm_expsum, alibi_slopes=alibi_slopes)


# What ``python -m paged_attention check`` asks of an implementation. On a GPU vLLM's kernel
# multiplies float32 in TF32, outside float32's tolerance, so it is checked in 16 bits.
DECODE_DTYPES = (torch.float16, torch.bfloat16)


def paged_attention_decode(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, alibi_slopes: torch.Tensor | None = None, *, num_splits: int | None = None,
                           max_seq_len: int | None = None, check_ids: bool = True) -> None:
    """One decode step with vLLM's Triton kernel, with the signature of ours (``num_splits`` is
    vLLM's choice, 16 segments or none, and is ignored). Scratch is allocated per call: for
    checking; time a ``VllmTritonDecode`` kept across calls."""
    if not isinstance(query, torch.Tensor) or not isinstance(key_cache, torch.Tensor):
        args.check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                                     scale=scale, out=out)
    peer = VllmTritonDecode(query.size(1), key_cache.size(2), query.size(2), max(query.size(0), 1), query.device)
    peer(out, query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
         max_seq_len=max_seq_len, check_ids=check_ids)
