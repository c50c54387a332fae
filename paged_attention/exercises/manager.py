"""Exercises of ``02_block_manager.ipynb``.

Each checker replays its scenario on the legacy block manager and compares the student's answer
with what the manager actually did.
"""
from __future__ import annotations

from typing import Sequence as SequenceT

from paged_attention.exercises import as_choice, as_int, report
from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.interfaces import AllocStatus
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus


def _status(answer: object, name: str) -> AllocStatus:
    """An ``AllocStatus``, or its name ("OK", "LATER", "NEVER", any case)."""
    if isinstance(answer, AllocStatus):
        return answer
    return AllocStatus[as_choice(answer, name, list(AllocStatus.__members__))]


def _group(request_id: str, prompt: SequenceT[int], n: int, block_size: int, first_id: int = 0) -> SequenceGroup:
    return SequenceGroup(request_id, [Sequence(first_id + i, list(prompt), block_size) for i in range(n)])


def admission(short_prompt: object, long_prompt: object, num_gpu_blocks: int = 64, num_used: int = 56,
              watermark: float = 0.05, block_size: int = 16, short_len: int = 100, long_len: int = 1000) -> bool:
    """Exercise 1: a manager of 64 GPU blocks of 16 tokens, watermark 0.05, with 56 blocks in
    use. What does ``can_allocate`` answer for a 100-token prompt, and for a 1000-token one?"""
    answers = (_status(short_prompt, "short_prompt"), _status(long_prompt, "long_prompt"))
    mgr = SelfAttnBlockSpaceManager(block_size, num_gpu_blocks, 0, watermark=watermark)
    mgr.allocate(_group("busy", [0] * (num_used * block_size), 1, block_size))
    expected = tuple(mgr.can_allocate(_group(rid, [1] * length, 1, block_size, first_id=1 + k))
                     for k, (rid, length) in enumerate((("short", short_len), ("long", long_len))))
    free, kept = mgr.get_num_free_gpu_blocks(), mgr.watermark_blocks

    def why(status: AllocStatus, need: int) -> str:
        if status == AllocStatus.NEVER:
            return (f"{need} blocks never fit: even an empty GPU would be left with {num_gpu_blocks} − {need} = "
                    f"{num_gpu_blocks - need}, fewer than {kept}")
        if status == AllocStatus.LATER:
            return f"{need} blocks would leave {free} − {need} = {free - need} free, fewer than {kept}"
        return f"{need} blocks leave {free} − {need} = {free - need} free, at least {kept}"

    need = [-(-length // block_size) for length in (short_len, long_len)]
    return report(
        answers == expected,
        f"{expected[0].name} and {expected[1].name}: the watermark keeps int({watermark} × {num_gpu_blocks}) = "
        f"{kept} blocks in reserve; {why(expected[0], need[0])}; {why(expected[1], need[1])}",
        "count the blocks each prompt needs (ceil(tokens / block_size)); OK needs free − needed ≥ "
        "watermark blocks; NEVER compares the *total* number of GPU blocks instead of the free ones",
    )


def _after_first_decode(prompt_len: int, n: int, block_size: int) -> tuple[SelfAttnBlockSpaceManager,
                                                                          SequenceGroup, int]:
    """A group of ``n`` samples of one prompt, allocated and decoded once (each sample appends
    its own token). Returns the manager, the group and the number of copy-on-write pairs."""
    mgr = SelfAttnBlockSpaceManager(block_size, 64, 64, watermark=0.0)
    group = _group("r", list(range(prompt_len)), n, block_size)
    mgr.allocate(group)
    num_copies = 0
    for i, seq in enumerate(group.get_seqs()):
        seq.status = SequenceStatus.RUNNING
        seq.append_token_id(1000 + i)                # every sample draws a different first token
        num_copies += len(mgr.append_slots(seq, num_lookahead_slots=0))
    return mgr, group, num_copies


def parallel_sampling(num_blocks: object, num_copies: object, prompt_len: int = 13, n: int = 4,
                      block_size: int = 4) -> bool:
    """Exercise 2: a 13-token prompt, blocks of 4, n = 4 samples. After the first decode step
    (each sample appends its own first token), how many GPU blocks does the group hold, and how
    many copy-on-write pairs did ``append_slots`` return in all?"""
    answer = (as_int(num_blocks, "num_blocks"), as_int(num_copies, "num_copies"))
    mgr, _, copies = _after_first_decode(prompt_len, n, block_size)
    held = mgr.num_total_gpu_blocks - mgr.get_num_free_gpu_blocks()
    full = prompt_len // block_size
    return report(
        answer == (held, copies),
        f"{held} blocks and {copies} copies: the {full} full prompt blocks stay shared; the partly filled "
        f"one is copied for each sample that writes into it while another still holds it, so the last "
        f"writer keeps it" if prompt_len % block_size else
        f"{held} blocks and {copies} copies: the prompt fills its blocks, so every first token goes into a "
        "fresh block of its own and nothing is copied",
        "full blocks are never written again, so they stay shared; a write into a block with more than one "
        "holder copies it first (and the original loses a holder)",
    )


def swap_footprint(cpu_blocks: object, gpu_blocks: object, prompt_len: int = 13, n: int = 4,
                   block_size: int = 4) -> bool:
    """Exercise 3: exercise 2's group is swapped out after its first decode step, then back in
    (naive allocator). How many CPU blocks does it take while it is out, and how many GPU blocks
    once it is back?"""
    answer = (as_int(cpu_blocks, "cpu_blocks"), as_int(gpu_blocks, "gpu_blocks"))
    mgr, group, _ = _after_first_decode(prompt_len, n, block_size)
    before = mgr.num_total_gpu_blocks - mgr.get_num_free_gpu_blocks()
    mgr.swap_out(group)
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    on_cpu = mgr.num_total_cpu_blocks - mgr.get_num_free_cpu_blocks()
    mgr.swap_in(group)
    back = mgr.num_total_gpu_blocks - mgr.get_num_free_gpu_blocks()
    return report(
        answer == (on_cpu, back),
        f"{on_cpu} on the CPU and {back} back on the GPU, against {before} before: each sample's blocks "
        "are swapped one sequence at a time, so blocks the samples shared are copied once per sample",
        "swap_out moves each sequence's table on its own: a block held by several samples gets a new "
        "id (and a copy) for each of them, on the way out and on the way back",
    )


def _swap_outs(watermark: float) -> int:
    """Section 3's workload and pools, run with ``watermark``: how many swap-outs happen."""
    from paged_attention.legacy.records import SWAPPED_OUT
    from paged_attention.legacy.workload import SimulatedEngine, synthetic_workload

    requests = synthetic_workload(10, seed=4, n=(1, 1, 2, 3), arrival_every=1.5, mean_prompt_len=16,
                                  mean_output_len=16, max_len=48)
    engine = SimulatedEngine(SelfAttnBlockSpaceManager(4, num_gpu_blocks=32, num_cpu_blocks=16, watermark=watermark),
                             requests)
    engine.run()
    return sum(1 for event in engine.events if event.kind == SWAPPED_OUT)


def watermark_swaps(swaps_without: object, swaps_with: object, watermark: float = 0.2) -> bool:
    """Exercise 4: section 3's workload with ``watermark=0.0`` and with ``watermark`` (0.2): how
    many times is a group swapped out in each run?"""
    answer = (as_int(swaps_without, "swaps_without"), as_int(swaps_with, "swaps_with"))
    expected = (_swap_outs(0.0), _swap_outs(watermark))
    return report(
        answer == expected,
        f"{expected[0]} swap-outs without a watermark, {expected[1]} with {watermark}: admitting less "
        "leaves the running requests room to grow",
        "run SimulatedEngine on section 3's requests with a new manager for each watermark, and count "
        "the events of kind SWAPPED_OUT",
    )
