"""Exercises of ``04_v2_triton_block_tables.ipynb``.

Each checker builds its scenario with the v2 ``BlockTables`` (its Triton kernels run, in the
interpreter on a CPU: a few small launches) or with the kernels' grids as lists
(``vllm_slot_programs``, ``fast_slot_programs``), and compares the student's answer with what they
hold or compute.
"""
from __future__ import annotations

from typing import Sequence

import torch

from paged_attention import runtime
from paged_attention.exercises import as_int, as_int_list, report
from paged_attention.v2.block_table import BlockTables, vllm_slot_programs
from paged_attention.v2.block_table_fast import fast_slot_programs


def _i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=runtime.DEVICE)


def slot_mapping(answer: Sequence[int], rows: dict[int, Sequence[int]] | None = None,
                 idx_mapping: Sequence[int] = (0, 3), query_start_loc: Sequence[int] = (0, 2, 3),
                 positions: Sequence[int] = (14, 15, 40), block_size: int = 16) -> bool:
    """Exercise 1: request state 0 holds blocks [9], state 3 holds [4, 12, 7] (blocks of 16).
    The batch is ``idx_mapping = [0, 3]`` with ``query_start_loc = [0, 2, 3]`` and ``positions =
    [14, 15, 40]``. What are the three tokens' slots?"""
    answer = as_int_list(answer, "answer")      # read first: a wrong type launches nothing
    rows = {0: [9], 3: [4, 12, 7]} if rows is None else {int(k): [int(b) for b in v] for k, v in rows.items()}
    num_tokens = len(positions)
    bt = BlockTables([block_size], max(rows) + 1, max(num_tokens, 1),
                     block_size * max(len(v) for v in rows.values()), runtime.DEVICE)
    for state, ids in rows.items():
        bt.append_block_ids(state, (ids,), overwrite=True)
    bt.apply_staged_writes()
    slots = bt.compute_slot_mappings(_i32(query_start_loc), _i32(positions), idx_mapping=_i32(idx_mapping))
    expected = slots[0, :query_start_loc[-1]].tolist()
    first = positions[0]
    state = idx_mapping[0]
    return report(
        answer == expected,
        f"slots {expected}: token 0 is batch position 0, so request state {state}; position {first} is column "
        f"{first // block_size} of that row (block {rows[state][first // block_size]}), offset {first % block_size}",
        "find each token's batch position from query_start_loc, its request state through idx_mapping, then "
        "row[position // block_size] * block_size + position % block_size in that state's row",
    )


def gathered_rows(row0: Sequence[int], row1: Sequence[int]) -> bool:
    """Exercise 2: one group, blocks of 4, rows of 6 columns. Step 1: request states 0, 1, 2 hold
    A = [3, 7, 10, 12], B = [5], C = [2, 9]; the batch is ``idx_mapping = [0, 2, 1]``
    (``gather_block_tables``). Step 2: A finished and D takes state 0 with [8]
    (``overwrite=True``), C gets block 11 (``overwrite=False``); the batch is ``idx_mapping = [2,
    0]``. After step 2's gather, what do rows 0 and 1 of ``input_block_tables[0]`` hold, all six
    columns?"""
    answer = (as_int_list(row0, "row0"), as_int_list(row1, "row1"))
    bt = BlockTables([4], 4, 16, 24, runtime.DEVICE)
    for state, ids in ((0, [3, 7, 10, 12]), (1, [5]), (2, [2, 9])):
        bt.append_block_ids(state, (ids,), overwrite=True)
    bt.apply_staged_writes()
    bt.gather_block_tables(_i32([0, 2, 1]))
    bt.append_block_ids(0, ([8],), overwrite=True)
    bt.append_block_ids(2, ([11],), overwrite=False)
    bt.apply_staged_writes()
    table = bt.gather_block_tables(_i32([2, 0]))[0].tolist()
    expected = (table[0], table[1])
    return report(
        answer == expected,
        f"row 0 is {expected[0]} and row 1 is {expected[1]}: the gather copies only a request's num_blocks "
        f"columns, so each row keeps what step 1 left after them (A's 12 in row 0, C's 9 in row 1)",
        "row b gets the first num_blocks columns of request state idx_mapping[b]; the columns after them are "
        "not cleared and still hold what step 1's gather wrote there",
    )


def block_counts(host: int, device: int) -> bool:
    """Exercise 3: request state 1 holds 3 blocks in the only group, applied
    (``apply_staged_writes``). This step it gets two more: ``append_block_ids(1, ([20, 21],),
    overwrite=False)``. Before the next ``apply_staged_writes()``, what count does the host see
    (``num_blocks.np[0, 1]``), and what count does a kernel launched now read
    (``num_blocks.gpu[0, 1]``)?"""
    answer = (as_int(host, "host"), as_int(device, "device"))
    bt = BlockTables([16], 4, 16, 128, runtime.DEVICE)
    bt.append_block_ids(1, ([4, 5, 6],), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([20, 21],), overwrite=False)
    expected = (int(bt.num_blocks.np[0, 1]), int(bt.num_blocks.gpu[0, 1]))
    return report(
        answer == expected,
        f"the host says {expected[0]} at once (append_block_ids updates num_blocks.np), the GPU still reads "
        f"{expected[1]}: num_blocks.gpu is the pinned buffer of the last copy_to_uva, which only "
        f"apply_staged_writes() refreshes",
        "append_block_ids changes the host array now; kernels read .gpu, a copy made by the last "
        "apply_staged_writes()",
    )


def slot_programs(vllm: int, ours: int, num_groups: int = 2, num_reqs: int = 1024, tokens_per_req: int = 1,
                  max_num_batched_tokens: int = 16384, block_tokens: int = 128) -> bool:
    """Exercise 4: two KV-cache groups, a decode batch of 1024 requests (one token each),
    ``max_num_batched_tokens = 16384``. How many programs does vLLM's slot-mapping kernel
    launch, and how many ours with tiles of 128 slots (its GPU setting)?"""
    qsl = [b * tokens_per_req for b in range(num_reqs + 1)]
    expected = (len(vllm_slot_programs(qsl, max_num_batched_tokens, num_groups)),
                len(fast_slot_programs(max_num_batched_tokens, block_tokens)))
    return report(
        (as_int(vllm, "vllm"), as_int(ours, "ours")) == expected,
        f"vLLM's: {num_groups} groups x ({num_reqs} requests + 1 padding program) = {expected[0]}; ours: "
        f"cdiv({max_num_batched_tokens}, {block_tokens}) = {expected[1]} tiles, each doing every group",
        "vLLM's grid is (num_groups, num_reqs + 1); ours has one program per tile of block_tokens slots "
        "of the whole buffer (max_num_batched_tokens), whatever the number of requests or groups",
    )
