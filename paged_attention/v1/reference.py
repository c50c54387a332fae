"""The slot mapping one token at a time, in plain Python: the yardstick for ``compute_slot_mapping``.

``BlockTable.compute_slot_mapping`` computes every token's slot in a few numpy operations over
the whole batch. ``slot_mapping_loop`` computes the same numbers the way one would by hand, a
token at a time, so that

* a reader can check the vectorised version against the formula it implements (the tests do,
  on random batches, with and without decode context parallelism);
* notebook 03 can time the two and see what vectorising buys as batches grow.

With decode context parallelism (DCP) the loop takes another route to the same slots than
``BlockTable`` does, which makes the comparison worth more. Tokens are dealt to the
``dcp_world_size`` ranks in runs of ``interleave`` consecutive positions:

    owner rank of position p      = (p // interleave) % dcp_world_size         (dcp_owner_rank)
    its place among that rank's   = (p // (dcp_world_size * interleave)) * interleave
    tokens (the local position)     + p % interleave                            (dcp_local_position)

and a rank stores its own tokens densely, as if they were a sequence of their own: the local
position goes through the table exactly like a position without DCP. (``BlockTable`` instead
cuts the global positions into "virtual blocks" of ``block_size * dcp_world_size``; when
``interleave`` divides ``block_size``, which ``BlockTable`` requires, both give the same slot.)
"""
from __future__ import annotations

from typing import Any, Sequence

from paged_attention.utils import PAD_SLOT_ID
from paged_attention.v1.block_table import BlockTable


def _check_position(name: str, value: Any) -> int:
    if not hasattr(value, "__index__") or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_dcp(dcp_world_size: Any, interleave: Any) -> tuple[int, int]:
    world = _check_position("dcp_world_size", dcp_world_size)
    step = _check_position("interleave", interleave)
    if world < 1 or step < 1:
        raise ValueError(f"dcp_world_size and interleave must be >= 1, got {world} and {step}")
    return world, step


def dcp_owner_rank(position: int, dcp_world_size: int, interleave: int = 1) -> int:
    """The DCP rank that stores the KV of token ``position``: runs of ``interleave`` consecutive
    positions go to ranks 0, 1, ..., ``dcp_world_size - 1`` in turn, then round again.

    >>> [dcp_owner_rank(p, 2, 1) for p in range(6)], [dcp_owner_rank(p, 2, 2) for p in range(6)]
    ([0, 1, 0, 1, 0, 1], [0, 0, 1, 1, 0, 0])
    """
    position = _check_position("position", position)
    world, step = _check_dcp(dcp_world_size, interleave)
    return (position // step) % world


def dcp_local_position(position: int, dcp_world_size: int, interleave: int = 1) -> int:
    """Where token ``position`` comes among the tokens its owner rank stores (0, 1, 2, ...).

    Before it came ``position // (dcp_world_size * interleave)`` whole rounds of dealing, each of
    which gave the owner ``interleave`` tokens, and then its place within its own run.

    >>> [dcp_local_position(p, 2, 2) for p in range(8)]
    [0, 1, 0, 1, 2, 3, 2, 3]
    """
    position = _check_position("position", position)
    world, step = _check_dcp(dcp_world_size, interleave)
    return (position // (world * step)) * step + position % step


def slot_mapping_loop(block_table: BlockTable, req_indices: Sequence[int], positions: Sequence[int]) -> list[int]:
    """The slot of every token, one token at a time: what ``block_table.compute_slot_mapping(
    req_indices, positions)`` writes to ``slot_mapping.np[:num_tokens]``, as a list.

    Token ``t`` belongs to the request in row ``req_indices[t]`` and sits at ``positions[t]``.
    Without DCP its slot is ``row[p // B] * B + p % B`` (``B = block_table.block_size``, the
    kernel block size). With DCP (``block_table.dcp_world_size > 1``) a token that another rank
    stores gets ``PAD_SLOT_ID`` (-1), and one this rank stores goes through the table at its
    local position. Reads the host table (``get_numpy_array``), as ``compute_slot_mapping`` does.
    Nothing is checked beyond what indexing the table checks: this is a yardstick, not an API.
    """
    if not isinstance(block_table, BlockTable):
        raise TypeError(f"block_table must be a v1 BlockTable, got {type(block_table).__name__}")
    if len(req_indices) != len(positions):
        raise ValueError(f"req_indices and positions must have the same length, "
                         f"got {len(req_indices)} and {len(positions)}")
    table = block_table.get_numpy_array()
    B = block_table.block_size
    world, rank = block_table.dcp_world_size, block_table.dcp_rank
    step = block_table.dcp_kv_cache_interleave_size

    slots = []
    for row, p in zip(req_indices, positions):
        row, p = int(row), int(p)
        if world > 1:
            if (p // step) % world != rank:          # another rank stores this token
                slots.append(PAD_SLOT_ID)
                continue
            p = (p // (world * step)) * step + p % step   # this rank's local position
        block_id = int(table[row, p // B])
        slots.append(block_id * B + p % B)
    return slots
