"""Why paging: how much KV-cache memory holds useful token states under different allocators.

Before PagedAttention, serving systems gave every request one contiguous stretch of KV-cache
memory, sized up front because the output length is unknown when the request starts. The
PagedAttention paper (Kwon et al., SOSP 2023, Figure 2) measured what that costs: only 20.4% to
38.2% of the KV cache held token states under three reservation policies, against 96.3% with
paging. This module reproduces that picture as a small simulation:

- ``"max"``    reserve ``max_model_len`` slots for every request (Orca "Max");
- ``"pow2"``   reserve the next power of two >= prompt + output (Orca "Pow2");
- ``"oracle"`` reserve exactly prompt + output, as if the output length were known (Orca "Oracle");
- ``"paged"``  allocate fixed-size blocks on demand, one more whenever the last one fills (vLLM).

The numbers will not match the paper's (that was a real system on a real trace); the ordering
and the size of the gap are the point.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from paged_attention.utils import cdiv, check_int, next_power_of_2

SCHEMES: tuple[str, ...] = ("max", "pow2", "oracle", "paged")

LABELS: dict[str, str] = {
    "max": "Orca (Max)",
    "pow2": "Orca (Pow2)",
    "oracle": "Orca (Oracle)",
    "paged": "vLLM (paged, 16)",
}

# Share of KV-cache memory holding token states, in percent, as read off the paper's Figure 2.
PAPER_USEFUL: dict[str, float] = {"max": 20.4, "pow2": 26.8, "oracle": 38.2, "paged": 96.3}

# The paper's four kinds of memory, in the order they are stacked in the figure.
CATEGORIES: tuple[str, ...] = (
    "token_states", "reserved", "internal_fragmentation", "external_fragmentation",
)


# --------------------------------------------------------------------------------------------
# 1. Requests and a synthetic trace
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """One request of a trace: its prompt length and how many tokens it will generate."""

    prompt_len: int
    output_len: int

    def __post_init__(self) -> None:
        check_int("prompt_len", self.prompt_len, 1)
        check_int("output_len", self.output_len, 0)

    @property
    def total_len(self) -> int:
        """Tokens whose KV the request holds once it has finished: prompt plus output."""
        return self.prompt_len + self.output_len


def synthetic_trace(num_requests: int, mean_input: float = 161, mean_output: float = 338,
                    max_model_len: int = 2048, seed: int = 0) -> list[Request]:
    """A reproducible trace whose length statistics resemble ShareGPT's (the paper's defaults).

    Prompt and output lengths are drawn from log-normal distributions with the given means: a
    few long requests and many short ones, which is what makes reserving for the worst case so
    wasteful. Each length is at least 1 and prompt + output is clipped to ``max_model_len``.
    """
    check_int("num_requests", num_requests, 0)
    check_int("max_model_len", max_model_len, 2)
    for name, mean in (("mean_input", mean_input), ("mean_output", mean_output)):
        if not isinstance(mean, (int, float)) or not mean >= 1:
            raise ValueError(f"{name} must be a number >= 1, got {mean!r}")

    rng = np.random.default_rng(seed)
    sigma = 0.8  # spread of log(length); mu is chosen so that the mean comes out right
    prompts = rng.lognormal(math.log(mean_input) - sigma**2 / 2, sigma, num_requests)
    outputs = rng.lognormal(math.log(mean_output) - sigma**2 / 2, sigma, num_requests)

    # Leave room for at least one output token, then give the output what is left.
    prompts = np.clip(np.rint(prompts), 1, max_model_len - 1).astype(int)
    outputs = np.clip(np.rint(outputs), 1, max_model_len - prompts).astype(int)
    return [Request(int(p), int(o)) for p, o in zip(prompts, outputs)]


# --------------------------------------------------------------------------------------------
# 2. The result: where the memory went
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryBreakdown:
    """Average shares of KV-cache memory in use (allocated or stranded) over a simulation.

    The four shares sum to 1:
    - ``token_states``: slots holding the KV of tokens a request has already seen or generated;
    - ``reserved``: slots set aside for tokens the request will generate later;
    - ``internal_fragmentation``: slots allocated that the request will never fill;
    - ``external_fragmentation``: free slots stranded between allocations.
    ``steps`` is how many steps the trace took, ``mean_running`` the average batch size and
    ``mean_slots`` the average number of slots in use (allocated or stranded) per step: less
    waste means more requests share the cache at once, so the same trace finishes sooner.
    """

    scheme: str
    token_states: float
    reserved: float
    internal_fragmentation: float
    external_fragmentation: float
    steps: int = 0
    mean_running: float = 0.0
    mean_slots: float = 0.0

    @property
    def useful(self) -> float:
        """The share of memory that holds token states: what Figure 2 of the paper reports."""
        return self.token_states

    def fractions(self) -> dict[str, float]:
        """The four shares by category name, in the order of ``CATEGORIES``."""
        return {name: getattr(self, name) for name in CATEGORIES}


# --------------------------------------------------------------------------------------------
# 3. The serving loop
# --------------------------------------------------------------------------------------------

@dataclass
class _Running:
    """A request's state in the loop: tokens in the cache and slots allocated to it."""

    request: Request
    cur_len: int        # tokens whose KV is in the cache
    slots: int = 0      # slots allocated: the reservation, or num_blocks * block_size
    start: int = -1     # contiguous schemes: first address of the reservation


