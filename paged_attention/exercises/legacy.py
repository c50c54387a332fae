"""Exercises of ``01_legacy_block_table.ipynb``.

Each checker replays its scenario on the legacy block layer and compares the student's answer
with what the allocator actually did.
"""
from __future__ import annotations

from typing import Sequence

from paged_attention.exercises import as_int, as_int_list, report
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator, eviction_order
from paged_attention.legacy.cpu_gpu_block_allocator import refcounts as pool_refcounts   # `refcounts`: an answer
from paged_attention.utils import Device


def _naive(num_gpu_blocks: int, block_size: int) -> CpuGpuBlockAllocator:
    return CpuGpuBlockAllocator.create("naive", num_gpu_blocks, 0, block_size)


def cow_after_fork(refcounts: Sequence[int], pair: tuple[int, int], prompt_len: int = 10,
                   block_size: int = 4) -> bool:
    """Exercise 1: a prompt is allocated in a fresh pool, forked, and the fork appends one token.
    The reference counts of blocks 0, 1, 2, ... (one more than the prompt took), then the
    copy-on-write pair ``(src, dst)`` recorded."""
    answer_counts = as_int_list(refcounts, "refcounts")
    answer_pair = tuple(as_int_list(pair, "pair")) if pair is not None else None
    allocator = _naive(8, block_size)
    parent = BlockTable(block_size, allocator)
    parent.allocate(list(range(prompt_len)))
    child = parent.fork()
    child.append_token_ids([prompt_len])
    expected_counts = pool_refcounts(allocator)[:len(parent.physical_block_ids) + 1]
    cows = allocator.clear_copy_on_writes()
    expected_pair = cows[0] if cows else None
    return report(
        answer_counts == expected_counts and answer_pair == expected_pair,
        f"reference counts {expected_counts}: the fork wrote into the shared block {expected_pair[0]} and "
        f"moved to block {expected_pair[1]}" if expected_pair else
        f"reference counts {expected_counts}, and nothing was copied",
        "a fork adds a holder to every block (nothing is copied yet); the first write into a block with "
        "more than one holder moves the writer to a fresh block (the next free id) and records "
        "(old id, new id); the old block loses one holder",
    )


def next_ids(answer: Sequence[int], num_gpu_blocks: int = 8, block_size: int = 4) -> bool:
    """Exercise 2: A and B take 8 tokens each, A is freed, then C asks for 12 tokens: which ids
    does C get, in table order?"""
    allocator = _naive(num_gpu_blocks, block_size)
    tables = {name: BlockTable(block_size, allocator) for name in "ABC"}
    tables["A"].allocate(list(range(2 * block_size)))
    tables["B"].allocate(list(range(100, 100 + 2 * block_size)))
    tables["A"].free()
    tables["C"].allocate(list(range(200, 200 + 3 * block_size)))
    expected = tables["C"].physical_block_ids
    return report(
        as_int_list(answer, "answer") == expected,
        f"C gets {expected}: the ids A freed come back first, the last one freed first",
        "the free list is a deque: ids are taken from its left end, and a freed id is put back on the "
        "left; A frees its blocks in table order",
    )


def eviction_sequence(answer: Sequence[int], block_size: int = 4) -> bool:
    """Exercise 3: with prefix caching, A (12 tokens) was last used at t = 1 and B (8 other
    tokens) at t = 2; both are freed. In which order does the evictor give their blocks up?"""
    allocator = CpuGpuBlockAllocator.create("prefix_caching", 8, 0, block_size)
    a, b = BlockTable(block_size, allocator), BlockTable(block_size, allocator)
    a.allocate(list(range(3 * block_size)))
    b.allocate(list(range(100, 100 + 2 * block_size)))
    allocator.mark_blocks_as_accessed(a.physical_block_ids, 1.0)
    allocator.mark_blocks_as_accessed(b.physical_block_ids, 2.0)
    ids = {"A": list(a.physical_block_ids), "B": list(b.physical_block_ids)}   # free() empties the live list
    a.free()
    b.free()
    expected = eviction_order(allocator)
    return report(
        as_int_list(answer, "answer") == expected,
        f"order {expected}: A's blocks {ids['A']} first (older), tail before head; then B's {ids['B']}",
        "the oldest access goes first; among blocks used at the same time, the one ending the longer "
        "prefix (the chain's tail) goes before its head",
    )


def window_table(ids: Sequence[int], num_free: int) -> bool:
    """Exercise 4: continue the sliding-window trace (block size 4, window of 2 blocks, 16 GPU
    blocks): after step 4, append 4 tokens with ``num_computed_slots=20``. The table's ids and
    the number of free GPU blocks afterwards."""
    allocator = _naive(16, 4)
    table = BlockTable(4, allocator, max_block_sliding_window=2)
    table.allocate(list(range(10)))
    for tokens, computed in (([10], 10), ([11, 12], 11), ([13], 16), ([14, 15, 16, 17], 20)):
        table.append_token_ids(tokens, num_computed_slots=computed)
    expected = table.physical_block_ids
    free = allocator.get_num_free_blocks(Device.GPU)
    return report(
        (as_int_list(ids, "ids"), as_int(num_free, "num_free")) == (expected, free),
        f"{expected} with {free} free: block 2 leaves the window (20 // 4 - 2 = 3 blocks dropped) and is "
        "freed first, so the new block gets its id straight back",
        "first every block before index num_computed_slots // block_size - window is freed and replaced "
        "by the null block, then new blocks are allocated for the tokens that do not fit",
    )
