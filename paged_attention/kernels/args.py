"""Argument checks shared by every kernel implementation (reference, Triton, CUDA, vLLM's).

A kernel trusts its indices: an out-of-range block id read by a CUDA kernel corrupts memory, and
in Triton's interpreter it kills the Python process (and a notebook's kernel with it). So every
public kernel entry point checks shapes, dtypes, devices and index ranges here, in Python, and
raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (wrong value) with a message that
names the argument and says what was expected. Nothing is written before the checks pass.

The module reads in two parts: the pieces (one tensor, one scale, one slot mapping...), then one
preamble per operation, ``check_<op>``, which each of the four front-ends of that operation
calls first. What an implementation cannot do beyond that (a head size it was not compiled for,
fp8 in Triton) is its own business, and it raises ``KernelUnavailable`` for it, not an error
from here; the one such refusal made here is block-sparse attention, which none of them has.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Sequence

import torch

from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels.layout import PARTITION_SIZE, v0_x
from paged_attention.utils import cdiv, is_int

# vLLM's kv_cache_dtype strings: the unquantized ones keep the input's element type; the fp8
# ones store each element as one byte, which the cache holds as uint8.
UNQUANTIZED_KV_DTYPES = ("auto", "float16", "bfloat16")
FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The kernels hold a position in a sequence in 32 bits.
MAX_SEQ_LEN = 2**31 - 1


# --------------------------------------------------------------------------------------------
# 1. The pieces
# --------------------------------------------------------------------------------------------

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
    # A kernel addresses memory through strides: a sparse tensor has none, a meta tensor no data.
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without data): a kernel needs real memory")
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
    """A tensor that is written must not have two elements at one memory location: a dimension
    of stride 0 (an ``expand``), or strides that make dimensions overlap (an ``as_strided`` view
    whose blocks are closer than a block's size). Which write would win is up to the kernel."""
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > 1 and stride == 0:
            raise ValueError(f"{name} is written, so its elements must not share memory; dimension {dim} "
                             f"has size {size} and stride 0 (an expanded view): pass a real tensor")
    if not _dims_apart(t.shape, t.stride()):
        raise ValueError(f"{name} is written, so its elements must not share memory; shape {list(t.shape)} "
                         f"with strides {list(t.stride())} puts two of them at one place (an overlapping "
                         f"view): pass a real tensor")


def _dims_apart(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether every index of a view reaches its own element. Taken from the smallest stride up,
    each dimension must step past everything the smaller ones reach: true of every contiguous
    tensor and of its slices, transposes and permutations. (A few exotic views that interleave
    without overlapping fail it too; they are refused, which is safe.)"""
    if any(size == 0 for size in sizes):
        return True
    reach = 0                                   # the largest offset the smaller dimensions reach
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, last + 1)`` a view reaches (empty for an empty tensor)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def no_shared_memory(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor] | None = None) -> None:
    """Refuse ``written`` tensors that share memory with one another or with a ``read`` one
    (the same tensor passed twice, or overlapping views of one buffer): one write would land on
    another, or on what is still to be read.

    Tensors whose bytes lie apart pass at once (sorted by address, each is compared only with
    those whose bytes it meets). Two views of one buffer with the same shape, strides and dtype
    (a key and a value cache cut from one allocation, block by block) pass if stacking them as
    one more dimension overlaps nothing. Other overlapping views are refused."""
    items = [(*byte_range(t), name, t, name in written)
             for name, t in {**(read or {}), **written}.items() if t.numel()]
    items.sort(key=lambda item: item[0])
    reaching: list[tuple] = []                  # those whose bytes reach past the current start
    for item in items:
        start = item[0]
        reaching = [o for o in reaching if o[1] > start]
        for other in reaching:
            if item[4] or other[4]:
                _apart(other[2], other[3], item[2], item[3])
        reaching.append(item)


def _apart(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """``a`` and ``b``, whose bytes meet, do not share an element (or a ``ValueError``)."""
    delta, rest = divmod(abs(b.data_ptr() - a.data_ptr()), max(a.element_size(), 1))
    if (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and rest == 0
            and _dims_apart((*a.shape, 2), (*a.stride(), delta))):
        return
    same = delta == 0 and rest == 0 and a.shape == b.shape and a.stride() == b.stride()
    how = "are the same memory" if same else "overlap in memory"
    raise ValueError(f"{a_name} and {b_name} {how}, and one of them is written: pass tensors that do not "
                     f"share memory (shapes {list(a.shape)} and {list(b.shape)}, strides {list(a.stride())} "
                     f"and {list(b.stride())}, {abs(b.data_ptr() - a.data_ptr())} bytes apart)")


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


def flag(name: str, value: object) -> bool:
    """A safety switch such as ``check_ids``: ``True`` or ``False`` only. ``None`` or ``0``
    would read as False and turn a check off without anyone asking for it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """An int >= 1 (``bool`` is not one); ``TypeError`` for another type, ``ValueError`` below 1."""
    if not is_int(value):
        raise TypeError(f"{name} must be a positive int, got {type_name(value)} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def seq_len_bound(value: object, longest: int) -> int:
    """Check a caller's ``max_seq_len``: a positive int, and not less than ``longest``.

    ``longest`` is the longest of ``seq_lens`` where the lengths were read (``check_ids=True``),
    or -1 where they were not: then the caller promises that ``max_seq_len`` is an upper bound.
    A smaller bound is refused because the kernels size their work (and v1 its shared memory,
    v2 its partitions) by it, so tokens past it would be dropped or worse.
    """
    value = positive_int("max_seq_len", value)
    if value > MAX_SEQ_LEN:
        raise ValueError(f"max_seq_len must be <= {MAX_SEQ_LEN} (the kernels count tokens in 32 bits), got {value}")
    if longest > value:
        raise ValueError(f"max_seq_len ({value}) must be >= the longest of seq_lens ({longest})")
    return value


def contiguous(why: str, **tensors: torch.Tensor) -> None:
    """Refuse a view whose memory is not the plain row-major layout: for kernels that index a
    tensor by its shape alone, and for tensors they write (a contiguous copy would lose the write).

    The view itself is valid (the reference and Triton take it), so this is a limit of the
    implementation named in ``why``: ``KernelUnavailable``, not a ``ValueError``."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise KernelUnavailable(f"{name} must be contiguous for {why} (got shape {list(t.shape)}, "
                             f"strides {list(t.stride())})")


def rows_of_heads(why: str, **tensors: torch.Tensor) -> None:
    """``[tokens, heads, head_size]`` whose heads lie back to back within a token (any token
    stride): kernels that read a token's ``heads * head_size`` elements as one run need it. Like
    :func:`contiguous`, a limit of one implementation (``KernelUnavailable``)."""
    for name, t in tensors.items():
        if t.stride(2) != 1 or (t.size(1) > 1 and t.stride(1) != t.size(2)):
            raise KernelUnavailable(f"{name} must have contiguous heads within each token (strides [*, {t.size(2)}, 1]) "
                             f"for {why}, got {list(t.stride())}")


def kv_dtype(name: str, value: object) -> str:
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


def quant_scale(name: str, s: object, num_heads: int | None = None) -> torch.Tensor:
    """A float32 scale tensor of shape [1] (or [num_heads] where per-head scales are allowed)."""
    tensor(name, s, ndim=1, dtypes=(torch.float32,))
    allowed = (1,) if num_heads is None else (1, num_heads)
    if s.numel() not in allowed:
        raise ValueError(f"{name} must have shape {' or '.join(f'[{a}]' for a in allowed)}, got {list(s.shape)}")
    return s


def slots(name: str, slots: torch.Tensor, num_slots: int, max_tokens: int, check_values: bool = True) -> None:
    """Slots are int64, one per token (at most ``max_tokens``), and each < ``num_slots`` or negative.
    ``check_values=False`` skips the last check, the only one that reads the slots themselves."""
    tensor(name, slots, ndim=1, dtypes=(torch.int64,))
    if slots.numel() > max_tokens:
        raise ValueError(f"{name} has {slots.numel()} entries but only {max_tokens} tokens were given")
    # Reading the slots is a device-to-host copy (a wait for the GPU), which a CUDA-graph capture
    # forbids: a captured step's slots are checked when the engine builds them, not here.
    if check_values and slots.numel() and not _capturing(slots) and int(slots.max()) >= num_slots:
        raise ValueError(
            f"{name} holds slot {int(slots.max())} but the cache has only {num_slots} slots "
            f"(num_blocks * block_size); negative slots mean 'skip this token'"
        )


def _capturing(t: torch.Tensor) -> bool:
    """True while ``t``'s GPU stream is being captured into a CUDA graph (no host reads then)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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
    flag("check_ids", check_ids)
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


def slopes(slopes: torch.Tensor | None, num_heads: int) -> None:
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


# --------------------------------------------------------------------------------------------
# 2. One preamble per operation, called first by every front-end of it
# --------------------------------------------------------------------------------------------

def check_flash_decode_args(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                            check_ids: bool = True, *, scale: object, out: torch.Tensor | None = None,
                            max_seq_len: object = None, num_splits: object = None) -> int:
    """Decode over the flash layout (``ref_decode_attention`` and every ``paged_attention_decode``).

    Checks the inputs, ``out`` for the kernels that write into one, and the kernels' options
    ``max_seq_len`` (an upper bound on ``seq_lens``, refused when smaller than the longest read)
    and ``num_splits`` (a positive int). Returns the bound the kernels size their work by:
    ``max_seq_len`` if given, else the longest sequence (0 for an empty batch).

    Strides are not checked here: the reference reads any view; each kernel checks what it needs.
    """
    flag("check_ids", check_ids)
    tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    tensor("key_cache", key_cache, ndim=4)
    tensor("value_cache", value_cache, ndim=4)
    same_device(query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, seq_lens=seq_lens)
    num_seqs, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    shape("key_cache", key_cache, (None, None, None, head_size))
    shape("value_cache", value_cache, tuple(key_cache.shape))
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError(
            f"key_cache and value_cache must have the query's dtype {query.dtype}, "
            f"got {key_cache.dtype} and {value_cache.dtype}"
        )
    gqa(num_heads, num_kv_heads)
    slopes(alibi_slopes, num_heads)
    softmax_scale("scale", scale)
    longest = block_tables_and_lens(block_tables, seq_lens, num_seqs=num_seqs, block_size=block_size,
                                    num_blocks=num_blocks, check_ids=check_ids)
    if out is not None:
        tensor("out", out, ndim=3, dtypes=(query.dtype,))
        shape("out", out, tuple(query.shape))
        same_device(out=out, query=query)
        no_broadcast_dims("out", out)
    if num_splits is not None:
        positive_int("num_splits", num_splits)
    if max_seq_len is not None:
        return seq_len_bound(max_seq_len, longest)
    if longest >= 0:
        return longest
    return int(seq_lens.max()) if num_seqs else 0


def _check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                       k_scale, v_scale, num_slots: int, per_head_scale: bool, check_slots: bool = True) -> None:
    """What both cache writes check once their caches' shapes are known."""
    flag("check_slots", check_slots)
    tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES)
    shape("value", value, tuple(key.shape))
    if value.dtype != key.dtype:
        raise TypeError(f"value must have the key's dtype {key.dtype}, got {value.dtype}")
    kv_dtype("kv_cache_dtype", kv_cache_dtype)
    want = cache_element_dtype(kv_cache_dtype, key.dtype)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype != want:
            raise TypeError(f"{name} must have dtype {want} for kv_cache_dtype={kv_cache_dtype!r} "
                            f"and {key.dtype} input, got {cache.dtype}")
    same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    no_broadcast_dims("key_cache", key_cache)
    no_broadcast_dims("value_cache", value_cache)
    no_shared_memory({"key_cache": key_cache, "value_cache": value_cache}, {"key": key, "value": value})
    num_heads = key.size(1)
    quant_scale("k_scale", k_scale, num_heads if per_head_scale else None)
    quant_scale("v_scale", v_scale, num_heads if per_head_scale else None)
    if k_scale.shape != v_scale.shape:
        raise ValueError(f"k_scale and v_scale must have the same shape, got {list(k_scale.shape)} "
                         f"and {list(v_scale.shape)}")
    slots("slot_mapping", slot_mapping, num_slots, key.size(0), check_values=check_slots)


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale, check_slots: bool = True) -> None:
    """``reshape_and_cache``: new tokens into v0-layout caches (``check_slots`` as for the flash
    layout's check below)."""
    tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES)
    tensor("key_cache", key_cache, ndim=5)
    tensor("value_cache", value_cache, ndim=4)
    num_blocks, num_heads, dx, block_size, x = key_cache.shape
    head_size = key.size(2)
    shape("key_cache", key_cache, (None, key.size(1), None, None, None))
    if x != v0_x(key_cache.dtype) or dx * x != head_size:
        raise ValueError(
            f"key_cache must have shape [num_blocks, num_heads, head_size / x, block_size, x] with "
            f"x = 16 // element_size = {v0_x(key_cache.dtype)}; got {list(key_cache.shape)} "
            f"for head_size {head_size}"
        )
    shape("value_cache", value_cache, (num_blocks, num_heads, head_size, block_size))
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                       k_scale, v_scale, num_blocks * block_size, per_head_scale=False, check_slots=check_slots)


