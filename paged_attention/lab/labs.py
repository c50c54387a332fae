"""The implement-it labs: one function a student writes per lab, and the checks that grade it.

A ``Lab`` names the function, shows its signature and a stub, and says in its task every rule its
checks test. A ``Check`` is a few cases: inputs as plain data (ints, strings, lists) and the answer
the library's own implementation gives (the reference the notebooks already verify). The grader's
child process only calls the student's function on the inputs and sends back what it returned; the
comparison, with exact types, happens here, in the grader's process. A wrong answer gets a message
that names the likely misconception (the check's hint). Public checks are the ones a student runs
in the notebook; the hidden ones (random and edge cases) only the teacher's ``lab grade`` runs.
"""
from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

Case = tuple[list, Any]          # (the function's arguments, the expected answer), plain data


@dataclass(frozen=True)
class Check:
    name: str
    cases: Callable[[], list[Case]]     # built on first use, in the grader's process
    hint: str                            # the idea a wrong answer most likely misses
    public: bool = True


def exact_equal(got: Any, want: Any) -> bool:
    """Equality of plain data with exact types: 1 is not 1.0 nor True, a list is compared item by
    item. ``got`` comes from JSON, so it holds only builtins; no ``__eq__`` of the student's runs."""
    if type(got) is not type(want):
        return False
    if type(want) is list:
        return len(got) == len(want) and all(exact_equal(a, b) for a, b in zip(got, want))
    return got == want


def _exact(got: list, want: Any, args: list) -> str | None:
    """The default comparison: the returned value against the expected one."""
    if exact_equal(got[0], want):
        return None
    return f"expected {want!r}, got {got[0]!r}"


@dataclass(frozen=True)
class Lab:
    lab_id: str
    notebook: str        # the notebook the lab belongs to (file name without .ipynb)
    function: str        # the name the student's code must define
    signature: str       # the stub's first line
    task: str            # what to implement, in a few lines of markdown: every rule the checks test
    checks: tuple[Check, ...]
    describe: Callable[[list], str] = repr              # one case's inputs, for a message
    compare: Callable[[list, Any, list], str | None] = _exact   # (answers, expected, args) -> what differs
    arg_types: tuple = ()                # per argument: None (plain), "np.<dtype>" or "torch.<dtype>"
    returns_args: tuple[int, ...] = ()   # arguments changed in place, sent back after the call
    imports: tuple[str, ...] = ()        # import lines of the stub (what the function needs)
    needs: tuple[str, ...] = ()          # libraries the child imports before the memory limit
    on_device: bool = False              # tensors on the lab machine's device (a GPU if there is one)

    @property
    def stub(self) -> str:
        head = "".join(line + "\n" for line in self.imports) + ("\n\n" if self.imports else "")
        return f"{head}{self.signature}\n    # Your code here.\n    raise NotImplementedError\n"


@functools.lru_cache(maxsize=None)
def lab_cases(lab_id: str) -> tuple[tuple[Case, ...], ...]:
    """Every check's cases of a lab, computed once per process, as JSON would give them back."""
    return tuple(tuple(json.loads(json.dumps(c)) for c in check.cases()) for check in LABS[lab_id].checks)


def _plain_args(args) -> list:
    return json.loads(json.dumps(list(args)))


# ---- 00: the slot mapping from a block table ---------------------------------------------------

def _slot_cases(*cases):
    def build():
        from paged_attention.utils import slot_mapping
        return [([[list(r) for r in t], list(n), bs], slot_mapping(t, n, bs)) for t, n, bs in cases]
    return build


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


