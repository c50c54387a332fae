"""Exercises of ``00_overview.ipynb``."""
from __future__ import annotations

from paged_attention.exercises import as_choice, as_int, report
from paged_attention.memory_sim import simulate, synthetic_trace
from paged_attention.utils import cdiv, slot_mapping


def blocks_for_request(blocks: int, wasted_slots: int, prompt_len: int = 161, output_len: int = 338,
                       block_size: int = 16) -> bool:
    """Exercise 1: blocks a finished request holds, and the slots of its last block left empty."""
    answer = (as_int(blocks, "blocks"), as_int(wasted_slots, "wasted_slots"))
    total = prompt_len + output_len
    need = cdiv(total, block_size)
    return report(
        answer == (need, need * block_size - total),
        f"{total} tokens fill {need} blocks of {block_size}, leaving {need * block_size - total} slots empty",
        "a request of n tokens needs ceil(n / block_size) blocks; only the last one can be partly empty",
    )


def slot_of(answer: int, block_table: list[list[int]], seq_lens: list[int], seq: int, token: int,
            block_size: int) -> bool:
    """Exercise 2: the slot that token ``token`` of sequence ``seq`` is written to."""
    answer = as_int(answer, "answer")
    start = sum(seq_lens[:seq])
    expected = slot_mapping(block_table, seq_lens, block_size)[start + token]
    return report(
        answer == expected,
        f"token {token} of sequence {seq} is written to slot {expected}",
        "find the logical block (token // block_size), look up its physical block in the table, then "
        "slot = physical block * block_size + token % block_size",
    )


def bigger_blocks(answer: str, block_sizes: tuple[int, int] = (16, 128), num_requests: int = 300) -> bool:
    """Exercise 3: does paging's useful share go 'up' or 'down' when blocks grow from 16 to 128?"""
    answer = as_choice(answer, "answer", ("up", "down"))
    trace = synthetic_trace(num_requests, seed=1)
    small, large = (simulate(trace, "paged", block_size=b).useful for b in block_sizes)
    expected = "up" if large > small else "down"
    return report(
        answer == expected,
        f"useful share {100 * small:.1f}% with {block_sizes[0]}-token blocks, {100 * large:.1f}% with {block_sizes[1]}",
        "which kind of waste does a bigger block add? Look at what is left empty in each request's last block",
    )
