"""The implement-it labs: one function a student writes per lab, and the checks that grade it.

Each ``Lab`` names the function, shows its signature and a stub, and carries checks built on the
library's own implementation of the same thing (the reference the notebooks already verify). A
check runs the student's function on one case and, when the answer is wrong, fails with a message
that names the likely misconception. Public checks are the ones a student runs in the notebook;
the hidden ones (random and edge cases) are run by the teacher's ``lab grade``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


class LabCheckFailed(AssertionError):
    """A check's verdict: the answer was wrong; the message says what and which idea is missing."""


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Callable[..., Any]], None]     # raises LabCheckFailed (or anything) on a wrong answer
    public: bool = True

    def failure(self, e: BaseException) -> str:
        """What a student reads when this check fails with ``e``: a verdict's own message, or the
        exception the function raised."""
        return f"{self.name}: {e}" if isinstance(e, AssertionError) else f"{self.name}: {type(e).__name__}: {e}"


@dataclass(frozen=True)
class Lab:
    lab_id: str
    notebook: str        # the notebook the lab belongs to (file name without .ipynb)
    function: str        # the name the student's code must define
    signature: str       # the stub's first line
    task: str            # what to implement, in a few lines of markdown
    checks: tuple[Check, ...]

    @property
    def stub(self) -> str:
        return f"{self.signature}\n    # Your code here.\n    raise NotImplementedError\n"


