"""Small helpers shared by every section: the device enum, integer helpers, the padding slot.

They mirror the helpers vLLM keeps in ``vllm/utils`` so that code here reads like the code there.
"""
from __future__ import annotations

import enum
from typing import Iterator, Sequence, TypeVar

import numpy as np
import torch

T = TypeVar("T")

# A slot id that kernels skip: padding tokens (CUDA-graph padding, dummy runs) map to it.
PAD_SLOT_ID: int = -1


class Device(enum.Enum):
    """Where a block lives. The legacy allocators keep one pool per device."""

    GPU = enum.auto()
    CPU = enum.auto()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: how many blocks of size ``b`` hold ``a`` items."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two that is >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def chunk_list(lst: Sequence[T], chunk_size: int) -> Iterator[Sequence[T]]:
    """Yield successive ``chunk_size`` slices of ``lst``; the last one may be shorter.

    This is how a token list is cut into blocks: ``chunk_list(tokens, block_size)``.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    for i in range(0, len(lst), chunk_size):
        yield lst[i:i + chunk_size]


# ---- Errors where vLLM asserts -------------------------------------------------------------------
class VllmAssertion(AssertionError):
    """The base every error of a check that vLLM makes with ``assert`` also has.

    vLLM checks some invariants with ``assert`` (a block freed twice, two specs of one KV-cache
    group that differ), and its tests expect ``AssertionError`` there. Ours raise a typed error
    that says what went wrong (a ValueError, a KeyError, a TypeError) and also derives from this
    class, so code written against vLLM still catches it.
    """


# ---- Argument checks shared by the block tables ---------------------------------------------------
def is_int(x: object) -> bool:
    """A plain or numpy integer, but not a bool (``True`` is an int to Python)."""
    # A plain int, by far the most common, answers at once (hot paths check every argument).
    return type(x) is int or (isinstance(x, (int, np.integer))
                              and not isinstance(x, (bool, np.bool_)))


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``: TypeError if it is not an int, ValueError if too small."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_int_list(name: str, values: object, minimum: int) -> list[int]:
    """``values`` (a list, tuple, range or 1-d numpy array) as a list of ints >= ``minimum``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a list of ints, got {values!r}")
    return [check_int(f"{name}[{i}]", v, minimum) for i, v in enumerate(values)]


def check_count(name: str, value: object, maximum: int, max_name: str) -> int:
    """``value`` as an int in ``[0, maximum]`` (``max_name`` names the limit in the error)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} must be between 0 and {max_name}={maximum}, got {value}")
    return int(value)


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a ``torch.device`` that this machine has.

    Takes a ``torch.device``, a device string (``"cpu"``, ``"cuda:0"``, ``"meta"``) or a GPU
    index. TypeError for anything else, ValueError for a string torch cannot parse or a GPU this
    machine lacks, so a bad device fails here with its name rather than deep inside torch.
    """
    if isinstance(device, torch.device):
        dev = device
    elif is_int(device):
        if device < 0:
            raise ValueError(f"{name} must be a GPU index >= 0, got {device}")
        dev = torch.device("cuda", int(device))
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"{name} must name a torch device such as 'cpu' or 'cuda:0', "
                             f"got {device!r}") from None
    else:
        raise TypeError(f"{name} must be a torch.device, a device string or a GPU index, "
                        f"got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} is {dev}, but torch sees no CUDA device; use "
                             f"paged_attention.DEVICE")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name} is {dev}, but torch sees only "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


# ---- The slot mapping, in plain Python ------------------------------------------------------------
# Token t of sequence s is written to the cache row ("slot")
#     block_table[s][t // block_size] * block_size + t % block_size,
# the physical block that holds its logical block, flattened with its offset in that block.

def as_list(value: object, name: str) -> list:
    """A list from a list, tuple, numpy array or torch tensor (through ``.tolist()``)."""
    if hasattr(value, "tolist"):  # numpy arrays and torch tensors
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list, a numpy array or a tensor, "
                        f"got {type(value).__name__}")
    return list(value)


def check_block_table(block_table: object, seq_lens: object,
                      block_size: object) -> tuple[list[list[int]], list[int], int]:
    """Validate a block table, its lengths and the block size; return (rows cut to the blocks in
    use, seq_lens, block_size) as plain ints.

    Row ``s`` of the table needs ``cdiv(seq_lens[s], block_size)`` entries; anything after that
    (padding, stale ids) is ignored, as the kernels ignore it. Extra rows are ignored too, so a
    whole ``max_num_reqs``-row table can be passed with the lengths of its first rows.
    """
    if not is_int(block_size) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    lens = as_list(seq_lens, "seq_lens")
    for s, length in enumerate(lens):
        if not is_int(length) or length < 0:
            raise ValueError(f"seq_lens[{s}] must be an int >= 0, got {length!r}")
    table = as_list(block_table, "block_table")
    if len(table) < len(lens):
        raise ValueError(f"block_table has {len(table)} rows but seq_lens has {len(lens)} "
                         "sequences; expected one row per sequence")

    rows = []
    for s, length in enumerate(lens):
        row = as_list(table[s], f"block_table[{s}]")
        needed = cdiv(length, block_size)
        if len(row) < needed:
            raise ValueError(f"block_table[{s}] has {len(row)} entries, but seq_lens[{s}]="
                             f"{length} needs {needed} blocks of block_size={block_size}")
        for j, block_id in enumerate(row[:needed]):
            if not is_int(block_id) or block_id < 0:
                raise ValueError(f"block_table[{s}][{j}] must be a block id >= 0, "
                                 f"got {block_id!r}")
        rows.append([int(b) for b in row[:needed]])
    return rows, [int(n) for n in lens], int(block_size)


def slot_mapping(block_table: object, seq_lens: object, block_size: int) -> list[int]:
    """The slot of every token of every sequence, sequence after sequence, in token order.

    >>> slot_mapping([[3, 0], [1]], [6, 2], 4)
    [12, 13, 14, 15, 0, 1, 4, 5]
    """
    rows, lens, block_size = check_block_table(block_table, seq_lens, block_size)
    return [rows[s][t // block_size] * block_size + t % block_size
            for s, length in enumerate(lens) for t in range(length)]
