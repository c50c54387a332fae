"""Argument checks shared by every kernel implementation (reference, Triton, CUDA).

A kernel trusts its indices: an out-of-range block id read by a CUDA kernel corrupts memory, and
in Triton's interpreter it kills the Python process (and a notebook's kernel with it). So every
public kernel entry point checks shapes, dtypes, devices and index ranges here, in Python, and
raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (wrong value) with a message that
names the argument and says what was expected. Nothing is written before the checks pass.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Sequence

import torch

from paged_attention.utils import cdiv

# kv_cache_dtype strings (spec §5): the unquantized ones keep the input's element type.
UNQUANTIZED_KV_DTYPES = ("auto", "float16", "bfloat16")
FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with the given rank, one of ``dtypes``, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        wanted = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({wanted}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device.type != device.type:
        raise ValueError(f"{name} must be on {device.type}, got {t.device.type}")
    return t


def type_name(x: object) -> str:
    """``list``, ``float``, ``numpy.ndarray``: a type as a user would write it."""
    cls = type(x)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"


def same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all named arguments are tensors on one device and return it.

    The type is checked first: a list or a numpy array has no torch device (numpy's ``.device``
    is the string ``"cpu"``), and the error should say what the argument is, not where.
    """
    for name, t in tensors.items():
        tensor(name, t)
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"all tensors must be on one device; got {listing}")
    return first


def shape(name: str, t: torch.Tensor, expected: Iterable[int | None]) -> None:
    """Check ``t.shape`` against ``expected``, where ``None`` matches any size."""
    expected = tuple(expected)
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        pretty = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} must have shape {pretty}, got {list(t.shape)}")


def unit_last_stride(**tensors: torch.Tensor) -> None:
    """Kernels read a head's elements as one contiguous run: the last dimension must have stride 1."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last (head_size) dimension, "
                             f"got strides {list(t.stride())}")


def no_broadcast_dims(name: str, t: torch.Tensor) -> None:
    """A tensor that is written must not have a dimension of stride 0 (an ``expand``): two of
    its elements would be one memory location, and which write wins would be up to the kernel."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > 1 and stride == 0:
            raise ValueError(f"{name} is written, so its elements must not share memory; dimension {dim} "
                             f"has size {size} and stride 0 (an expanded view): pass a real tensor")