def _call(fn: Callable[..., Any], args: tuple, what: str, hint: str) -> Any:
    """``fn(*args)``; an exception (other than the stub's NotImplementedError) becomes a verdict
    with the case and the hint, as a wrong answer does."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:
        raise LabCheckFailed(f"{what}: raised {type(e).__name__}: {e}. {hint}") from e


def _expect(got: Any, want: Any, what: str, hint: str) -> None:
    if got != want:
        raise LabCheckFailed(f"{what}: expected {want!r}, got {got!r}. {hint}")


# ---- 00: the slot mapping from a block table ---------------------------------------------------

def _ref_slot_mapping(block_table, seq_lens, block_size):
    from paged_attention.utils import slot_mapping
    return slot_mapping(block_table, seq_lens, block_size)


def _slot_case(table, lens, block_size, hint):
    def run(fn):
        what = f"block_table={table}, seq_lens={lens}, block_size={block_size}"
        got = _call(fn, ([list(r) for r in table], list(lens), block_size), what, hint)
        _expect(list(got) if got is not None else None, _ref_slot_mapping(table, lens, block_size), what, hint)
    return run


def _random_tables(seed, n=20):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        block_size = rng.choice([1, 2, 4, 8, 16])
        lens = [rng.randint(0, 40) for _ in range(rng.randint(1, 4))]
        ids = rng.sample(range(200), sum(math.ceil(n / block_size) for n in lens))
        table, k = [], 0
        for n in lens:
            m = math.ceil(n / block_size)
            table.append(ids[k:k + m])
            k += m
        cases.append((table, lens, block_size))
    return cases


def _slot_random(fn):
    for table, lens, bs in _random_tables(0):
        _slot_case(table, lens, bs, "slot = block_table[s][t // block_size] * block_size + t % block_size, "
                                    "for every token t of every sequence s, in order")(fn)


SLOT_MAPPING = Lab(
    "00-slot-mapping", "00_overview", "slot_mapping",
    "def slot_mapping(block_table, seq_lens, block_size):",
    "Return the slot of every token of every sequence, sequence by sequence (a flat list of ints): "
    "token `t` of sequence `s` goes to `block_table[s][t // block_size] * block_size + t % block_size`.",
    (Check("the example of section 3", _slot_case([[7, 2, 9], [4, 0], [5, 11, 3, 8]], [10, 6, 13], 4,
                                                  "check the formula of section 3 token by token")),
     Check("a token at the start of a later block", _slot_case([[3, 1]], [5], 4,
                                                             "the offset inside a block is t % block_size: "
                                                             "token 4 is the first of the second block")),
     Check("tables of random physical ids", _slot_random, public=False),
     Check("a sequence with no tokens yet", _slot_case([[], [6]], [0, 2], 4,
                                                     "a sequence of length 0 has no slots"), public=False)),
)


# ---- 01: copy on write and freeing in the naive allocator ---------------------------------------
# A scenario is built with the library (tables, forks); the student's function gets its state as
# plain lists and must leave them as the library's allocator does after the same operation.

def _naive_scenario(prompt_lens, forks, block_size=4, num_blocks=12):
    """Tables allocated with the library's naive allocator: one per prompt, then ``forks`` (child
    of table i) forked. Returns (allocator, tables)."""
    from paged_attention.legacy.block_table import BlockTable
    from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator

    allocator = CpuGpuBlockAllocator.create("naive", num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                                            block_size=block_size)
    tables = []
    for n in prompt_lens:
        t = BlockTable(block_size, allocator)
        t.allocate(list(range(1, n + 1)))
        tables.append(t)
    for parent in forks:
        tables.append(tables[parent].fork())
    return allocator, tables


def _pool_state(allocator):
    from paged_attention.legacy.cpu_gpu_block_allocator import allocation_order, refcounts
    return list(refcounts(allocator)), list(allocation_order(allocator))


def _append_case(prompt_lens, forks, which, hint):
    def run(fn):
        allocator, tables = _naive_scenario(prompt_lens, forks)
        table = tables[which]
        ref_counts, free_ids = _pool_state(allocator)
        args = (list(table.physical_block_ids), table.num_full_slots, table._block_size, ref_counts, free_ids)
        what = f"table {args[0]} holding {args[1]} tokens, reference counts {args[3]}, free list {args[4]}"
        got = _call(fn, args, what, hint)
        table.append_token_ids([99])
        cows = allocator.clear_copy_on_writes()
        want_counts, want_free = _pool_state(allocator)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise LabCheckFailed(f"{what}: return (new_table, cow), got {got!r}")
        new_table, cow = got
        _expect((list(new_table), tuple(cow) if cow is not None else None),
                (table.physical_block_ids, tuple(cows[0]) if cows else None),
                what + ": (new table, copy-on-write pair)", hint)
        _expect((ref_counts, free_ids), (want_counts, want_free), what + ": (reference counts, free list) after",
                hint)
    return run


def _append_random(fn):
    rng = random.Random(1)
    for _ in range(15):
        lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 2))]
        forks = [rng.randrange(len(lens)) for _ in range(rng.randint(0, 2))]
        _append_case(lens, forks, rng.randrange(len(lens) + len(forks)),
                     "a full last block (or none): take the free list's first id; a partly filled "
                     "shared block: copy it first; a partly filled block of one's own: write in place")(fn)


COPY_ON_WRITE = Lab(
    "01-copy-on-write", "01_legacy_block_table", "append_token",
    "def append_token(table, num_tokens, block_size, refcounts, free_ids):",
    "A sequence's `table` (physical ids) holds `num_tokens` tokens; it appends one more, as the naive "
    "allocator does. `refcounts[b]` is block `b`'s reference count, `free_ids` the free list (the next "
    "id handed out first). Return `(new_table, cow)`, `cow` the `(src, dst)` pair of a copy on write or "
    "`None`, and update `refcounts` and `free_ids` in place.",
    (Check("a shared, partly filled last block", _append_case([10], [0], 1,
                                                               "the last block is shared (count > 1) and not full: "
                                                               "copy it to a new block, one reference moves there")),
     Check("a last block of one's own", _append_case([10], [], 0, "a block held once is written in place: "
                                                                 "nothing to copy, nothing allocated")),
     Check("a full last block", _append_case([8], [0], 0, "the token starts a new block: take the first free "
                                                          "id, even if the full block is shared")),
     Check("random forks", _append_random, public=False)),
)


def _free_case(prompt_lens, forks, which, hint):
    def run(fn):
        allocator, tables = _naive_scenario(prompt_lens, forks)
        table = tables[which]
        ref_counts, free_ids = _pool_state(allocator)
        what = f"table {table.physical_block_ids}, reference counts {ref_counts}, free list {free_ids}"
        _call(fn, (list(table.physical_block_ids), ref_counts, free_ids), what, hint)
        table.free()
        _expect((ref_counts, free_ids), _pool_state(allocator), what + ": (reference counts, free list) after",
                hint)
    return run


FREE = Lab(
    "01-free", "01_legacy_block_table", "free_table",
    "def free_table(table, refcounts, free_ids):",
    "Free a sequence's `table`, as the naive allocator does: every block loses one reference, and a "
    "block left with none goes back to the **front** of the free list `free_ids`. Update `refcounts` "
    "and `free_ids` in place.",
    (Check("a table nobody shares", _free_case([10], [], 0, "each block of the table, in order, goes to the "
                                                             "front of the free list: the last one freed is "
                                                             "handed out first")),
     Check("a table shared with a fork", _free_case([10], [0], 0, "a block another table still holds keeps "
                                                                  "count 1 and stays out of the free list")),
     Check("random forks", lambda fn: [_free_case(lens, forks, w, "drop one reference per block; free the "
                                                  "blocks that reach 0, to the front of the list")(fn)
                                       for lens, forks, w in (([5, 9], [1], 2), ([12], [0, 0], 1),
                                                              ([3, 4, 7], [2], 0))], public=False)),
)


# ---- 02: can_allocate with the watermark ------------------------------------------------------

def _ref_can_allocate(num_required_blocks, num_free_blocks, num_total_blocks, watermark_blocks):
    """The answer of the library's block manager for a prompt of that many blocks, in that pool."""
    from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
    from paged_attention.legacy.sequence import Sequence, SequenceGroup

    block_size = 1
    # A watermark fraction whose int(fraction * total) is exactly watermark_blocks.
    mgr = SelfAttnBlockSpaceManager(block_size, num_total_blocks, 0,
                                    watermark=(watermark_blocks + 0.5) / num_total_blocks)
    used = num_total_blocks - num_free_blocks
    if used:
        mgr.allocate(SequenceGroup("used", [Sequence(0, list(range(1, used + 1)), block_size)]))
    group = SequenceGroup("new", [Sequence(1, list(range(1, num_required_blocks + 1)), block_size)])
    return mgr.can_allocate(group).name