def check_reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                  k_scale, v_scale, check_slots: bool = True) -> None:
    """``reshape_and_cache_flash``: new tokens into flash-layout caches (NHD or HND strides).

    Both caches are addressed with one block stride and read a head's elements as one run.
    ``check_slots=False``: the slots' values are known good (the caller built them), so they are
    not read back from the device (every other check looks at metadata only).
    """
    tensor("key", key, ndim=3)
    tensor("key_cache", key_cache, ndim=4)
    tensor("value_cache", value_cache, ndim=4)
    shape("key_cache", key_cache, (None, None, key.size(1), key.size(2)))
    shape("value_cache", value_cache, tuple(key_cache.shape))
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache must have a unit stride in their last (head_size) dimension")
    if key_cache.stride(0) != value_cache.stride(0):
        raise ValueError(f"key_cache and value_cache must have the same block stride, got "
                         f"{key_cache.stride(0)} and {value_cache.stride(0)}")
    num_blocks, block_size = key_cache.shape[:2]
    _check_cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                       k_scale, v_scale, num_blocks * block_size, per_head_scale=True, check_slots=check_slots)


def check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    """An int64 ``[num_pairs, 2]`` tensor of ``(src, dst)`` block ids, each within its cache."""
    tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,))
    if block_mapping.size(1) != 2:
        raise ValueError(f"block_mapping must have shape [num_pairs, 2] of (src, dst) ids, got {list(block_mapping.shape)}")
    if block_mapping.numel() == 0:
        return
    pairs = block_mapping.cpu()
    for col, name, limit in ((0, "src", num_src), (1, "dst", num_dst)):
        ids = pairs[:, col]
        if int(ids.min()) < 0 or int(ids.max()) >= limit:
            raise ValueError(f"block_mapping holds a {name} block id outside [0, {limit})")


