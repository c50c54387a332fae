"""v2 ``BlockTables`` against v1's ``MultiGroupBlockTable`` and a numpy model, on random workloads.

A workload is a few scheduler steps over request states. Each step: some requests finish (their
state is freed and may be reused), new ones arrive (``overwrite=True``), running ones grow
(``overwrite=False``, often with nothing new for a group with bigger blocks) or are re-added with
other blocks (``overwrite=True``, sometimes empty); then a random subset of the live requests,
in random order, is the batch (``idx_mapping``), each with a few tokens at positions it has
blocks for, and some padding after them.

Both v2 kernel sets (``impl="vllm"`` and ``"triton"``) run the same workload, and everything is compared:

* with v1, driven as its worker would (``add_row``/``append_row`` of the same ids, rows freed
  with ``clear_row`` and condensed with ``move_row``, the batch order made with ``swap_row``):
  v2's gathered rows equal v1's committed rows over every request's blocks, and v2's slot
  mappings equal v1's numpy slots for the real tokens and v1's padded (later-form) buffer whole;
* with a numpy model of v2's exact state: the persistent tables, the counts, the gathered input
  tables *including* their stale columns and zeroed padded rows, and the slot mappings, whole;
* the slot mappings read through ``idx_mapping`` (without the gather) equal those above.

On a CPU the kernels run in Triton's interpreter: few examples, small shapes, derandomized. The
``cuda`` test runs the same property compiled, with block sizes 16 and 32 and more of it.
"""
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_attention import runtime
from paged_attention.utils import PAD_SLOT_ID, cdiv
from paged_attention.v1 import MultiGroupBlockTable
from paged_attention.v2 import make_block_tables

DEV = runtime.DEVICE


@dataclass
class Shape:
    block_sizes: list
    max_num_reqs: int
    max_num_batched_tokens: int
    max_model_len: int
    steps: int
    max_query: int            # tokens a request may get in one step


CPU_SHAPES = [Shape([4, 8], 4, 12, 40, 4, 4), Shape([8], 3, 8, 32, 3, 3), Shape([8, 4, 2], 3, 10, 24, 3, 4)]
GPU_SHAPES = [Shape([16, 32], 16, 256, 1024, 8, 64), Shape([32, 16], 8, 96, 300, 6, 40)]


@dataclass
class Request:
    length: int                                   # tokens the request has KV space for
    blocks: list = field(default_factory=list)    # per group