class _FirstFitSpace:
    """A contiguous address space of ``capacity`` token slots, handed out first-fit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.regions: list[tuple[int, int]] = []  # (start, size), sorted by start

    def allocate(self, size: int) -> int | None:
        """Place ``size`` slots in the lowest hole that fits; return the start, or None."""
        prev_end = 0
        for i, (start, length) in enumerate(self.regions):
            if start - prev_end >= size:
                self.regions.insert(i, (prev_end, size))
                return prev_end
            prev_end = start + length
        if self.capacity - prev_end >= size:
            self.regions.append((prev_end, size))
            return prev_end
        return None

    def free(self, start: int) -> None:
        self.regions = [r for r in self.regions if r[0] != start]

    def stranded(self) -> int:
        """Free slots below the end of the highest allocation: holes between neighbours."""
        if not self.regions:
            return 0
        last_start, last_size = self.regions[-1]
        return last_start + last_size - sum(size for _, size in self.regions)


def _reservation(scheme: str, request: Request, max_model_len: int) -> int:
    """How many contiguous slots a reservation scheme sets aside for ``request``."""
    if scheme == "max":
        return max_model_len
    if scheme == "pow2":
        return min(next_power_of_2(request.total_len), max_model_len)
    return request.total_len  # oracle


def simulate(trace: list[Request], scheme: str, *, capacity_tokens: int = 16384,
             max_model_len: int = 2048, block_size: int = 16) -> MemoryBreakdown:
    """Serve ``trace`` with one allocation scheme and report where the KV-cache memory went.

    A discrete-time loop. All requests wait in one FIFO queue at the start. Every step:
    1. each running request generates one token (its KV goes into the cache);
    2. waiting requests are admitted in order while memory allows; admission processes the
       whole prompt, and the queue stops at the first request that does not fit;
    3. the four categories are recorded;
    4. requests that have all their tokens finish and free their memory.
    The result is the average over steps (each category summed over steps, divided by the
    summed total), so a busy step weighs as much as any other.

    Contiguous schemes reserve their slots first-fit in an address space of ``capacity_tokens``
    slots. External fragmentation is the free space lying below the end of the highest
    allocation: holes left between allocations by requests that finished. The free tail above
    the last allocation is not counted: it is simply free memory, still usable by anyone.

    The paged scheme splits the same memory into ``capacity_tokens // block_size`` blocks. A
    request is admitted when its prompt's blocks are free and takes one more block whenever its
    last block is full. A request that finds no free block waits that step. If every running
    request is waiting, the newest one is preempted: its blocks are freed and it goes back to
    the front of the queue, to be recomputed when it fits again (as vLLM does); no request is
    admitted in that step. Any free block serves any request, so there is no external
    fragmentation; the unfilled tail of each last block is internal fragmentation.

    The loop has no randomness: the trace alone decides the result.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(map(repr, SCHEMES))}; got {scheme!r}")
    check_int("capacity_tokens", capacity_tokens, 1)
    check_int("max_model_len", max_model_len, 1)
    check_int("block_size", block_size, 1)
    if capacity_tokens < max_model_len or (capacity_tokens // block_size) * block_size < max_model_len:
        raise ValueError(
            f"capacity_tokens ({capacity_tokens}) must hold one request of max_model_len "
            f"({max_model_len}) tokens, in whole blocks of block_size ({block_size})")
    for i, request in enumerate(trace):
        if not isinstance(request, Request):
            raise TypeError(f"trace[{i}] must be a Request, got {type(request).__name__}")
        if request.total_len > max_model_len:
            raise ValueError(f"trace[{i}] has {request.total_len} tokens, more than "
                             f"max_model_len ({max_model_len})")

    if scheme == "paged":
        totals, steps, running_sum = _run_paged(trace, capacity_tokens // block_size, block_size)
    else:
        totals, steps, running_sum = _run_contiguous(trace, scheme, capacity_tokens, max_model_len)

    used = sum(totals)
    shares = [t / used if used else 0.0 for t in totals]
    return MemoryBreakdown(scheme, *shares, steps=steps,
                           mean_running=running_sum / steps if steps else 0.0,
                           mean_slots=used / steps if steps else 0.0)


def _run_contiguous(trace: list[Request], scheme: str, capacity: int,
                    max_model_len: int) -> tuple[list[int], int, int]:
    """The loop for the reservation schemes; returns per-category slot-steps, steps, batch sum."""
    waiting = deque(trace)
    space = _FirstFitSpace(capacity)
    running: list[_Running] = []
    totals = [0, 0, 0, 0]
    steps = running_sum = 0
    # What the running requests hold, kept up to date instead of re-summed every step.
    cur_sum = total_sum = slot_sum = 0
    something_freed = True  # admission can only succeed after memory was freed

    while waiting or running:
        # 1. Decode: one new token per running request, into slots it already reserved.
        for r in running:
            r.cur_len += 1
        cur_sum += len(running)

        # 2. Admit in FIFO order while the head of the queue fits somewhere.
        while waiting and something_freed:
            request = waiting[0]
            size = _reservation(scheme, request, max_model_len)
            start = space.allocate(size)
            if start is None:
                something_freed = False
                break
            waiting.popleft()
            running.append(_Running(request, request.prompt_len, size, start))
            cur_sum += request.prompt_len
            total_sum += request.total_len
            slot_sum += size

        # 3. Record: tokens so far / tokens still to come / never used / stranded holes.
        totals[0] += cur_sum
        totals[1] += total_sum - cur_sum
        totals[2] += slot_sum - total_sum
        totals[3] += space.stranded()
        steps += 1
        running_sum += len(running)

        # 4. Finish: requests holding all their tokens give their reservation back.
        still_running = []
        for r in running:
            if r.cur_len == r.request.total_len:
                space.free(r.start)
                cur_sum -= r.cur_len
                total_sum -= r.request.total_len
                slot_sum -= r.slots
                something_freed = True
            else:
                still_running.append(r)
        running = still_running
    return totals, steps, running_sum


def _run_paged(trace: list[Request], num_blocks: int,
               block_size: int) -> tuple[list[int], int, int]:
    """The loop for paging; returns per-category slot-steps, steps, batch sum."""
    waiting = deque(_Running(request, request.prompt_len) for request in trace)
    running: list[_Running] = []
    free_blocks = num_blocks
    totals = [0, 0, 0, 0]  # reserved and external fragmentation stay 0 for paging
    steps = running_sum = 0

    while waiting or running:
        # 1. Decode: a request whose last block is full needs a new block first.
        num_stalled = 0
        for r in running:
            if r.cur_len == r.slots:
                if free_blocks == 0:
                    num_stalled += 1
                    continue
                free_blocks -= 1
                r.slots += block_size
            r.cur_len += 1

        # Nobody could move: preempt the newest request, or the loop would never end.
        preempted = bool(running) and num_stalled == len(running)
        if preempted:
            victim = running.pop()
            free_blocks += victim.slots // block_size
            victim.slots = 0
            waiting.appendleft(victim)

        # 2. Admit in FIFO order while the head's tokens fit in free blocks.
        while waiting and not preempted:
            needed = cdiv(waiting[0].cur_len, block_size)
            if needed > free_blocks:
                break
            r = waiting.popleft()
            free_blocks -= needed
            r.slots = needed * block_size
            running.append(r)

        # 3. Record: tokens so far, and the unfilled tail of each request's last block.
        in_cache = sum(r.cur_len for r in running)
        totals[0] += in_cache
        totals[2] += sum(r.slots for r in running) - in_cache
        steps += 1
        running_sum += len(running)

        # 4. Finish: give every block back.
        still_running = []
        for r in running:
            if r.cur_len == r.request.total_len:
                free_blocks += r.slots // block_size
            else:
                still_running.append(r)
        running = still_running
    return totals, steps, running_sum


def compare_schemes(trace: list[Request], **kw) -> dict[str, MemoryBreakdown]:
    """Run :func:`simulate` for every scheme in ``SCHEMES`` on the same trace and settings."""
    return {scheme: simulate(trace, scheme, **kw) for scheme in SCHEMES}