def check_copy_blocks(key_caches, value_caches, block_mapping) -> bool:
    """``copy_blocks``; returns False when there is nothing to copy (no layers)."""
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise TypeError("key_caches and value_caches must be lists of tensors, one per layer")
    if len(key_caches) != len(value_caches):
        raise ValueError(f"key_caches and value_caches must have the same number of layers, "
                         f"got {len(key_caches)} and {len(value_caches)}")
    if not key_caches:
        return False
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        tensor(f"key_caches[{i}]", k)
        tensor(f"value_caches[{i}]", v)
        no_broadcast_dims(f"key_caches[{i}]", k)
        no_broadcast_dims(f"value_caches[{i}]", v)
        if k.size(0) != key_caches[0].size(0) or v.size(0) != key_caches[0].size(0):
            raise ValueError(f"every layer's caches must have {key_caches[0].size(0)} blocks; layer {i} differs")
    check_block_mapping(block_mapping, key_caches[0].size(0), key_caches[0].size(0))
    # One cache passed twice would be copied twice: with chained pairs (1 -> 2, 2 -> 3) the
    # second pass would copy what the first had just written.
    no_shared_memory({**{f"key_caches[{i}]": k for i, k in enumerate(key_caches)},
                      **{f"value_caches[{i}]": v for i, v in enumerate(value_caches)}})
    return True