SLOT_MAPPING = Lab(
    "00-slot-mapping", "00_overview", "slot_mapping",
    "def slot_mapping(block_table, seq_lens, block_size):",
    "Return the slot of every token of every sequence, sequence by sequence (a flat list of ints): "
    "token `t` of sequence `s` goes to `block_table[s][t // block_size] * block_size + t % block_size`. "
    "A sequence of length 0 has no slots (its row of the table may be empty).",
    (Check("the example of section 3", _slot_cases(([[7, 2, 9], [4, 0], [5, 11, 3, 8]], [10, 6, 13], 4)),
           "check the formula of section 3 token by token"),
     Check("a token at the start of a later block", _slot_cases(([[3, 1]], [5], 4)),
           "the offset inside a block is t % block_size: token 4 is the first of the second block"),
     Check("tables of random physical ids", lambda: _slot_cases(*_random_tables(0))(),
           "slot = block_table[s][t // block_size] * block_size + t % block_size, for every token t of "
           "every sequence s, in order", public=False),
     Check("a sequence with no tokens yet", _slot_cases(([[], [6]], [0, 2], 4)),
           "a sequence of length 0 has no slots", public=False)),
    describe=lambda a: f"block_table={a[0]}, seq_lens={a[1]}, block_size={a[2]}",
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


def _scenario_cases(act, scenarios):
    """Cases built from naive-allocator scenarios ``(prompt_lens, forks, which)``: ``act(table,
    allocator)`` reads the pool, applies the lab's operation to table ``which`` and returns
    ``(args, expected)``."""
    def build():
        out = []
        for prompt_lens, forks, which in scenarios:
            allocator, tables = _naive_scenario(prompt_lens, forks)
            out.append(act(tables[which], allocator))
        return out
    return build


def _append_one(table, allocator):
    counts, free = _pool_state(allocator)
    args = [list(table.physical_block_ids), table.num_full_slots, table._block_size, counts, free]
    table.append_token_ids([99])
    cows = allocator.clear_copy_on_writes()
    return args, [[table.physical_block_ids, list(cows[0]) if cows else None], *_pool_state(allocator)]


def _append_cases(*scenarios):
    return _scenario_cases(_append_one, scenarios)


def _random_append_scenarios():
    rng = random.Random(1)
    out = []
    for _ in range(15):
        lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 2))]
        forks = [rng.randrange(len(lens)) for _ in range(rng.randint(0, 2))]
        out.append((lens, forks, rng.randrange(len(lens) + len(forks))))
    return out


def _compare_append(got, want, args):
    ret, counts, free = got
    if type(ret) is not list or len(ret) != 2:
        return f"return (new_table, cow), got {ret!r}"
    if not exact_equal(ret, want[0]):
        return f"(new table, copy-on-write pair): expected {tuple(want[0])!r}, got {tuple(ret)!r}"
    if not exact_equal([counts, free], want[1:]):
        return f"(reference counts, free list) after: expected {tuple(want[1:])!r}, got {(counts, free)!r}"
    return None


COPY_ON_WRITE = Lab(
    "01-copy-on-write", "01_legacy_block_table", "append_token",
    "def append_token(table, num_tokens, block_size, refcounts, free_ids):",
    "A sequence's `table` (physical ids) holds `num_tokens` tokens; it appends one more, as the naive "
    "allocator does. `refcounts[b]` is block `b`'s reference count, `free_ids` the free list (the next "
    "id handed out first). Return `(new_table, cow)`, `cow` the `(src, dst)` pair of a copy on write or "
    "`None`, and update `refcounts` and `free_ids` in place. A full last block (or an empty table): take "
    "the first free id, even if the full block is shared. A partly filled last block shared with "
    "another table (count > 1): copy it to the first free id, and one reference moves there. A partly "
    "filled block of one's own: write in place.",
    (Check("a shared, partly filled last block", _append_cases(([10], [0], 1)),
           "the last block is shared (count > 1) and not full: copy it to a new block, one reference moves "
           "there"),
     Check("a last block of one's own", _append_cases(([10], [], 0)),
           "a block held once is written in place: nothing to copy, nothing allocated"),
     Check("a full last block", _append_cases(([8], [0], 0)),
           "the token starts a new block: take the first free id, even if the full block is shared"),
     Check("random forks", lambda: _append_cases(*_random_append_scenarios())(),
           "a full last block (or none): take the free list's first id; a partly filled shared block: "
           "copy it first; a partly filled block of one's own: write in place", public=False)),
    describe=lambda a: f"table {a[0]} holding {a[1]} tokens, reference counts {a[3]}, free list {a[4]}",
    compare=_compare_append, returns_args=(3, 4),
)


def _free_one(table, allocator):
    counts, free = _pool_state(allocator)
    args = [list(table.physical_block_ids), counts, free]
    table.free()
    return args, list(_pool_state(allocator))


def _free_cases(*scenarios):
    return _scenario_cases(_free_one, scenarios)


def _compare_free(got, want, args):
    if exact_equal(got[1:], want):
        return None
    return f"(reference counts, free list) after: expected {tuple(want)!r}, got {tuple(got[1:])!r}"


