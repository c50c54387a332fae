"""Exercises of ``03_v1_block_table.ipynb``.

Each checker builds its scenario with the v1 ``BlockTable`` and compares the student's answer
with what the table actually holds or computes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from paged_attention.exercises import as_int, as_int_list, report
from paged_attention.v1.block_table import BlockTable


def _table(block_size: int, max_num_reqs: int, max_num_blocks_per_req: int, kernel_block_size: int | None = None,
           **dcp) -> BlockTable:
    return BlockTable(block_size, max_num_reqs, max_num_blocks_per_req, 16, False, "cpu",
                      kernel_block_size or block_size, dcp.pop("interleave", 1), **dcp)


def _slot(table: BlockTable, row: int, position: int) -> int:
    table.compute_slot_mapping(np.array([row]), np.array([position]))
    return int(table.slot_mapping.np[0])


def token_slot(answer: int, position: int = 37, row: Sequence[int] = (12, 3, 40), block_size: int = 16) -> bool:
    """Exercise 1: a request's row holds blocks ``row``; which slot is the token at ``position``
    written to?"""
    row = [int(b) for b in row]
    table = _table(block_size, 1, max(len(row), 1))
    table.add_row(row, 0)
    expected = _slot(table, 0, position)
    column, offset = divmod(position, block_size)
    return report(
        as_int(answer, "answer") == expected,
        f"position {position} is in column {column} (block {row[column]}) at offset {offset}: "
        f"{row[column]} * {block_size} + {offset} = {expected}",
        "find the column first (position // block_size), look the block id up in the row, then "
        "block id * block_size + position % block_size",
    )


def row_after_condense(row: Sequence[int], count: int) -> bool:
    """Exercise 2: blocks of 4, rows of 6 columns. A = [3, 7, 10] is added in row 0, B = [2, 5]
    in row 1, C = [1, 4, 6, 8] in row 2. A finishes (``clear_row(0)``), the batch is condensed
    (``move_row(2, 0)``), a request E with one block [13] is added in the free row 2
    (``add_row``), and rows 1 and 2 are swapped (``swap_row(1, 2)``). What does row 1 hold, all
    six columns, and what is its count?"""
    table = _table(4, 3, 6)
    for ids, r in (([3, 7, 10], 0), ([2, 5], 1), ([1, 4, 6, 8], 2)):
        table.add_row(ids, r)
    table.clear_row(0)
    table.move_row(2, 0)
    table.add_row([13], 2)
    table.swap_row(1, 2)
    expected_row = table.get_numpy_array()[1].tolist()
    expected_count = int(table.num_blocks_per_row[1])
    return report(
        (as_int_list(row, "row"), as_int(count, "count")) == (expected_row, expected_count),
        f"row 1 is {expected_row} with count {expected_count}: move_row left C's ids in row 2, add_row "
        f"overwrote only its first column, and swap_row moved the whole row, stale columns and all",
        "move_row copies the used columns and leaves the source row as it was; add_row writes from "
        "column 0 and sets the count, but does not clear the columns after; swap_row exchanges every "
        "column and the counts",
    )


def dcp_slot(rank: int, slot: int, position: int = 21, row: Sequence[int] = (10, 11, 12), dcp_world_size: int = 4,
             interleave: int = 2, block_size: int = 4) -> bool:
    """Exercise 3: decode context parallelism over ``dcp_world_size`` ranks with interleave
    ``interleave`` and blocks of ``block_size``; every rank's row holds ``row``. Which rank stores
    the token at ``position``, and at which slot of that rank's cache?"""
    row = [int(b) for b in row]
    slots = []
    for r in range(dcp_world_size):
        table = _table(block_size, 1, max(len(row), 1), interleave=interleave, dcp_world_size=dcp_world_size,
                       dcp_rank=r)
        table.add_row(row, 0)
        slots.append(_slot(table, 0, position))
    owners = [r for r, s in enumerate(slots) if s >= 0]
    expected = (owners[0], slots[owners[0]])
    run = position // interleave
    local = (position // (dcp_world_size * interleave)) * interleave + position % interleave
    return report(
        (as_int(rank, "rank"), as_int(slot, "slot")) == expected,
        f"position {position} is in run {run} of {interleave}, so rank {run} % {dcp_world_size} = {expected[0]}; "
        f"it is that rank's local token {local}: block {row[local // block_size]}, offset {local % block_size}, "
        f"slot {expected[1]}; every other rank writes -1",
        "runs of `interleave` positions are dealt to the ranks in turn (rank = (p // interleave) % world); "
        "the owner packs its tokens densely: local = (p // (world * interleave)) * interleave + p % interleave, "
        "which then goes through the row like a position without DCP",
    )


def kernel_slot(kernel_block: int, slot: int, position: int = 40, row: Sequence[int] = (5, 9), block_size: int = 32,
                kernel_block_size: int = 16) -> bool:
    """Exercise 4: hybrid blocks. The manager allocates blocks of ``block_size`` tokens, the
    kernel reads blocks of ``kernel_block_size``; a request holds manager blocks ``row``. Which
    kernel block holds the token at ``position``, and what is its slot?"""
    row = [int(b) for b in row]
    table = _table(block_size, 1, max(len(row), 1), kernel_block_size=kernel_block_size)
    table.add_row(row, 0)
    expected_slot = _slot(table, 0, position)
    expected_block = int(table.get_numpy_array()[0, position // table.block_size])
    bpk = block_size // kernel_block_size
    manager = row[position // block_size]
    return report(
        (as_int(kernel_block, "kernel_block"), as_int(slot, "slot")) == (expected_block, expected_slot),
        f"manager block {manager} is kernel blocks {manager * bpk}..{manager * bpk + bpk - 1}; position {position} "
        f"is kernel column {position // kernel_block_size}, kernel block {expected_block}, slot "
        f"{expected_block} * {kernel_block_size} + {position % kernel_block_size} = {expected_slot}, the same as "
        f"{manager} * {block_size} + {position % block_size}",
        "the table stores kernel blocks: manager block b becomes kernel blocks b * bpk + 0 .. bpk - 1 "
        "(bpk = block_size // kernel_block_size), and the slot is counted in kernel blocks",
    )