def block_bytes(name: str, t: object) -> torch.Tensor:
    """A contiguous cache viewed as ``[num_blocks, bytes_per_block]`` of uint8: what a block copy moves."""
    tensor(name, t)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous to be copied block by block")
    return t.view(torch.uint8).view(t.size(0), -1)


def check_swap_blocks(src, dst, block_size_in_bytes=None, block_mapping=None) -> tuple[int, torch.Tensor]:
    """``swap_blocks``, either of vLLM's signatures; returns ``(bytes per block, block_mapping)``."""
    if block_mapping is None and isinstance(block_size_in_bytes, torch.Tensor):
        block_size_in_bytes, block_mapping = None, block_size_in_bytes
    if block_mapping is None:
        raise TypeError("swap_blocks needs block_mapping: swap_blocks(src, dst, [block_size_in_bytes,] block_mapping)")
    src_b, dst_b = block_bytes("src", src), block_bytes("dst", dst)
    tensor("block_mapping", block_mapping, device=torch.device("cpu"))
    check_block_mapping(block_mapping, src.size(0), dst.size(0))
    nbytes = src.element_size() * src.stride(0) if block_size_in_bytes is None else block_size_in_bytes
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise TypeError(f"block_size_in_bytes must be a positive int, got {block_size_in_bytes!r}")
    if nbytes > min(src_b.size(1), dst_b.size(1)):
        raise ValueError(f"block_size_in_bytes={nbytes} exceeds a block of src ({src_b.size(1)} bytes) "
                         f"or dst ({dst_b.size(1)} bytes)")
    return nbytes, block_mapping