class Workload:
    """Drives two v2 BlockTables (vLLM's kernels, ours), one v1 MultiGroupBlockTable and the numpy model."""

    def __init__(self, shape: Shape):
        self.s = shape
        self.groups = len(shape.block_sizes)
        self.widths = [cdiv(shape.max_model_len, bs) for bs in shape.block_sizes]
        self.v2 = {impl: make_block_tables(shape.block_sizes, shape.max_num_reqs, shape.max_num_batched_tokens,
                                           shape.max_model_len, DEV, impl=impl) for impl in ("vllm", "triton")}
        self.v1 = MultiGroupBlockTable(shape.max_num_reqs, shape.max_model_len, shape.max_num_batched_tokens,
                                       False, DEV, shape.block_sizes, shape.block_sizes)
        # The numpy model of v2's state.
        self.tables = [np.zeros((shape.max_num_reqs, w), np.int64) for w in self.widths]
        self.counts = np.zeros((self.groups, shape.max_num_reqs), np.int64)
        self.inputs = [np.zeros((shape.max_num_reqs, w), np.int64) for w in self.widths]
        self.live: dict[int, Request] = {}        # request state -> request
        self.v1_rows: list[int] = []              # request state in each occupied v1 row
        self.next_id = 1

    def fresh_ids(self, draw, n):
        ids = []
        for _ in range(n):
            self.next_id += draw(st.integers(1, 3))     # unique ids, with gaps
            ids.append(self.next_id)
        return ids

    def append(self, req, ids, overwrite):
        for bt in self.v2.values():
            bt.append_block_ids(req, tuple(list(x) for x in ids), overwrite=overwrite)
        for g, x in enumerate(ids):
            start = 0 if overwrite else self.counts[g, req]
            self.tables[g][req, start:start + len(x)] = x
            self.counts[g, req] = start + len(x)
        row = self.v1_rows.index(req)
        if overwrite:
            self.v1.add_row(tuple(ids), row)
        else:
            self.v1.append_row(tuple(ids), row)

    def step(self, draw):
        s = self.s
        # Finished requests: v2 forgets nothing (the state's row stays, stale); v1 clears the
        # row and moves its last row into the hole.
        finished = draw(st.lists(st.sampled_from(sorted(self.live)), unique=True,
                                 max_size=len(self.live) // 2)) if self.live else []
        for req in finished:
            del self.live[req]
            row = self.v1_rows.index(req)
            self.v1.clear_row(row)
            last = len(self.v1_rows) - 1
            if row != last:
                self.v1.move_row(last, row)
                self.v1_rows[row] = self.v1_rows[last]
            self.v1_rows.pop()
        running = sorted(self.live)
        # New requests, in any free state (states are reused).
        free = [r for r in range(s.max_num_reqs) if r not in self.live]
        arrivals = draw(st.lists(st.sampled_from(free), unique=True, min_size=0 if self.live else 1)) if free else []
        for req in arrivals:
            length = draw(st.integers(1, s.max_model_len))
            self.live[req] = Request(length, [self.fresh_ids(draw, cdiv(length, bs)) for bs in s.block_sizes])
            self.v1_rows.append(req)
            self.append(req, self.live[req].blocks, overwrite=True)
        # Running requests grow, are re-added with other blocks, or stay.
        for req in running:
            r = self.live[req]
            action = draw(st.sampled_from(["stay", "grow", "grow", "readd"]))
            if action == "grow":
                new_len = min(s.max_model_len, r.length + draw(st.integers(0, 2 * max(s.block_sizes))))
                new = [self.fresh_ids(draw, cdiv(new_len, bs) - len(b)) for bs, b in zip(s.block_sizes, r.blocks)]
                r.length, r.blocks = new_len, [b + n for b, n in zip(r.blocks, new)]
                self.append(req, new, overwrite=False)
            elif action == "readd":
                r.length = draw(st.integers(0, s.max_model_len))
                r.blocks = [self.fresh_ids(draw, cdiv(r.length, bs)) for bs in s.block_sizes]
                self.append(req, r.blocks, overwrite=True)
        for bt in self.v2.values():
            bt.apply_staged_writes()

        # The batch: live requests in any order, each with tokens it has blocks for.
        batch = draw(st.permutations(sorted(self.live)))
        batch = batch[:len(batch) - draw(st.integers(0, len(batch) // 2))]
        counts, positions = [], []
        budget = s.max_num_batched_tokens
        for req in batch:
            length = self.live[req].length
            most = min(s.max_query, length, budget)
            k = draw(st.integers(min(1, most), most))
            first = draw(st.integers(0, length - k))
            counts.append(k)
            positions += list(range(first, first + k))
            budget -= k
        num_tokens = len(positions)
        extra = draw(st.integers(0, s.max_num_batched_tokens - num_tokens))
        padded_positions = positions + [0] * extra                 # padding tokens: any position
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        num_reqs = len(batch)
        num_reqs_padded = num_reqs + draw(st.integers(0, s.max_num_reqs - num_reqs))
        num_tokens_padded = draw(st.integers(0, s.max_num_batched_tokens))

        # v1: rows 0..num_reqs-1 become the batch, in order (swaps, as InputBatch reorders).
        for i, req in enumerate(batch):
            j = self.v1_rows.index(req)
            if j != i:
                self.v1.swap_row(i, j)
                self.v1_rows[i], self.v1_rows[j] = self.v1_rows[j], self.v1_rows[i]
        self.v1.commit_block_table(num_reqs)
        req_rows = np.repeat(np.arange(num_reqs), counts)
        self.v1.compute_slot_mapping(req_rows, np.array(positions, dtype=np.int64))
        v1_slots = [t.slot_mapping.np[:num_tokens].copy() for t in self.v1.block_tables]
        self.v1.compute_slot_mapping_from_query_start_loc(num_reqs, qsl, np.array(padded_positions, dtype=np.int64))
        v1_padded = [t.slot_mapping.gpu.cpu().numpy().copy() for t in self.v1.block_tables]

        # The model: gather, then slots.
        for g in range(self.groups):
            for b, req in enumerate(batch):
                n = self.counts[g, req]
                self.inputs[g][b, :n] = self.tables[g][req, :n]
            self.inputs[g][num_reqs:num_reqs_padded] = 0
        model_slots = np.full((self.groups, s.max_num_batched_tokens), PAD_SLOT_ID, np.int64)
        owners = [batch[b] for b in req_rows]
        for g, bs in enumerate(s.block_sizes):
            for t, (req, p) in enumerate(zip(owners, positions)):
                model_slots[g, t] = self.tables[g][req, p // bs] * bs + p % bs

        idx = torch.tensor(batch, dtype=torch.int32, device=DEV)
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEV)
        pos_t = torch.tensor(padded_positions, dtype=torch.int64, device=DEV)
        for impl, bt in self.v2.items():
            # Persistent state.
            assert np.array_equal(bt.num_blocks.np, self.counts), impl
            assert np.array_equal(bt.num_blocks.gpu.cpu().numpy(), self.counts), impl
            for g in range(self.groups):
                assert np.array_equal(bt.block_tables[g].gpu.cpu().numpy(), self.tables[g]), (impl, g)
            # Gather: v1's rows over each request's blocks; the model's input tables whole.
            gathered = bt.gather_block_tables(idx, num_reqs_padded)
            for g, v1_table in enumerate(self.v1.block_tables):
                got = gathered[g].cpu().numpy()
                assert got.shape == (num_reqs_padded, self.widths[g])
                v1_rows = v1_table.block_table.gpu[:num_reqs].cpu().numpy()
                for b, req in enumerate(batch):
                    n = self.counts[g, req]
                    assert v1_table.num_blocks_per_row[b] == n, (impl, g, b)
                    assert np.array_equal(got[b, :n], v1_rows[b, :n]), (impl, g, b)
                assert np.array_equal(bt.input_block_tables[g].cpu().numpy(), self.inputs[g]), (impl, g)
            # Slots, from the gathered rows.
            out = bt.compute_slot_mappings(qsl_t, pos_t, num_tokens_padded=num_tokens_padded)
            assert tuple(out.shape) == (self.groups, num_tokens_padded)
            slots = bt.slot_mappings.cpu().numpy()
            for g in range(self.groups):
                assert np.array_equal(slots[g, :num_tokens], v1_slots[g]), (impl, g)
                assert np.array_equal(slots[g], v1_padded[g]), (impl, g)
            assert np.array_equal(slots, model_slots), impl
            # Slots through idx_mapping, from the persistent tables: the same.
            bt.get_dummy_slot_mappings(0)
            bt.compute_slot_mappings(qsl_t, pos_t, idx_mapping=idx)
            assert np.array_equal(bt.slot_mappings.cpu().numpy(), model_slots), impl


def run_workload(data, shapes):
    shape = data.draw(st.sampled_from(shapes))
    w = Workload(shape)
    for _ in range(data.draw(st.integers(1, shape.steps))):
        w.step(data.draw)


_cpu_settings = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_gpu_settings = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_cpu_settings
@given(st.data())
def test_v2_equals_v1_and_the_model(data):
    run_workload(data, CPU_SHAPES)


@pytest.mark.cuda
@_gpu_settings
@given(st.data())
def test_v2_equals_v1_and_the_model_compiled(data):
    run_workload(data, GPU_SHAPES)
