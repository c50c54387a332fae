"""v1's slot mapping on the host: ``BlockTable.compute_slot_mapping`` (numpy over the whole batch)
against a plain Python loop (notebook 03; ``benchmarks/bench_slot_mapping.py``).

Host-only numpy and Python, so the figures are the CPU's, on any machine; print ``cpu_name()``
with them.
"""
from __future__ import annotations

import numpy as np

from paged_attention.bench.timing import best_us
from paged_attention.utils import cdiv
from paged_attention.v1.block_table import BlockTable
from paged_attention.v1.reference import slot_mapping_loop

# (requests, tokens scheduled per request): first more requests of 16 tokens, then 8 requests
# with longer and longer chunks (1 token each: a pure decode batch).
SLOT_MAPPING_BATCH_SWEEP = ((1, 16), (4, 16), (16, 16), (64, 16), (256, 16), (1024, 16))
SLOT_MAPPING_TOKEN_SWEEP = ((8, 1), (8, 8), (8, 64), (8, 512), (8, 2048))
SLOT_MAPPING_IMPLS = ("compute_slot_mapping (numpy)", "Python loop")


def slot_mapping_batch(num_reqs: int, tokens_per_req: int, block_size: int = 16, context: int = 2048,
                       seed: int = 0):
    """A v1 ``BlockTable`` holding ``num_reqs`` requests and the ``(req_indices, positions)`` of
    one step that schedules ``tokens_per_req`` tokens of each, as vLLM's ``_prepare_inputs``
    builds them: each request has already computed a random number of tokens (below
    ``context``), and its new tokens follow; every request's blocks are distinct random ids."""
    for name, value in (("num_reqs", num_reqs), ("tokens_per_req", tokens_per_req), ("block_size", block_size),
                        ("context", context)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rng = np.random.default_rng(seed)
    computed = rng.integers(0, context, size=num_reqs)
    blocks_per_req = cdiv(context + tokens_per_req, block_size)
    table = BlockTable(block_size, num_reqs, blocks_per_req, num_reqs * tokens_per_req, False, "cpu", block_size, 1)
    ids = rng.permutation(num_reqs * blocks_per_req).reshape(num_reqs, blocks_per_req)
    for row in range(num_reqs):
        table.add_row(ids[row], row)
    req_indices = np.repeat(np.arange(num_reqs, dtype=np.int32), tokens_per_req)
    positions = (np.repeat(computed, tokens_per_req) + np.tile(np.arange(tokens_per_req), num_reqs)).astype(np.int64)
    return table, req_indices, positions


def slot_mapping_times(shapes=SLOT_MAPPING_BATCH_SWEEP, *, block_size: int = 16, min_time: float = 0.02,
                       repeat: int = 5, print_fn=print) -> tuple[list[int], dict[str, list[float]]]:
    """Time ``BlockTable.compute_slot_mapping`` and ``slot_mapping_loop`` on one step's batch for
    every ``(num_reqs, tokens_per_req)`` in ``shapes`` (``slot_mapping_batch``), after checking
    that both give the same slots.

    Returns ``(num_tokens, {name: [µs, ...]})``: the tokens in each batch, and the time per
    call of each implementation (names: ``SLOT_MAPPING_IMPLS``). Host-only numpy and Python,
    so the figures mean the same on any machine; print ``cpu_name()`` with them.
    """
    shapes = [tuple(s) for s in shapes]
    if not shapes:
        raise ValueError("shapes must hold at least one (num_reqs, tokens_per_req) pair")
    num_tokens: list[int] = []
    times: dict[str, list[float]] = {name: [] for name in SLOT_MAPPING_IMPLS}
    for num_reqs, tokens_per_req in shapes:
        table, req_indices, positions = slot_mapping_batch(num_reqs, tokens_per_req, block_size)
        n = len(positions)
        table.compute_slot_mapping(req_indices, positions)
        if table.slot_mapping.np[:n].tolist() != slot_mapping_loop(table, req_indices, positions):
            raise AssertionError(f"compute_slot_mapping and the loop disagree on {num_reqs} x {tokens_per_req} tokens")
        numpy_us = best_us(lambda: table.compute_slot_mapping(req_indices, positions), min_time, repeat)
        loop_us = best_us(lambda: slot_mapping_loop(table, req_indices, positions), min_time, repeat)
        num_tokens.append(n)
        times[SLOT_MAPPING_IMPLS[0]].append(numpy_us)
        times[SLOT_MAPPING_IMPLS[1]].append(loop_us)
        print_fn(f"{num_reqs:>4} requests x {tokens_per_req:>4} tokens = {n:>5} tokens: "
                 f"numpy {numpy_us:>8.1f} us   loop {loop_us:>9.1f} us   loop / numpy {loop_us / numpy_us:>6.1f}")
    return num_tokens, times