FREE = Lab(
    "01-free", "01_legacy_block_table", "free_table",
    "def free_table(table, refcounts, free_ids):",
    "Free a sequence's `table`, as the naive allocator does: every block, in the table's order, loses "
    "one reference, and a block left with none goes back to the **front** of the free list `free_ids` "
    "(so the last one freed is handed out first). Update `refcounts` and `free_ids` in place; what the "
    "function returns is not graded.",
    (Check("a table nobody shares", _free_cases(([10], [], 0)),
           "each block of the table, in order, goes to the front of the free list: the last one freed is "
           "handed out first"),
     Check("a table shared with a fork", _free_cases(([10], [0], 0)),
           "a block another table still holds keeps count 1 and stays out of the free list"),
     Check("random forks", _free_cases(([5, 9], [1], 2), ([12], [0, 0], 1), ([3, 4, 7], [2], 0)),
           "drop one reference per block; free the blocks that reach 0, to the front of the list",
           public=False)),
    describe=lambda a: f"table {a[0]}, reference counts {a[1]}, free list {a[2]}",
    compare=_compare_free, returns_args=(1, 2),
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


def _admission_cases(*cases):
    return lambda: [(list(c), _ref_can_allocate(*c)) for c in cases]


def _random_pools():
    rng = random.Random(2)
    out = []
    for _ in range(60):
        total = rng.randint(4, 64)
        wm = rng.randint(0, total // 4)
        out.append((rng.randint(1, total + 4), rng.randint(0, total), total, wm))
    return out


CAN_ALLOCATE = Lab(
    "02-can-allocate", "02_block_manager", "can_allocate",
    "def can_allocate(num_required_blocks, num_free_blocks, num_total_blocks, watermark_blocks):",
    "Return the string `\"OK\"`, `\"LATER\"` or `\"NEVER\"` (not `AllocStatus`: the lab runs without "
    "the library), as the block manager's `can_allocate` does for a prompt that needs `num_required_blocks` blocks (section "
    "1's rule): NEVER if even an empty pool could not take it (`num_total_blocks - need < watermark`), "
    "OK if `num_free_blocks - need >= watermark` (the bound is inclusive), LATER otherwise.",
    (Check("it fits, with room above the watermark", _admission_cases((4, 10, 20, 2)), "10 - 4 >= 2: admit now"),
     Check("only the watermark holds it back", _admission_cases((9, 10, 20, 2)),
           "10 - 9 = 1 < 2 blocks of watermark: LATER, not OK (the watermark keeps room for running requests)"),
     Check("too large for an empty pool", _admission_cases((20, 20, 20, 2)),
           "20 - 20 < 2 even with every block free: NEVER, compare against the total, not the free blocks"),
     Check("random pools", lambda: _admission_cases(*_random_pools())(),
           "OK if free - need >= watermark; NEVER if even an empty pool could not (total - need < watermark); "
           "LATER otherwise", public=False),
     Check("exactly on the watermark", _admission_cases((8, 10, 20, 2)), "10 - 8 = 2 >= 2: OK (the bound is "
                                                                           "inclusive)", public=False)),
    describe=lambda a: f"need {a[0]} blocks, {a[1]} of {a[2]} free, watermark {a[3]}",
)


# ---- 03: the numpy slot mapping --------------------------------------------------------------

def _ref_compute_slot_mapping(block_table, req_indices, positions, block_size):
    from paged_attention.v1 import BlockTable

    block_table = np.asarray(block_table, dtype=np.int32)
    rows, cols = block_table.shape
    bt = BlockTable(block_size, rows, cols, max(len(positions), 1), False, "cpu", block_size)
    for row in range(rows):
        bt.add_row(list(block_table[row]), row)
    bt.compute_slot_mapping(np.asarray(req_indices, dtype=np.int64), np.asarray(positions, dtype=np.int64))
    return bt.slot_mapping.np[:len(positions)].tolist()


def _numpy_cases(*cases):
    return lambda: [([t, r, p, bs], _ref_compute_slot_mapping(t, r, p, bs)) for t, r, p, bs in cases]


def _random_numpy():
    rng = np.random.default_rng(3)
    out = []
    for _ in range(20):
        rows, cols, bs = int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.choice([2, 4, 16]))
        table = rng.permutation(100)[:rows * cols].reshape(rows, cols).tolist()
        n = int(rng.integers(1, 12))
        out.append((table, rng.integers(0, rows, n).tolist(), rng.integers(0, cols * bs, n).tolist(), bs))
    return out


COMPUTE_SLOT_MAPPING = Lab(
    "03-compute-slot-mapping", "03_v1_block_table", "compute_slot_mapping",
    "def compute_slot_mapping(block_table, req_indices, positions, block_size):",
    "With numpy and no Python loop over tokens: token `t` belongs to row `req_indices[t]` of the 2-D "
    "int32 array `block_table` and sits at `positions[t]` (`req_indices` and `positions` are int64 "
    "arrays). Return the array of its slots, in token order: "
    "`block_table[req_indices[t], positions[t] // block_size] * block_size + positions[t] % block_size`.",
    (Check("a mixed batch", _numpy_cases(([[12, 3, 40], [7, 8, 9]], [0, 0, 1], [37, 38, 5], 16)),
           "the column is positions // block_size, the row is req_indices"),
     Check("requests out of row order", _numpy_cases(([[1, 2], [3, 4]], [1, 0, 1], [0, 3, 5], 4)),
           "index the rows with req_indices, not with the token's place in the batch"),
     Check("random tables", lambda: _numpy_cases(*_random_numpy())(),
           "row req_indices[t], column positions[t] // block_size, then * block_size + positions[t] % "
           "block_size", public=False)),
    describe=lambda a: f"rows {a[0]}, req_indices {a[1]}, positions {a[2]}, block_size {a[3]}",
    arg_types=("np.int32", "np.int64", "np.int64", None), imports=("import numpy as np",), needs=("numpy",),
)


# ---- 04: a Triton slot-mapping kernel --------------------------------------------------------

def _long_batch(seed, n, large_ids=False):
    rng = np.random.default_rng(seed)
    rows, cols, bs = 3, 40, (16 if large_ids else 8)
    if large_ids:                            # distinct ids just below 2**31: their slots need int64
        table = [[2**31 - 1 - 7 * (r * cols + c) for c in range(cols)] for r in range(rows)]
    else:
        table = rng.permutation(1000)[:rows * cols].reshape(rows, cols).tolist()
    return table, rng.integers(0, rows, n).tolist(), rng.integers(0, cols * bs, n).tolist(), bs


def _compare_slots(got, want, args):
    got = got[0]
    if exact_equal(got, want):
        return None
    if type(got) is list and len(got) == len(want):
        bad = next(i for i, (a, b) in enumerate(zip(got, want)) if not exact_equal(a, b))
        return f"wrong slots (first difference at token {bad}: {got[bad]!r} instead of {want[bad]})"
    return f"expected {len(want)} slots, got {got!r:.200}"


TRITON_SLOT_MAPPING = Lab(
    "04-triton-slot-mapping", "04_v2_triton_block_tables", "triton_slot_mapping",
    "def triton_slot_mapping(block_table, req_indices, positions, block_size):",
    "Lab 03's slot mapping as a Triton kernel: write a `@triton.jit` kernel that handles a tile of tokens per "
    "program, and this function, which launches it and returns an int64 tensor of slots **on the inputs' "
    "device** (`positions.device`: the GPU on a GPU machine, the CPU otherwise). `block_table` "
    "is an int32 tensor `[rows, cols]`, `req_indices` and `positions` are int64 tensors of one entry per "
    "token. Block ids go up to `2**31 - 1`, so compute the slot in int64 (`block.to(tl.int64)`): in "
    "int32 it overflows. On a CPU the kernel runs in Triton's interpreter, which has no bounds checks: "
    "mask every load and store. Keep the kernel in this cell (the grader writes the cell to a .py file "
    "for Triton to read).",
    (Check("a mixed batch", _numpy_cases(([[12, 3, 40], [7, 8, 9]], [0, 0, 1], [37, 38, 5], 16)),
           "slot = table[req, pos // block_size] * block_size + pos % block_size; "
           "the row stride of the table is its number of columns"),
     Check("more tokens than one tile", _numpy_cases(_long_batch(4, 300)),
           "use enough programs for every token (a grid of cdiv(num_tokens, TILE)) and mask the last tile"),
     Check("a long random batch", _numpy_cases(_long_batch(7, 1000)), "mask the tail of the last tile",
           public=False),
     Check("block ids near 2**31", _numpy_cases(_long_batch(8, 200, large_ids=True)),
           "block * block_size overflows int32: compute the slot in int64", public=False)),
    describe=lambda a: f"{len(a[2])} tokens, block_size {a[3]}",
    compare=_compare_slots, arg_types=("torch.int32", "torch.int64", "torch.int64", None),
    imports=("import torch", "import triton", "import triton.language as tl"), needs=("torch", "triton"),
    on_device=True,
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
    return list(memory.permute(*inverse).stride())


def _strides_cases(*cases):
    return lambda: [(list(c), _ref_strides(*c)) for c in cases]


def _random_shapes():
    rng = random.Random(5)
    return [(rng.choice(["NHD", "HND"]), rng.randint(1, 9), rng.choice([16, 32]), rng.randint(1, 8),
             rng.choice([64, 128])) for _ in range(20)]


KV_CACHE_STRIDES = Lab(
    "05-kv-cache-strides", "05_kv_cache_allocation", "kv_cache_strides",
    "def kv_cache_strides(layout, num_blocks, block_size, num_kv_heads, head_size):",
    "FlashAttention's KV cache has the logical shape `(2, num_blocks, block_size, num_kv_heads, "
    "head_size)`. Its memory order is that shape in NHD, and `(2, num_blocks, num_kv_heads, block_size, "
    "head_size)` in HND. Return the strides, in elements, of the logical view (a tuple of 5 ints).",
    (Check("NHD", _strides_cases(("NHD", 4, 16, 2, 64)),
           "in NHD memory follows the logical shape: each stride is the product of the sizes to its right "
           "(the K/V dimension is outermost: K of every block, then V)"),
     Check("HND", _strides_cases(("HND", 4, 16, 2, 64)),
           "in HND a block stores head by head: the token stride is head_size and the head stride "
           "block_size * head_size"),
     Check("random shapes", lambda: _strides_cases(*_random_shapes())(),
           "the K/V dimension is outermost: K of every block, then V of every block", public=False)),
    describe=lambda a: f"layout {a[0]}, {a[1]} blocks of {a[2]} tokens, {a[3]} KV heads of {a[4]}",
)


# ---- 06: merging partitions (the online softmax) -------------------------------------------------

def _ref_merge(max_logits, exp_sums, outputs):
    from paged_attention.kernels.layout import v2_merge_weights
    w = v2_merge_weights(max_logits, exp_sums)
    total = sum(w)
    return [sum(wi * o[d] for wi, o in zip(w, outputs)) / total for d in range(len(outputs[0]))]


def _merge_cases(*cases):
    return lambda: [([list(m), list(s), [list(x) for x in o]], _ref_merge(m, s, o)) for m, s, o in cases]


def _random_partitions():
    rng = random.Random(6)
    out = []
    for _ in range(30):
        p = rng.randint(1, 5)
        out.append(([rng.uniform(-20, 20) for _ in range(p)], [rng.uniform(0.5, 50) for _ in range(p)],
                    [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(p)]))
    return out


def _compare_merge(got, want, args):
    got = got[0]
    ok = type(got) is list and len(got) == len(want) and all(
        type(a) in (int, float) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for a, b in zip(got, want))
    return None if ok else f"expected {[round(x, 6) for x in want]}, got {got!r:.300}"


MERGE_PARTITIONS = Lab(
    "06-merge-partitions", "06_paged_attention_kernels", "merge_partitions",
    "def merge_partitions(max_logits, exp_sums, outputs):",
    "Partition `p` reports its maximum score `max_logits[p]`, its sum `exp_sums[p]` of "
    "`exp(score - max_logits[p])` and its locally normalised output `outputs[p]` (a list). Return the "
    "attention output over all partitions (a list of floats, compared to 1e-6), as v2's reduction kernel "
    "computes it (without the 1e-6). Scores can be large (`exp(800)` overflows): rescale by the largest "
    "maximum first.",
    (Check("partitions with different maxima", _merge_cases(([3.0, 5.0, 4.0], [20.0, 8.0, 12.0],
                                                             [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])),
           "rescale each exp-sum to the largest maximum before weighting: s_p * exp(m_p - M)"),
     Check("one partition", _merge_cases(([1.5], [7.0], [[0.25, -2.0]])), "a single partition's output is final"),
     Check("random partitions", lambda: _merge_cases(*_random_partitions())(),
           "w_p = s_p * exp(m_p - M) with M = max m_p; out = sum w_p o_p / sum w_p", public=False),
     Check("large scores", _merge_cases(([800.0, 790.0], [3.0, 4.0], [[1.0], [2.0]])),
           "exp(800) overflows: subtract the maximum first", public=False)),
    describe=lambda a: f"max_logits {a[0]}, exp_sums {a[1]}",
    compare=_compare_merge,
)


# ---- 07: V1's longest prefix-cache hit (full attention) ------------------------------------------
# A scenario is built with V1's block pool (prompts computed into blocks and cached, some blocks
# evicted), then a new prompt looks for its hit. The student gets the pool's cached-block map as
# plain data: each block hash named by a short string, the ids cached under it, oldest first.

def _v1_classes():
    """The library's V1 classes a scenario is built with (vLLM's oracle has the same names)."""
    from types import SimpleNamespace

    from paged_attention.kv_cache.interface import FullAttentionSpec
    from paged_attention.v1.core import kv_cache_utils as ku
    from paged_attention.v1.core.block_pool import BlockPool
    from paged_attention.v1.core.request import Request
    from paged_attention.v1.core.single_type_kv_cache_manager import FullAttentionManager
    return SimpleNamespace(BlockPool=BlockPool, Request=Request, FullAttentionManager=FullAttentionManager,
                           FullAttentionSpec=FullAttentionSpec, SamplingParams=SimpleNamespace,
                           get_request_block_hasher=ku.get_request_block_hasher,
                           init_none_hash=ku.init_none_hash, sha256=ku.sha256,
                           make_block_hash_with_group_id=ku.make_block_hash_with_group_id)


def longest_hit_case(classes, block_size, cached_prompts, evict, query, max_length) -> Case:
    """One case, built with ``classes`` (the library's, or vLLM's from its oracle): every prompt of
    ``cached_prompts`` takes new blocks from the pool and caches its full ones (the same prompt twice
    caches two blocks per hash); the blocks ``evict`` leave the cache; then the answer of
    ``FullAttentionManager.find_longest_cache_hit`` for ``query`` within ``max_length`` tokens."""
    import torch

    classes.init_none_hash(classes.sha256)
    hasher = classes.get_request_block_hasher(block_size, classes.sha256)
    pool = classes.BlockPool(64, enable_caching=True, hash_block_size=block_size)

    def request(i, tokens):
        return classes.Request(f"r{i}", list(tokens), classes.SamplingParams(max_tokens=1), None,
                               block_hasher=hasher)
    held = []
    for i, tokens in enumerate(cached_prompts):
        blocks = pool.get_new_blocks(math.ceil(len(tokens) / block_size))
        pool.cache_full_blocks(request(i, tokens), blocks, 0, len(tokens) // block_size, block_size, 0)
        held += blocks
    pool.evict_blocks(set(evict))
    hashes = request(len(cached_prompts), query).block_hashes
    spec = classes.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    (hit,), length = classes.FullAttentionManager.find_longest_cache_hit(hashes, max_length, [0], pool, spec,
                                                                          False, block_size)
    # The cache keys (hash and group) named h0, h1, ...: the query's blocks first, in order.
    keys = [classes.make_block_hash_with_group_id(h, 0) for h in hashes]
    names = {key: f"h{i}" for i, key in enumerate(dict.fromkeys(keys))}
    cached: dict[str, list[int]] = {}
    for block in held:                     # in the order they were cached: the first is the one found
        if block.block_hash is not None:
            name = names.setdefault(block.block_hash, f"h{len(names)}")
            cached.setdefault(name, []).append(block.block_id)
    for key, name in names.items():
        found = pool.cached_block_hash_to_block.get_one_block(key)
        assert (found.block_id if found else None) == (cached[name][0] if name in cached else None), name
    return [[names[k] for k in keys], cached, max_length, block_size], [[b.block_id for b in hit], length]


def _hit_cases(*scenarios, classes=None):
    """The cases of ``scenarios`` (built on first use), with the library's classes by default."""
    return lambda: [longest_hit_case(classes or _v1_classes(), *sc) for sc in scenarios]


def _random_hit_scenarios(seed=8, n=30):
    """Prompts cut from two shared prefixes (the query's one more often, so that hits happen), one
    sometimes computed twice, a few blocks evicted (a miss in the middle), and a query whose
    max_length is mostly what the manager asks (all but its last token), sometimes shorter."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        block_size = rng.choice([2, 4, 8])
        prefixes = [[rng.randrange(30) for _ in range(5 * block_size)] for _ in range(2)]
        prompts = [prefixes[rng.random() < 0.3][:rng.randint(1, 5 * block_size)] + [rng.randrange(30, 60)]
                   for _ in range(rng.randint(1, 4))]
        prompts += rng.sample(prompts, rng.randint(0, 1))                  # a prompt computed twice
        first_ids, num_blocks = [], 0                    # ids are handed out 1, 2, ... in order
        for p in prompts:
            first_ids.append(num_blocks + 1)
            num_blocks += math.ceil(len(p) / block_size)
        evict = rng.sample(range(1, num_blocks + 1), min(num_blocks, rng.randint(0, 2)))
        j = rng.randrange(len(prompts))
        if len(prompts[j]) > 2 * block_size:             # a block in the middle of a prompt
            evict.append(first_ids[j] + rng.randint(1, len(prompts[j]) // block_size - 1))
        query = prefixes[0][:rng.randint(block_size, 5 * block_size)] + [rng.randrange(60, 90)]
        max_length = len(query) - 1 if rng.random() < 0.7 else rng.randint(0, len(query))
        out.append((block_size, prompts, evict, query, max_length))
    return out


# Lab 07's scenarios, by check: (block_size, cached_prompts, evict, query, max_length) each.
HIT_SCENARIOS = {
    "the first blocks are cached": [(4, [list(range(12))], [], list(range(8)) + [50] * 8, 15)],
    "a miss in the middle": [(4, [list(range(16))], [2], list(range(16)) + [99], 16)],
    "a prompt cached whole": [(4, [list(range(16))], [], list(range(16)), 15)],
    "a hash cached under two blocks": [(4, [list(range(9)), list(range(9))], [], list(range(9)), 8),
                                       (2, [list(range(6)), list(range(4)), list(range(6))], [1],
                                        list(range(7)), 6)],
    "nothing to hit": [(4, [], [], list(range(8)), 7), (4, [list(range(8))], [], list(range(8)), 3),
                       (8, [list(range(20, 40))], [], list(range(16)), 15)],
    "random prefix caches": _random_hit_scenarios(),
}


LONGEST_CACHE_HIT = Lab(
    "07-longest-cache-hit", "07_v1_kv_cache_manager", "find_longest_cache_hit",
    "def find_longest_cache_hit(block_hashes, cached_blocks, max_length, block_size):",
    "A new prompt's full blocks have the hashes `block_hashes` (in order; each hash covers its block and "
    "every token before it, so it is a string naming the whole prefix). `cached_blocks` is the block pool's "
    "prefix cache: for each hash that is cached, the list of block ids cached under it, oldest first. As "
    "V1's `FullAttentionManager.find_longest_cache_hit` does for one full-attention group, return "
    "`(block_ids, num_tokens)`: the cached blocks the prompt can reuse, in order, and the tokens they hold "
    "(`len(block_ids) * block_size`). The rules: the hit is a prefix: walk from the first hash and stop at "
    "the first one that is not cached, even if later ones are; it holds at most `max_length` tokens, so at "
    "most `max_length // block_size` blocks (a block that would reach past `max_length` is not part of "
    "it); where several blocks are cached under one hash, take the first of its list.",
    (Check("the first blocks are cached", _hit_cases(*HIT_SCENARIOS["the first blocks are cached"]),
           "walk the hashes from the first and take the first block cached under each, until one is not "
           "cached"),
     Check("a miss in the middle", _hit_cases(*HIT_SCENARIOS["a miss in the middle"]),
           "the hit is a prefix: after the first hash that is not cached, stop, even if later ones are "
           "(a hash names its whole prefix)"),
     Check("a prompt cached whole", _hit_cases(*HIT_SCENARIOS["a prompt cached whole"]),
           "at most max_length // block_size blocks: a block that reaches past max_length is not a hit"),
     Check("a hash cached under two blocks", _hit_cases(*HIT_SCENARIOS["a hash cached under two blocks"]),
           "several blocks cached under one hash: take the first of its list (the oldest)", public=False),
     Check("nothing to hit", _hit_cases(*HIT_SCENARIOS["nothing to hit"]),
           "no cached hash, or max_length below one block: the answer is ([], 0)", public=False),
     Check("random prefix caches", _hit_cases(*HIT_SCENARIOS["random prefix caches"]),
           "a prefix of cached hashes, the first block of each, at most max_length // block_size blocks",
           public=False)),
    describe=lambda a: f"block_hashes {a[0]}, cached_blocks {a[1]}, max_length {a[2]}, block_size {a[3]}",
)


# ---- 08: one decode step's bookkeeping -------------------------------------------------------

def _ref_decode_step(num_tokens, block_size, num_free_blocks):
    """The library's FCFS scheduler over the legacy block manager: running requests of these lengths
    (the newest token not yet in a slot), ``num_free_blocks`` free, preemption by recomputation.
    Returns [the requests that decode, the requests preempted]."""
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
    return [[int(g.request_id[1:]) for g in record.decodes],
            [int(e.request_id[1:]) for e in record.events if e.kind == RECOMPUTED]]


def _step_cases(*cases):
    return lambda: [(list(c), _ref_decode_step(*c)) for c in cases]


def _random_steps():
    rng = random.Random(7)
    out = []
    for _ in range(20):
        bs = rng.choice([2, 4])
        lens = [rng.randint(2, 13) for _ in range(rng.randint(1, 6))]
        out.append((lens, bs, rng.randint(0, 3)))
    return out


def _ids(x) -> bool:
    return type(x) is list and all(type(i) is int for i in x) and len(set(x)) == len(x)


def _compare_step(got, want, args):
    got = got[0]
    if type(got) is not list or len(got) != 2 or not all(_ids(x) for x in got):
        return f"return (decoded, preempted), two lists of request numbers without repeats, got {got!r:.200}"
    if sorted(got[0]) == sorted(want[0]) and sorted(got[1]) == sorted(want[1]):
        return None
    return (f"(decoded, preempted), each compared as a set: expected {tuple(sorted(x) for x in want)!r}, "
            f"got {tuple(sorted(x) for x in got)!r}")


DECODE_STEP = Lab(
    "08-decode-step", "08_end_to_end", "decode_step",
    "def decode_step(num_tokens, block_size, num_free_blocks):",
    "The running requests `0, 1, ...` (oldest first) have `num_tokens[i]` tokens each, the newest "
    "not yet in a slot; the others fill `ceil((num_tokens[i] - 1) / block_size)` blocks. As the "
    "scheduler of vLLM V0 does at a decode step (the engine's `core=\"v0\"`), return `(decoded, preempted)`: the requests that run, "
    "and those preempted by recomputation. The rules: requests are served oldest first. A request passes "
    "only if at least one block is free, **even when its token goes into a partly filled block** (the "
    "check is an upper bound); it then takes a block only if its new token starts one (`(num_tokens[i] "
    "- 1) % block_size == 0`). When no block is free, the newest request still waiting (the last one; the "
    "request itself if none is left) is preempted and gives all its blocks back, and the check is tried "
    "again. Each list is compared as a set: order does not matter, repeats do.",
    (Check("room for everyone", _step_cases(([5, 9, 6], 4, 3)),
           "each request's new token needs the block it is written into"),
     Check("short by one block", _step_cases(([5, 9, 13, 6], 4, 1)),
           "when a request does not fit, preempt the newest running request (the last one) and give its "
           "blocks back to the pool"),
     Check("a partly filled block still counts", _step_cases(([5, 9, 13, 6], 4, 3)),
           "can_append_slots is an upper bound: a token written into a partly filled block still needs one "
           "free block to pass the check"),
     Check("random steps", lambda: _step_cases(*_random_steps())(),
           "oldest first; each needs one free block as an upper bound, takes one only if its new token "
           "starts a block; when short, preempt the newest and get its blocks back", public=False)),
    describe=lambda a: f"lengths {a[0]}, block_size {a[1]}, {a[2]} free blocks",
    compare=_compare_step,
)


LABS: dict[str, Lab] = {lab.lab_id: lab for lab in (SLOT_MAPPING, COPY_ON_WRITE, FREE, CAN_ALLOCATE,
                                                     COMPUTE_SLOT_MAPPING, TRITON_SLOT_MAPPING, KV_CACHE_STRIDES,
                                                     MERGE_PARTITIONS, LONGEST_CACHE_HIT, DECODE_STEP)}