def _admission_case(need, free, total, wm, hint):
    def run(fn):
        what = f"need {need} blocks, {free} of {total} free, watermark {wm}"
        got = _call(fn, (need, free, total, wm), what, hint)
        _expect(getattr(got, "name", got), _ref_can_allocate(need, free, total, wm), what, hint)
    return run


def _admission_random(fn):
    rng = random.Random(2)
    for _ in range(60):
        total = rng.randint(4, 64)
        wm = rng.randint(0, total // 4)
        free = rng.randint(0, total)
        need = rng.randint(1, total + 4)
        _admission_case(need, free, total, wm, "OK if free - need >= watermark; NEVER if even an empty "
                                               "pool could not (total - need < watermark); LATER otherwise")(fn)


CAN_ALLOCATE = Lab(
    "02-can-allocate", "02_block_manager", "can_allocate",
    "def can_allocate(num_required_blocks, num_free_blocks, num_total_blocks, watermark_blocks):",
    "Return `\"OK\"`, `\"LATER\"` or `\"NEVER\"`, as the block manager's `can_allocate` does for a prompt "
    "that needs `num_required_blocks` blocks (section 1's rule, watermark included).",
    (Check("it fits, with room above the watermark", _admission_case(4, 10, 20, 2, "10 - 4 >= 2: admit now")),
     Check("only the watermark holds it back", _admission_case(9, 10, 20, 2,
                                                             "10 - 9 = 1 < 2 blocks of watermark: LATER, not OK "
                                                             "(the watermark keeps room for running requests)")),
     Check("too large for an empty pool", _admission_case(20, 20, 20, 2,
                                                        "20 - 20 < 2 even with every block free: NEVER, "
                                                        "compare against the total, not the free blocks")),
     Check("random pools", _admission_random, public=False),
     Check("exactly on the watermark", _admission_case(8, 10, 20, 2, "10 - 8 = 2 >= 2: OK (the bound is "
                                                                      "inclusive)"), public=False)),
)


# ---- 03: the numpy slot mapping --------------------------------------------------------------

def _ref_compute_slot_mapping(block_table, req_indices, positions, block_size):
    from paged_attention.v1 import BlockTable

    rows, cols = block_table.shape
    bt = BlockTable(block_size, rows, cols, max(len(positions), 1), False, "cpu", block_size)
    for row in range(rows):
        bt.add_row(list(block_table[row]), row)
    bt.compute_slot_mapping(np.asarray(req_indices), np.asarray(positions))
    return bt.slot_mapping.np[:len(positions)].tolist()


def _numpy_case(table, req_indices, positions, block_size, hint):
    def run(fn):
        t, r, p = np.array(table, dtype=np.int32), np.array(req_indices), np.array(positions)
        what = f"rows {table}, req_indices {req_indices}, positions {positions}, block_size {block_size}"
        got = _call(fn, (t, r, p, block_size), what, hint)
        got = np.asarray(got).tolist() if got is not None else None
        _expect(got, _ref_compute_slot_mapping(t, r, p, block_size), what, hint)
    return run


def _numpy_random(fn):
    rng = np.random.default_rng(3)
    for _ in range(20):
        rows, cols, bs = int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.choice([2, 4, 16]))
        table = rng.permutation(100)[:rows * cols].reshape(rows, cols).tolist()
        n = int(rng.integers(1, 12))
        req = rng.integers(0, rows, n).tolist()
        pos = rng.integers(0, cols * bs, n).tolist()
        _numpy_case(table, req, pos, bs, "row req_indices[t], column positions[t] // block_size, then "
                                         "* block_size + positions[t] % block_size")(fn)


COMPUTE_SLOT_MAPPING = Lab(
    "03-compute-slot-mapping", "03_v1_block_table", "compute_slot_mapping",
    "def compute_slot_mapping(block_table, req_indices, positions, block_size):",
    "With numpy and no Python loop over tokens: token `t` belongs to row `req_indices[t]` of the 2-D "
    "array `block_table` and sits at `positions[t]`. Return the array of its slots.",
    (Check("a mixed batch", _numpy_case([[12, 3, 40], [7, 8, 9]], [0, 0, 1], [37, 38, 5], 16,
                                        "the column is positions // block_size, the row is req_indices")),
     Check("requests out of row order", _numpy_case([[1, 2], [3, 4]], [1, 0, 1], [0, 3, 5], 4,
                                                   "index the rows with req_indices, not with the token's "
                                                   "place in the batch")),
     Check("random tables", _numpy_random, public=False)),
)


# ---- 04: a Triton slot-mapping kernel --------------------------------------------------------

def _triton_case(table, req_indices, positions, block_size, hint):
    def run(fn):
        import torch

        from paged_attention import runtime
        t = torch.tensor(table, dtype=torch.int32, device=runtime.DEVICE)
        r = torch.tensor(req_indices, dtype=torch.int64, device=runtime.DEVICE)
        p = torch.tensor(positions, dtype=torch.int64, device=runtime.DEVICE)
        what = f"{len(positions)} tokens, block_size {block_size}"
        got = _call(fn, (t, r, p, block_size), what, hint)
        got = got.cpu().tolist() if hasattr(got, "cpu") else got
        want = _ref_compute_slot_mapping(np.array(table, dtype=np.int32), np.array(req_indices),
                                         np.array(positions), block_size)
        if got != want:
            bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None) if isinstance(got, list) \
                else None
            where = f" (first difference at token {bad}: {got[bad]} instead of {want[bad]})" if bad is not None else ""
            raise LabCheckFailed(f"{what}: wrong slots{where}. {hint}")
    return run


def _long_batch(seed, n):
    rng = np.random.default_rng(seed)
    rows, cols, bs = 3, 40, 8
    table = rng.permutation(1000)[:rows * cols].reshape(rows, cols).tolist()
    req = rng.integers(0, rows, n).tolist()
    pos = rng.integers(0, cols * bs, n).tolist()
    return table, req, pos, bs


TRITON_SLOT_MAPPING = Lab(
    "04-triton-slot-mapping", "04_v2_triton_block_tables", "triton_slot_mapping",
    "def triton_slot_mapping(block_table, req_indices, positions, block_size):",
    "Lab 03's slot mapping as a Triton kernel: write a `@triton.jit` kernel that handles a tile of tokens per "
    "program, and this function, which launches it and returns an int64 tensor of slots. `block_table` "
    "is an int32 tensor `[rows, cols]`, `req_indices` and `positions` are int64 tensors of one entry per "
    "token. On a CPU the kernel runs in Triton's interpreter, which has no bounds checks: mask every load "
    "and store.",
    (Check("a mixed batch", _triton_case([[12, 3, 40], [7, 8, 9]], [0, 0, 1], [37, 38, 5], 16,
                                         "slot = table[req, pos // block_size] * block_size + pos % block_size; "
                                         "the row stride of the table is its number of columns")),
     Check("more tokens than one tile", _triton_case(*_long_batch(4, 300),
                                                     "use enough programs for every token (a grid of "
                                                     "cdiv(num_tokens, TILE)) and mask the last tile")),
     Check("a long random batch", _triton_case(*_long_batch(7, 1000), "mask the tail and compute in int64"),
           public=False)),
)


# ---- 05: a backend's KV-cache strides ---------------------------------------------------------

def _ref_strides(layout, num_blocks, block_size, num_kv_heads, head_size):
    """Element strides of FlashAttention's logical KV-cache shape when memory follows ``layout``."""
    import torch

    from paged_attention.kv_cache.backends import FlashAttentionBackend
    shape = FlashAttentionBackend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    order = FlashAttentionBackend.get_kv_cache_stride_order(layout)
    memory = torch.empty([shape[i] for i in order], device="meta")      # dimensions in memory order
    inverse = [order.index(i) for i in range(len(order))]
    return tuple(memory.permute(*inverse).stride())


def _strides_case(layout, nb, bs, h, d, hint):
    def run(fn):
        what = f"layout {layout}, {nb} blocks of {bs} tokens, {h} KV heads of {d}"
        got = _call(fn, (layout, nb, bs, h, d), what, hint)
        _expect(tuple(got) if got is not None else None, _ref_strides(layout, nb, bs, h, d), what, hint)
    return run


def _strides_random(fn):
    rng = random.Random(5)
    for _ in range(20):
        layout = rng.choice(["NHD", "HND"])
        _strides_case(layout, rng.randint(1, 9), rng.choice([16, 32]), rng.randint(1, 8), rng.choice([64, 128]),
                      "the K/V dimension is outermost: K of every block, then V of every block")(fn)


KV_CACHE_STRIDES = Lab(
    "05-kv-cache-strides", "05_kv_cache_allocation", "kv_cache_strides",
    "def kv_cache_strides(layout, num_blocks, block_size, num_kv_heads, head_size):",
    "FlashAttention's KV cache has the logical shape `(2, num_blocks, block_size, num_kv_heads, "
    "head_size)`. Its memory order is that shape in NHD, and `(2, num_blocks, num_kv_heads, block_size, "
    "head_size)` in HND. Return the strides, in elements, of the logical view (a tuple of 5 ints).",
    (Check("NHD", _strides_case("NHD", 4, 16, 2, 64, "in NHD memory follows the logical shape: each stride "
                                                      "is the product of the sizes to its right (the K/V "
                                                      "dimension is outermost: K of every block, then V)")),
     Check("HND", _strides_case("HND", 4, 16, 2, 64, "in HND a block stores head by head: the token stride is "
                                                      "head_size and the head stride block_size * head_size")),
     Check("random shapes", _strides_random, public=False)),
)


# ---- 06: merging partitions (the online softmax) -------------------------------------------------

def _ref_merge(max_logits, exp_sums, outputs):
    from paged_attention.kernels.layout import v2_merge_weights
    w = v2_merge_weights(max_logits, exp_sums)
    total = sum(w)
    return [sum(wi * o[d] for wi, o in zip(w, outputs)) / total for d in range(len(outputs[0]))]


def _merge_case(m, s, o, hint):
    def run(fn):
        got = _call(fn, (list(m), list(s), [list(x) for x in o]), f"max_logits {m}, exp_sums {s}", hint)
        want = _ref_merge(m, s, o)
        ok = got is not None and len(list(got)) == len(want) and all(
            math.isclose(float(a), b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(got, want))
        if not ok:
            raise LabCheckFailed(f"max_logits {m}, exp_sums {s}: expected {[round(x, 6) for x in want]}, "
                                 f"got {got!r}. {hint}")
    return run


def _merge_random(fn):
    rng = random.Random(6)
    for _ in range(30):
        p = rng.randint(1, 5)
        m = [rng.uniform(-20, 20) for _ in range(p)]
        s = [rng.uniform(0.5, 50) for _ in range(p)]
        o = [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(p)]
        _merge_case(m, s, o, "w_p = s_p * exp(m_p - M) with M = max m_p; out = sum w_p o_p / sum w_p")(fn)


MERGE_PARTITIONS = Lab(
    "06-merge-partitions", "06_paged_attention_kernels", "merge_partitions",
    "def merge_partitions(max_logits, exp_sums, outputs):",
    "Partition `p` reports its maximum score `max_logits[p]`, its sum `exp_sums[p]` of "
    "`exp(score - max_logits[p])` and its locally normalised output `outputs[p]` (a list). Return the "
    "attention output over all partitions, as v2's reduction kernel computes it (without the 1e-6).",
    (Check("partitions with different maxima", _merge_case([3.0, 5.0, 4.0], [20.0, 8.0, 12.0],
                                                          [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]],
                                                          "rescale each exp-sum to the largest maximum before "
                                                          "weighting: s_p * exp(m_p - M)")),
     Check("one partition", _merge_case([1.5], [7.0], [[0.25, -2.0]], "a single partition's output is final")),
     Check("random partitions", _merge_random, public=False),
     Check("large scores", _merge_case([800.0, 790.0], [3.0, 4.0], [[1.0], [2.0]],
                                       "exp(800) overflows: subtract the maximum first"), public=False)),
)

# ---- 08: one decode step's bookkeeping -------------------------------------------------------

def _ref_decode_step(num_tokens, block_size, num_free_blocks):
    """The library's FCFS scheduler over the legacy block manager: running requests of these lengths
    (the newest token not yet in a slot), ``num_free_blocks`` free, preemption by recomputation.
    Returns (the requests that decode, the requests preempted, in order)."""
    from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
    from paged_attention.legacy.records import RECOMPUTED
    from paged_attention.legacy.scheduler import FcfsScheduler
    from paged_attention.legacy.sequence import Sequence, SequenceGroup

    held = [math.ceil((n - 1) / block_size) for n in num_tokens]
    mgr = SelfAttnBlockSpaceManager(block_size, sum(held) + num_free_blocks, 0, watermark=0.0)
    sched = FcfsScheduler(mgr, preemption_mode="recompute", max_num_seqs=len(num_tokens),
                          max_num_batched_tokens=sum(num_tokens), record_block_owners=False)
    for i, n in enumerate(num_tokens):      # a prompt of n - 1 tokens; the prefill samples token n
        sched.add_seq_group(SequenceGroup(f"r{i}", [Sequence(i, list(range(1, n)), block_size)],
                                          arrival_time=float(i)))
    record = sched.schedule()
    sched.update(record, {i: 7 for i in range(len(num_tokens))})
    record = sched.schedule()                # the decode step
    return ([int(g.request_id[1:]) for g in record.decodes],
            [int(e.request_id[1:]) for e in record.events if e.kind == RECOMPUTED])


def _step_case(num_tokens, block_size, free, hint):
    def run(fn):
        what = f"lengths {num_tokens}, block_size {block_size}, {free} free blocks"
        got = _call(fn, (list(num_tokens), block_size, free), what, hint)
        got = (list(got[0]), list(got[1])) if isinstance(got, tuple) and len(got) == 2 else got
        _expect(got, _ref_decode_step(num_tokens, block_size, free), what + ": (decoded, preempted)", hint)
    return run


def _step_random(fn):
    rng = random.Random(7)
    for _ in range(20):
        bs = rng.choice([2, 4])
        lens = [rng.randint(2, 13) for _ in range(rng.randint(1, 6))]
        _step_case(lens, bs, rng.randint(0, 3), "oldest first; each needs one free block as an upper bound, "
                                                "takes one only if its new token starts a block; when short, "
                                                "preempt the newest and get its blocks back")(fn)


DECODE_STEP = Lab(
    "08-decode-step", "08_end_to_end", "decode_step",
    "def decode_step(num_tokens, block_size, num_free_blocks):",
    "The running requests `0, 1, ...` (oldest first) have `num_tokens[i]` tokens each, the newest "
    "not yet in a slot; the others fill `ceil((num_tokens[i] - 1) / block_size)` blocks. As the "
    "engine's scheduler does at a decode step, return `(decoded, preempted)`: the requests that run, "
    "and those preempted by recomputation, each in order.",
    (Check("room for everyone", _step_case([5, 9, 6], 4, 3, "each request's new token needs the block it is "
                                                           "written into")),
     Check("short by one block", _step_case([5, 9, 13, 6], 4, 1, "when a request does not fit, preempt the "
                                                                 "newest running request (the last one) and "
                                                                 "give its blocks back to the pool")),
     Check("a partly filled block still counts", _step_case([5, 9, 13, 6], 4, 3,
                                                             "can_append_slots is an upper bound: a token written "
                                                             "into a partly filled block still needs one free "
                                                             "block to pass the check")),
     Check("random steps", _step_random, public=False)),
)


LABS: dict[str, Lab] = {lab.lab_id: lab for lab in (SLOT_MAPPING, COPY_ON_WRITE, FREE, CAN_ALLOCATE,
                                                     COMPUTE_SLOT_MAPPING, TRITON_SLOT_MAPPING, KV_CACHE_STRIDES,
                                                     MERGE_PARTITIONS, DECODE_STEP)}