def check_v0_attention(out, query, key_cache, value_cache, num_kv_heads, block_tables, seq_lens,
                       block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
                       blocksparse_vert_stride, *, scale: object, check_ids: bool = True) -> None:
    """``paged_attention_v1`` and ``_v2`` over the v0 layout (v2 adds ``check_v2_buffers``).

    ``check_ids=False`` skips the block-id and length value checks, which copy the tables to the
    host (and so cannot run inside a CUDA-graph capture); ``max_seq_len`` is then the caller's
    promise of an upper bound on ``seq_lens``.
    """
    flag("check_ids", check_ids)
    tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES)
    tensor("out", out, ndim=3, dtypes=(query.dtype,))
    shape("out", out, tuple(query.shape))
    tensor("key_cache", key_cache, ndim=5)
    tensor("value_cache", value_cache, ndim=4)
    same_device(out=out, query=query, key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, seq_lens=seq_lens)
    num_seqs, num_heads, head_size = query.shape
    kv_dtype("kv_cache_dtype", kv_cache_dtype)
    want = cache_element_dtype(kv_cache_dtype, query.dtype)
    if key_cache.dtype != want or value_cache.dtype != want:
        raise TypeError(f"key_cache and value_cache must have dtype {want} for kv_cache_dtype="
                        f"{kv_cache_dtype!r}, got {key_cache.dtype} and {value_cache.dtype}")
    x = v0_x(want)
    shape("key_cache", key_cache, (None, num_kv_heads, head_size // x, block_size, x))
    shape("value_cache", value_cache, (key_cache.size(0), num_kv_heads, head_size, block_size))
    if head_size % x:
        raise ValueError(f"head_size ({head_size}) must be a multiple of x = {x}")
    gqa(num_heads, num_kv_heads)
    slopes(alibi_slopes, num_heads)
    quant_scale("k_scale", k_scale)
    quant_scale("v_scale", v_scale)
    softmax_scale("scale", scale)
    no_broadcast_dims("out", out)
    if blocksparse_vert_stride > 1:
        raise KernelUnavailable("block-sparse attention (blocksparse_vert_stride > 1) is not implemented in "
                                "this project, by any of its kernels")
    positive_int("max_seq_len", max_seq_len)
    longest = block_tables_and_lens(block_tables, seq_lens, num_seqs=num_seqs, block_size=block_size,
                                    num_blocks=key_cache.size(0), check_ids=check_ids)
    seq_len_bound(max_seq_len, longest)


def check_v2_buffers(exp_sums, max_logits, tmp_out, query, max_seq_len: int) -> None:
    """v2's scratch tensors: one entry (or output row) per sequence, head and 512-token partition."""
    num_seqs, num_heads, head_size = query.shape
    num_partitions = cdiv(max_seq_len, PARTITION_SIZE)
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits)):
        tensor(name, t, dtypes=(torch.float32,), device=query.device)
        shape(name, t, (num_seqs, num_heads, num_partitions))
    tensor("tmp_out", tmp_out, dtypes=(query.dtype,), device=query.device)
    shape("tmp_out", tmp_out, (num_seqs, num_heads, num_partitions, head_size))
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits), ("tmp_out", tmp_out)):
        no_broadcast_dims(name, t)