def softmax_scale(name: str, value: object) -> float:
    """The attention scale (``1 / sqrt(head_size)`` usually): a finite real number, as a float.

    A tensor is refused rather than read: reading a GPU tensor's value would make every call
    wait for the device. NaN or infinity would turn every output into NaN without a word.
    """
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a real number such as 0.125, got a torch.Tensor "
                        f"(use float(t) for a one-element tensor)")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number such as 0.125, got {type_name(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def positive_int(name: str, value: object) -> int:
    """An int >= 1 (``bool`` is not one); ``TypeError`` for another type, ``ValueError`` below 1."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {type_name(value)} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def max_seq_len(value: object, longest: int) -> int:
    """Check a caller's ``max_seq_len``: a positive int, and not less than ``longest``.

    ``longest`` is the longest of ``seq_lens`` where the lengths were read (``check_ids=True``),
    or -1 where they were not: then the caller promises that ``max_seq_len`` is an upper bound.
    A smaller bound is refused because the kernels size their work (and v1 its shared memory,
    v2 its partitions) by it, so tokens past it would be dropped or worse.
    """
    value = positive_int("max_seq_len", value)
    if longest > value:
        raise ValueError(f"max_seq_len ({value}) must be >= the longest of seq_lens ({longest})")
    return value


def contiguous(why: str, **tensors: torch.Tensor) -> None:
    """Refuse a view whose memory is not the plain row-major layout: for kernels that index a
    tensor by its shape alone, and for tensors they write (a contiguous copy would lose the write)."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for {why} (got shape {list(t.shape)}, "
                             f"strides {list(t.stride())})")


def rows_of_heads(why: str, **tensors: torch.Tensor) -> None:
    """``[tokens, heads, head_size]`` whose heads lie back to back within a token (any token
    stride): kernels that read a token's ``heads * head_size`` elements as one run need it."""
    for name, t in tensors.items():
        if t.stride(2) != 1 or (t.size(1) > 1 and t.stride(1) != t.size(2)):
            raise ValueError(f"{name} must have contiguous heads within each token (strides [*, {t.size(2)}, 1]) "
                             f"for {why}, got {list(t.stride())}")


def kv_cache_dtype(name: str, value: object) -> str:
    """Check a ``kv_cache_dtype`` string; return it unchanged."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string such as 'auto', got {type(value).__name__}")
    if value not in UNQUANTIZED_KV_DTYPES and value not in FP8_KV_DTYPES:
        known = ", ".join(UNQUANTIZED_KV_DTYPES + tuple(FP8_KV_DTYPES))
        raise ValueError(f"Unsupported fp8 kv cache data type {value!r} for {name}; expected one of {known}")
    return value


def cache_element_dtype(kv_dtype: str, input_dtype: torch.dtype) -> torch.dtype:
    """The element type stored in the cache: the input's, or uint8 for fp8 caches."""
    return torch.uint8 if kv_dtype in FP8_KV_DTYPES else input_dtype


def scale(name: str, s: object, num_heads: int | None = None) -> torch.Tensor:
    """A float32 scale tensor of shape [1] (or [num_heads] where per-head scales are allowed)."""
    tensor(name, s, ndim=1, dtypes=(torch.float32,))
    allowed = (1,) if num_heads is None else (1, num_heads)
    if s.numel() not in allowed:
        raise ValueError(f"{name} must have shape {' or '.join(f'[{a}]' for a in allowed)}, got {list(s.shape)}")
    return s


def slot_mapping(name: str, slots: torch.Tensor, num_slots: int, max_tokens: int) -> None:
    """Slots are int64, one per token (at most ``max_tokens``), and each < ``num_slots`` or negative."""
    tensor(name, slots, ndim=1, dtypes=(torch.int64,))
    if slots.numel() > max_tokens:
        raise ValueError(f"{name} has {slots.numel()} entries but only {max_tokens} tokens were given")
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(
            f"{name} holds slot {int(slots.max())} but the cache has only {num_slots} slots "
            f"(num_blocks * block_size); negative slots mean 'skip this token'"
        )


def block_tables_and_lens(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_seqs: int,
    block_size: int,
    num_blocks: int,
    check_ids: bool = True,
) -> int:
    """Check a decode batch's block tables and lengths; return the longest length.

    Every sequence needs ``cdiv(seq_len, block_size)`` table entries, each a block id in
    ``[0, num_blocks)``. Entries past what a sequence needs are never read and may hold anything
    (vLLM leaves stale ids there). With ``check_ids=False`` the value checks, which copy the
    tensors to the host, are skipped: for hot loops whose tables are known to be good.
    """
    tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64))
    tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64))
    if block_tables.size(0) != num_seqs:
        raise ValueError(f"block_tables must have {num_seqs} rows (one per sequence), got {block_tables.size(0)}")
    if seq_lens.size(0) != num_seqs:
        raise ValueError(f"seq_lens must have {num_seqs} entries (one per sequence), got {seq_lens.size(0)}")
    if not check_ids:
        return -1
    lens = seq_lens.to("cpu", torch.int64)
    if num_seqs == 0:
        return 0
    if int(lens.min()) < 1:
        raise ValueError(f"seq_lens must all be >= 1, got {int(lens.min())}")
    max_len = int(lens.max())
    needed = cdiv(max_len, block_size)
    if needed > block_tables.size(1):
        raise ValueError(
            f"seq_lens holds a length of {max_len}, which needs {needed} blocks of {block_size}, "
            f"but block_tables has only {block_tables.size(1)} columns"
        )
    table = block_tables[:, :needed].to("cpu", torch.int64)
    used = torch.arange(needed).unsqueeze(0) < ((lens + block_size - 1) // block_size).unsqueeze(1)
    ids = table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise ValueError(f"block_tables holds block id {int(bad)}, outside the cache's [0, {num_blocks})")
    return max_len


def alibi_slopes(slopes: torch.Tensor | None, num_heads: int) -> None:
    """ALiBi slopes are float32, one per query head."""
    if slopes is None:
        return
    tensor("alibi_slopes", slopes, ndim=1, dtypes=(torch.float32,))
    if slopes.size(0) != num_heads:
        raise ValueError(f"alibi_slopes must have {num_heads} entries (one per query head), got {slopes.size(0)}")


def gqa(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head; the query heads must split evenly over the KV heads."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads
