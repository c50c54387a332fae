"""Property tests of the V1 block table (rows, slot mapping, hybrid blocks), against independent references.

* Slot mapping vs the legacy layer: random requests are allocated as legacy ``BlockTable``s
  over a ``CpuGpuBlockAllocator`` (so ids come from a real allocator, and with prefix caching a
  block's id can change when it fills and is deduplicated); their ids are copied into V1 rows
  the way the worker would (``add_row``, then ``append_row`` of new ids, or ``add_row`` again
  when an id changed). The V1 slot of every scheduled token must equal the one computed token
  by token from ``physical_block_ids``: ``ids[p // block_size] * block_size + p % block_size``,
  with manager-level ids even when the V1 table is split into kernel blocks.
* DCP: the ranks' mappings partition the tokens (each token has a slot on exactly one rank,
  ``PAD_SLOT_ID`` on the others), runs of ``interleave`` tokens rotate among the ranks, and each
  rank packs its own tokens densely in order, as a legacy table over just those tokens would.
* Row operations: random add/append/clear/move/swap sequences on a ``MultiGroupBlockTable``
  leave exactly the buffers a plain-Python model of the row operations predicts (stale
  columns included: vLLM never clears them); a call that must fail raises and changes nothing.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_attention import runtime
from paged_attention.legacy.block_table import BlockTable as LegacyBlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator
from paged_attention.utils import PAD_SLOT_ID
from paged_attention.v1 import BlockTable, MultiGroupBlockTable

DEV = runtime.DEVICE
MAX_REQS = 5
MAX_BLOCKS = 96               # manager blocks per request: enough for 83 tokens at block size 1
MAX_TOKENS = 512             # 4 requests x 83 tokens scheduled at most

_settings = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

token_lists = st.lists(st.integers(0, 2), max_size=24)   # tiny alphabet: blocks repeat


def _slots_from_legacy(ids, block_size, positions):
    """The slot of each position, token by token, from a legacy table's physical ids."""
    return [ids[p // block_size] * block_size + p % block_size for p in positions]


def _copy_new_ids(v1, row, old_ids, new_ids):
    """What the worker does when a request's blocks changed: append the new tail, or replace
    the row when an existing id changed (a legacy prefix-cache promotion can do that)."""
    if new_ids[:len(old_ids)] == old_ids:
        v1.append_row(new_ids[len(old_ids):], row)
        return "append"
    v1.add_row(new_ids, row)
    return "replace"


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    split = draw(st.sampled_from([d for d in (1, 2, 4) if block_size % d == 0]))
    kind = draw(st.sampled_from(["naive", "prefix_caching"]))
    n = draw(st.integers(1, 4))
    # Requests share prefixes of one base text and often continue it, so that with prefix
    # caching a block that fills up matches another request's block and takes over its id.
    base = draw(st.lists(st.integers(0, 1), min_size=2, max_size=60))
    prompts, appends = [], []
    for _ in range(n):
        cut = draw(st.integers(1, len(base) - 1))
        prompts.append(base[:cut])
        follow = draw(st.booleans())
        appends.append(base[cut:cut + draw(st.integers(0, 24))] if follow else draw(token_lists))
    rows = draw(st.permutations(range(MAX_REQS)))[:n]
    # The tokens scheduled this step: a random run [start, end) of each request's positions.
    runs = []
    for prompt, extra in zip(prompts, appends):
        total = len(prompt) + len(extra)
        start = draw(st.integers(0, total - 1))
        runs.append((start, draw(st.integers(start + 1, total))))
    return block_size, split, kind, prompts, appends, rows, runs


_seen = {"append": 0, "replace": 0, "hybrid": 0}


@_settings
@given(workloads())
def test_slot_mapping_matches_the_legacy_tables_token_by_token(workload):
    block_size, split, kind, prompts, appends, rows, runs = workload
    allocator = CpuGpuBlockAllocator.create(kind, num_gpu_blocks=4 * MAX_BLOCKS, num_cpu_blocks=0,
                                            block_size=block_size)
    v1 = BlockTable(block_size, MAX_REQS, MAX_BLOCKS, MAX_TOKENS, False, DEV, block_size // split, 1)
    _seen["hybrid"] += split > 1
    legacy = []
    for prompt, row in zip(prompts, rows):
        table = LegacyBlockTable(block_size, allocator)
        table.allocate(prompt)
        v1.add_row(table.physical_block_ids, row)
        legacy.append(table)
    for table, extra, row in zip(legacy, appends, rows):
        old = list(table.physical_block_ids)
        table.append_token_ids(extra)
        _seen[_copy_new_ids(v1, row, old, table.physical_block_ids)] += 1

    # The V1 rows hold each legacy table's ids, split into kernel blocks.
    for table, row in zip(legacy, rows):
        ids = table.physical_block_ids
        assert v1.num_blocks_per_row[row] == len(ids) * split
        kernel_ids = [b * split + j for b in ids for j in range(split)]
        assert v1.block_table.np[row, :len(kernel_ids)].tolist() == kernel_ids

    req_indices = np.concatenate([np.full(e - s, row) for (s, e), row in zip(runs, rows)])
    positions = np.concatenate([np.arange(s, e) for s, e in runs])
    expected = sum((_slots_from_legacy(t.physical_block_ids, block_size, range(s, e))
                    for t, (s, e) in zip(legacy, runs)), [])
    v1.slot_mapping.np[:] = -7
    v1.compute_slot_mapping(req_indices, positions)
    n = len(positions)
    assert v1.slot_mapping.np[:n].tolist() == expected
    assert (v1.slot_mapping.np[n:] == -7).all()           # the numpy form leaves the tail alone

    # Bring the requests into batch order with swap_row, commit, and use the later form.
    row_of = {i: r for i, r in enumerate(rows)}
    for i in range(len(rows)):
        r = row_of[i]
        if r != i:
            v1.swap_row(i, r)
            for j, rj in row_of.items():
                if rj == i:
                    row_of[j] = r
            row_of[i] = i
    v1.commit_block_table(len(rows))
    query_start_loc = np.concatenate([[0], np.cumsum([e - s for s, e in runs])])
    v1.compute_slot_mapping_from_query_start_loc(len(rows), query_start_loc, positions)
    slots = v1.slot_mapping.gpu.cpu().numpy()
    assert slots[:n].tolist() == expected
    assert (slots[n:] == PAD_SLOT_ID).all()


def test_the_legacy_workloads_covered_every_path():
    """The property above saw ids appended, ids replaced (prefix-cache dedup) and hybrid tables."""
    if not all(_seen.values()):
        test_slot_mapping_matches_the_legacy_tables_token_by_token()
    assert all(v > 0 for v in _seen.values()), _seen


@st.composite
def dcp_workloads(draw):
    world = draw(st.sampled_from([2, 4]))
    kernel_block_size = draw(st.sampled_from([2, 4, 8, 16]))
    interleave = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if kernel_block_size % d == 0]))
    split = draw(st.sampled_from([1, 2]))
    total = draw(st.integers(1, 150))
    start = draw(st.integers(0, total - 1))
    return world, kernel_block_size, interleave, split, total, start, draw(st.integers(start + 1, total))


@_settings
@given(dcp_workloads())
def test_dcp_ranks_partition_the_tokens_and_pack_them_densely(workload):
    world, kernel_block_size, interleave, split, total, start, end = workload
    block_size = kernel_block_size * split                # the manager's block size
    # One scheduler allocates for all ranks: a block holds block_size tokens on each rank,
    # so block_size * world positions of the sequence.
    allocator = CpuGpuBlockAllocator.create("naive", num_gpu_blocks=64, num_cpu_blocks=0,
                                            block_size=block_size * world)
    legacy = LegacyBlockTable(block_size * world, allocator)
    legacy.allocate(list(range(total)))
    ids = legacy.physical_block_ids
    positions = np.arange(total)
    owner = (positions // interleave) % world             # runs of `interleave` rotate among ranks

    per_rank = []
    for rank in range(world):
        v1 = BlockTable(block_size, MAX_REQS, MAX_BLOCKS, MAX_TOKENS, False, DEV, kernel_block_size,
                        dcp_world_size=world, dcp_rank=rank, dcp_kv_cache_interleave_size=interleave)
        v1.add_row(ids, 3)
        v1.compute_slot_mapping(np.full(total, 3), positions)
        slots = v1.slot_mapping.np[:total].copy()
        per_rank.append(slots)

        local = slots != PAD_SLOT_ID
        assert (local == (owner == rank)).all()
        # The rank's k-th own token sits where a legacy table over only its tokens puts token k.
        k = np.arange(local.sum())
        assert slots[local].tolist() == _slots_from_legacy(ids, block_size, k)
        assert len(set(slots[local].tolist())) == local.sum()    # no two tokens share a slot

        # Scheduling only a run of positions gives the same slots for them.
        v1.compute_slot_mapping(np.full(end - start, 3), positions[start:end])
        assert v1.slot_mapping.np[:end - start].tolist() == slots[start:end].tolist()

    stored = np.stack(per_rank) != PAD_SLOT_ID
    assert (stored.sum(axis=0) == 1).all()                # every token on exactly one rank


# ---- Row operations against a plain model of them -----------------------------------------------
GROUPS = ((16, 16), (32, 16))          # (manager block size, kernel block size): bpk 1 and 2
COLUMNS = 16                            # max_num_blocks=[16, 8] -> 16 kernel columns in both groups


class _Model:
    """The row operations restated in plain lists: full-width rows (stale ids included) and counts."""

    def __init__(self):
        self.rows = [[[0] * COLUMNS for _ in range(MAX_REQS)] for _ in GROUPS]
        self.counts = [[0] * MAX_REQS for _ in GROUPS]

    def fits(self, op, row, ids):
        if not 0 <= row < MAX_REQS:
            return False
        for g, (bs, kbs) in enumerate(GROUPS):
            start = 0 if op == "add" else self.counts[g][row]
            if start + len(ids[g]) * (bs // kbs) > COLUMNS:
                return False
        return True

    def write(self, op, row, ids):
        for g, (bs, kbs) in enumerate(GROUPS):
            bpk = bs // kbs
            if op == "add":
                self.counts[g][row] = 0
            start = self.counts[g][row]
            kernel_ids = [b * bpk + j for b in ids[g] for j in range(bpk)]
            self.rows[g][row][start:start + len(kernel_ids)] = kernel_ids
            self.counts[g][row] = start + len(kernel_ids)

    def clear(self, row):
        for g in range(len(GROUPS)):
            n = self.counts[g][row]
            self.rows[g][row][:n] = [0] * n
            self.counts[g][row] = 0

    def move(self, src, tgt):
        for g in range(len(GROUPS)):
            n = self.counts[g][src]
            self.rows[g][tgt][:n] = self.rows[g][src][:n]
            self.counts[g][tgt] = n

    def swap(self, a, b):
        for g in range(len(GROUPS)):
            rows, counts = self.rows[g], self.counts[g]
            rows[a], rows[b] = rows[b], rows[a]
            counts[a], counts[b] = counts[b], counts[a]


rows_maybe_bad = st.integers(-1, MAX_REQS)          # -1 and MAX_REQS are out of range
ops = st.one_of(
    st.tuples(st.sampled_from(["add", "append"]), rows_maybe_bad,
              st.tuples(st.lists(st.integers(0, 50), max_size=7), st.lists(st.integers(0, 50), max_size=4))),
    st.tuples(st.just("clear"), rows_maybe_bad),
    st.tuples(st.sampled_from(["move", "swap"]), rows_maybe_bad, rows_maybe_bad),
)


@_settings
@given(st.lists(ops, min_size=1, max_size=40))
def test_row_operations_follow_the_spec_model_and_bad_calls_change_nothing(op_list):
    table = MultiGroupBlockTable(MAX_REQS, 64, 32, False, DEV, [bs for bs, _ in GROUPS],
                                 [kbs for _, kbs in GROUPS], max_num_blocks=[16, 8])
    assert [t.max_num_blocks_per_req for t in table.block_tables] == [COLUMNS, COLUMNS]
    model = _Model()
    for op in op_list:
        name = op[0]
        if name in ("add", "append"):
            _, row, ids = op
            ok = model.fits(name, row, ids)
            call = lambda: getattr(table, f"{name}_row")(ids, row)           # noqa: E731
            apply = lambda: model.write(name, row, ids)                       # noqa: E731
        elif name == "clear":
            ok = 0 <= op[1] < MAX_REQS
            call, apply = (lambda: table.clear_row(op[1])), (lambda: model.clear(op[1]))
        else:
            ok = all(0 <= r < MAX_REQS for r in op[1:])
            call = lambda: getattr(table, f"{name}_row")(op[1], op[2])        # noqa: E731
            apply = lambda: getattr(model, name)(op[1], op[2])                # noqa: E731
        if ok:
            call()
            apply()
        else:
            with pytest.raises((IndexError, ValueError)):
                call()
        for g, t in enumerate(table.block_tables):
            assert t.block_table.np.tolist() == model.rows[g], (g, op)
            assert t.num_blocks_per_row.tolist() == model.counts[g], (g, op)
            assert not t.block_table.gpu.any()             # nothing reaches the device uncommitted
