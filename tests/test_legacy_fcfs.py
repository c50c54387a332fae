"""paged_attention.legacy.scheduler, .workload and .records: the FCFS scheduler over the legacy block
manager, the synthetic workload that drives it, and what each step records.

The strongest check is a symbolic KV cache: every slot holds a name for the prefix whose K/V it
holds, the step records' swap and copy pairs are applied in the engine's order, new tokens are
written through the tables, and after every step each running sequence must read its own
prefixes back through its table. A wrong pair, a pair applied in the wrong order or a table
that forgot a block breaks it.
"""
import random

import pytest

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.records import (
    ABORTED, ADMITTED, COPY_ON_WRITE, FINISHED, IGNORED, RECOMPUTED, SWAPPED_IN, SWAPPED_OUT, WAITED,
)
from paged_attention.legacy.scheduler import FcfsScheduler
from paged_attention.legacy.workload import Request, SimulatedEngine, synthetic_workload
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device


# --- a symbolic KV cache ---------------------------------------------------------------------------

def prefix_keys(tokens):
    """One name per position: a hash of every token up to it (as a model's K/V depend on them)."""
    keys, key = [], 0
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


class SymbolicCache:
    def __init__(self, num_gpu_blocks, num_cpu_blocks, block_size):
        self.block_size = block_size
        self.gpu = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.written = {}                    # seq id -> tokens whose K/V are in the cache
        self.swapped_out = {}                # cpu id -> what the block held when it left
        self.num_returned = 0

    def apply(self, sched, record):
        """The engine's order: swap in, swap out, copy on write, then the forward pass's writes."""
        tables = sched.block_manager.block_tables
        for c, g in record.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
            assert self.gpu[g] == self.swapped_out[c]
            self.num_returned += 1
        for g, c in record.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
            self.swapped_out[c] = list(self.gpu[g])
        sources = {s: list(self.gpu[s]) for s, _ in record.blocks_to_copy}
        for s, d in record.blocks_to_copy:
            self.gpu[d] = list(sources[s])
        for group in record.recomputed:
            for seq in group.get_seqs(SequenceStatus.WAITING):
                del self.written[seq.seq_id]

        def write(seq, start):
            ids, tokens = tables[seq.seq_id].physical_block_ids, seq.get_token_ids()
            assert tables[seq.seq_id].num_full_slots == len(tokens)
            for p, key in list(enumerate(prefix_keys(tokens)))[start:]:
                self.gpu[ids[p // self.block_size]][p % self.block_size] = key
            self.written[seq.seq_id] = len(tokens)

        for group in record.prefills:
            first, *rest = group.get_seqs(SequenceStatus.RUNNING)
            write(first, record.num_cached_tokens[group.request_id])
            for seq in rest:
                self.written[seq.seq_id] = self.written[first.seq_id]
        for group in record.decodes:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                write(seq, self.written[seq.seq_id])

    def check(self, sched):
        """Every running sequence reads its own prefixes back through its table."""
        tables = sched.block_manager.block_tables
        for rid in sched.scheduler.running:
            for seq in sched.groups[rid].get_seqs(SequenceStatus.RUNNING):
                ids = tables[seq.seq_id].physical_block_ids
                for p, key in enumerate(prefix_keys(seq.get_token_ids())):
                    assert self.gpu[ids[p // self.block_size]][p % self.block_size] == key, \
                        (sched.scheduler.now, sched.seq_name(seq), p)


def run_checked(mgr, requests, **kwargs):
    sched = SimulatedEngine(mgr, requests, **kwargs)
    cache = SymbolicCache(mgr.num_total_gpu_blocks, mgr.num_total_cpu_blocks, mgr.block_size)
    while not sched.done:
        record = sched.schedule()
        for device, owners in ((Device.GPU, record.gpu_owners), (Device.CPU, record.cpu_owners)):
            allocator = mgr.block_allocator.allocators[device]
            ids = sorted(allocator.all_block_ids)            # device-relative id -> absolute id
            assert {i: allocator.refcounter.get(ids[i]) for i in owners} == \
                {i: owner.num_holders for i, owner in owners.items()}
        cache.apply(sched, record)
        cache.check(sched)
        sched.update(record)
        assert len(sched.history) < 2000
    return sched, cache


def demo(watermark=0.1, **kwargs):
    """The notebook's workload: swaps, recomputation, waits on the watermark, copies on write."""
    requests = synthetic_workload(10, seed=4, n=(1, 1, 2, 3), arrival_every=1.5, mean_prompt_len=16,
                                  mean_output_len=16, max_len=48)
    mgr = SelfAttnBlockSpaceManager(4, 32, 16, watermark=watermark, **kwargs)
    return mgr, requests


# --- requests and the workload -------------------------------------------------------------------

def test_output_tokens_diverge_between_samples_and_are_reproducible():
    r = Request("r0", 0, (1, 2, 3), (5, 5, 5, 5), seed=3)
    for position in range(20):
        tokens = [r.output_token(s, position) for s in range(r.n)]
        assert len(set(tokens)) == r.n                       # every sample differs at every position
        assert all(1 <= t < 32000 for t in tokens)
    assert r.output_token(1, 7) == Request("r0", 5, (9,), (1, 1, 1, 1), seed=3).output_token(1, 7)
    assert r.output_token(1, 7) != Request("r1", 0, (1, 2, 3), (5,) * 4, seed=3).output_token(1, 7)
    assert [r.output_token(0, k) for k in range(5)] != [r.output_token(0, 0)] * 5


def test_request_rejects_bad_input():
    with pytest.raises(TypeError):
        Request(3, 0, (1,), (1,))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", 0, (), (1,))
    with pytest.raises(ValueError, match="output_lens"):
        Request("r", 0, (1,), (0,))
    with pytest.raises(ValueError, match="output_lens"):
        Request("r", 0, (1,), ())
    with pytest.raises(TypeError, match="prompt_token_ids"):
        Request("r", 0, "abc", (1,))
    with pytest.raises(TypeError, match="ints"):
        Request("r", 0, (1.5,), (1,))
    with pytest.raises(ValueError, match="shared_prefix_len"):
        Request("r", 0, (1, 2), (1,), shared_prefix_len=3)
    with pytest.raises(ValueError):
        Request("r", -1, (1,), (1,))
    with pytest.raises(ValueError, match="sample"):
        Request("r", 0, (1,), (1, 1)).output_token(2, 0)
    assert Request("r", 0, [1, 2], [3]).prompt_token_ids == (1, 2)     # lists become tuples


def test_synthetic_workload_is_reproducible_and_within_its_limits():
    system = list(range(500, 508))
    kwargs = dict(seed=7, n=(1, 3), mean_prompt_len=20, mean_output_len=30, max_len=40, shared_prefix=system,
                  arrival_every=0.7)
    requests = synthetic_workload(30, **kwargs)
    assert requests == synthetic_workload(30, **kwargs)
    assert requests != synthetic_workload(30, **{**kwargs, "seed": 8})
    arrivals = [r.arrival_step for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and len(set(arrivals)) < len(arrivals)
    for r in requests:
        assert r.prompt_token_ids[:8] == tuple(system) and r.shared_prefix_len == 8 and r.prompt_len > 8
        assert r.n in (1, 3) and all(r.prompt_len + out <= 40 for out in r.output_lens)
    assert {r.n for r in requests} == {1, 3}
    assert len({r.request_id for r in requests}) == 30


def test_synthetic_workload_rejects_bad_input():
    with pytest.raises(ValueError, match="n must"):
        synthetic_workload(3, n=0)
    with pytest.raises(ValueError, match="n must"):
        synthetic_workload(3, n=())
    with pytest.raises(ValueError, match="mean_prompt_len"):
        synthetic_workload(3, mean_prompt_len=0)
    with pytest.raises(ValueError, match="shared_prefix"):
        synthetic_workload(3, shared_prefix=list(range(10)), max_len=10)
    with pytest.raises(TypeError):
        synthetic_workload(2.5)
    with pytest.raises(ValueError):
        synthetic_workload(0)


# --- the scheduler -------------------------------------------------------------------------------

def test_scheduler_rejects_bad_input():
    mgr, requests = demo()
    with pytest.raises(TypeError, match="SelfAttnBlockSpaceManager"):
        SimulatedEngine(object(), requests)
    with pytest.raises(TypeError, match="Request"):
        SimulatedEngine(mgr, [("r0", 0)])
    with pytest.raises(ValueError, match="unique"):
        SimulatedEngine(mgr, [requests[0], requests[0]])
    with pytest.raises(ValueError, match="preemption_mode"):
        SimulatedEngine(mgr, requests, preemption_mode="drop")
    with pytest.raises(ValueError, match="sliding"):
        SimulatedEngine(SelfAttnBlockSpaceManager(4, 8, 8, sliding_window=8), requests)
    sched = SimulatedEngine(mgr, requests)
    record = sched.schedule()
    with pytest.raises(RuntimeError, match="twice"):
        sched.schedule()
    sched.update(record)
    with pytest.raises(ValueError, match="update"):
        sched.update(record)                                  # the same record again
    with pytest.raises(ValueError, match="already holds"):
        SimulatedEngine(mgr, requests)                          # this manager is in use


def test_demo_run_keeps_the_data_path_consistent_and_frees_everything():
    mgr, requests = demo()
    sched, cache = run_checked(mgr, requests)
    kinds = {e.kind for e in sched.events}
    # The notebook's workload shows every kind of event but the failures.
    assert {ADMITTED, WAITED, SWAPPED_OUT, SWAPPED_IN, RECOMPUTED, FINISHED, COPY_ON_WRITE} <= kinds
    assert not kinds & {ABORTED, IGNORED}
    assert cache.num_returned == sum(len(r.blocks_to_swap_in) for r in sched.history) > 0
    assert mgr.get_num_free_gpu_blocks() == 32 and mgr.get_num_free_cpu_blocks() == 16
    assert not mgr.block_tables and sched.done and sched.scheduler.running == sched.scheduler.swapped == sched.scheduler.waiting == []
    for request in requests:              # every sample generated exactly its output length
        group = sched.groups[request.request_id]
        assert [s.get_len() - s.get_prompt_len() for s in group.get_seqs()] == list(request.output_lens)
        assert all(s.status == SequenceStatus.FINISHED_LENGTH_CAPPED for s in group.get_seqs())
    assert sum(e.kind == FINISHED for e in sched.events) == sum(r.n for r in requests)


def test_admission_is_first_come_first_served():
    mgr, requests = demo()
    sched, _ = run_checked(mgr, requests)
    arrival = {r.request_id: k for k, r in enumerate(requests)}
    first_admitted = []
    for e in sched.events:
        if e.kind == ADMITTED and e.request_id not in first_admitted:
            first_admitted.append(e.request_id)
    assert first_admitted == [r.request_id for r in requests]          # in arrival order
    for record in sched.history:
        admitted = [e.request_id for e in record.events if e.kind == ADMITTED]
        waited = [e.request_id for e in record.events if e.kind == WAITED]
        assert len(waited) <= 1                                        # admission stops at the first LATER
        if waited:                                                     # nobody behind it got in
            assert all(arrival[a] < arrival[waited[0]] for a in admitted)
            assert record.events[-1].kind in (WAITED, FINISHED)
        if admitted:                                                   # swapped groups go first
            assert record.swapped == [] and not record.blocks_to_swap_out
        assert all(r.arrival_step <= record.step for r in map(sched.requests.get, admitted))
        assert record.running == sorted(record.running, key=arrival.get)


def test_a_small_request_never_overtakes_a_waiting_large_one():
    # a holds 6 of 10 blocks for 8 steps; b needs 6 and waits; c needs 1 and would fit at once.
    requests = [Request("a", 0, tuple(range(1, 25)), (8,)), Request("b", 1, tuple(range(1, 25)), (2,)),
                Request("c", 1, (1, 2), (2,))]
    mgr = SelfAttnBlockSpaceManager(4, 10, 0, watermark=0.0)
    sched, _ = run_checked(mgr, requests)
    admitted = {e.request_id: e.step for e in reversed(sched.events) if e.kind == ADMITTED}
    waited = [e.step for e in sched.events if e.kind == WAITED and e.request_id == "b"]
    assert waited == list(range(1, admitted["b"])) and len(waited) >= 5
    assert admitted["c"] == admitted["b"]                 # c waits behind b, then both get in
    assert not any(e.request_id == "c" for e in sched.events if e.kind == WAITED)


def test_events_agree_with_the_managers_counts():
    mgr, requests = demo()
    sched, _ = run_checked(mgr, requests)
    for record in sched.history:
        # Every block in use belongs to some table, and every table's block is in use.
        assert len(record.gpu_owners) == 32 - record.num_free_gpu_blocks
        assert len(record.cpu_owners) == 16 - record.num_free_cpu_blocks
        for e in record.events:
            if e.kind == WAITED:                  # LATER: needed + watermark blocks were not free
                assert e.num_blocks > record.num_free_gpu_blocks - mgr.watermark_blocks
                assert e.on_watermark == (record.num_free_gpu_blocks >= e.num_blocks)
            if e.kind == SWAPPED_OUT:             # its blocks are on the CPU now, held by it alone
                assert e.num_blocks == len(e.pairs) > 0 and e.request_id in record.swapped
                assert all(record.cpu_owners[c].request_ids == (e.request_id,) for _, c in e.pairs)
            if e.kind == SWAPPED_IN:
                assert e.request_id in record.running
                assert all(e.request_id in record.gpu_owners[g].request_ids for _, g in e.pairs)
            if e.kind == COPY_ON_WRITE:           # the copy is the writer's alone
                assert all(record.gpu_owners[d].num_holders == 1 for _, d in e.pairs)
            if e.kind == RECOMPUTED:
                assert e.request_id in record.waiting and e.num_blocks > 0
        assert record.blocks_to_swap_out == [p for e in record.events if e.kind == SWAPPED_OUT for p in e.pairs]
        assert record.blocks_to_swap_in == [p for e in record.events if e.kind == SWAPPED_IN for p in e.pairs]
        assert record.blocks_to_copy == [p for e in record.events if e.kind == COPY_ON_WRITE for p in e.pairs]


def test_the_samples_of_one_prompt_share_it_until_they_diverge():
    prompt = tuple(range(1, 11))                              # 10 tokens: 2 full blocks and 2 tokens
    mgr = SelfAttnBlockSpaceManager(4, 32, 0, watermark=0.0)
    sched = SimulatedEngine(mgr, [Request("r0", 0, prompt, (6, 6, 6))])
    first = sched.step()
    assert first.kinds() == [ADMITTED] and list(first.gpu_owners) == [0, 1, 2]
    assert all(owner.num_holders == 3 and owner.shared for owner in first.gpu_owners.values())
    second = sched.step()                                     # each sample writes its own token into block 2
    assert second.blocks_to_copy == [(2, 3), (2, 4)]          # two copies; the last writer keeps block 2
    assert [second.gpu_owners[i].num_holders for i in range(5)] == [3, 3, 1, 1, 1]
    sched.run()
    assert mgr.get_num_free_gpu_blocks() == 32


def test_preemption_by_recomputation_and_abort():
    # No CPU at all: a single-sample group is recomputed, a group of samples is aborted.
    requests = [Request("a", 0, tuple(range(1, 13)), (20,)), Request("b", 0, tuple(range(1, 13)), (20,)),
                Request("c", 1, tuple(range(50, 54)), (12, 12))]
    mgr = SelfAttnBlockSpaceManager(4, 12, 0, watermark=0.0)
    sched, _ = run_checked(mgr, requests)
    kinds = [(e.kind, e.request_id) for e in sched.events]
    assert (RECOMPUTED, "b") in kinds and (ABORTED, "c") in kinds and (SWAPPED_OUT, "b") not in kinds
    assert all(s.status == SequenceStatus.FINISHED_ABORTED for s in sched.groups["c"].get_seqs())
    assert [s.get_len() for s in sched.groups["b"].get_seqs()] == [32]     # recomputed, then finished
    assert mgr.get_num_free_gpu_blocks() == 12

    # With CPU room, "swap" swaps and "recompute" recomputes the same single-sample victim.
    for mode, expected in (("swap", SWAPPED_OUT), ("recompute", RECOMPUTED)):
        mgr = SelfAttnBlockSpaceManager(4, 12, 12, watermark=0.0)
        sched, _ = run_checked(mgr, requests[:2], preemption_mode=mode)
        assert {e.kind for e in sched.events if e.request_id == "b"} & {SWAPPED_OUT, RECOMPUTED} == {expected}


def test_a_prompt_that_never_fits_is_ignored():
    requests = [Request("big", 0, tuple(range(1, 42)), (3,)), Request("small", 0, (1, 2, 3), (3,))]
    mgr = SelfAttnBlockSpaceManager(4, 10, 4, watermark=0.0)
    sched, _ = run_checked(mgr, requests)
    assert [(e.kind, e.request_id) for e in sched.events][:2] == [(IGNORED, "big"), (ADMITTED, "small")]
    assert sched.groups["big"].get_seqs()[0].status == SequenceStatus.FINISHED_IGNORED


def test_prefix_caching_shares_the_system_prompt_across_requests():
    system = list(range(900, 916))                            # 4 full blocks of 4
    requests = synthetic_workload(8, seed=4, n=1, arrival_every=2, mean_prompt_len=24, mean_output_len=12,
                                  max_len=48, shared_prefix=system)
    cached = SelfAttnBlockSpaceManager(4, 32, 16, watermark=0.1, enable_caching=True)
    sched, _ = run_checked(cached, requests)
    hits = {rid: n for record in sched.history for rid, n in record.num_cached_tokens.items()}
    assert hits["r0"] == 0 and all(hits[r.request_id] == 16 for r in requests[1:])
    assert 0 < cached.get_prefix_cache_hit_rate(Device.GPU) < 1
    assert any(len(owner.request_ids) > 1 for record in sched.history for owner in record.gpu_owners.values())

    naive = SelfAttnBlockSpaceManager(4, 32, 16, watermark=0.1)
    plain, _ = run_checked(naive, requests)
    used = [sum(32 - r.num_free_gpu_blocks for r in s.history) for s in (sched, plain)]
    assert used[0] < used[1]
    assert all(not r.num_cached_tokens or set(r.num_cached_tokens.values()) == {0} for r in plain.history)


@pytest.mark.parametrize("trial", range(60))
def test_random_runs_keep_the_data_path_consistent(trial):
    rng = random.Random(trial)
    block_size = rng.choice([2, 4, 8])
    caching = trial % 2 == 0
    prefix = [7] * rng.choice([0, block_size, 2 * block_size + 1]) if caching else []
    requests = synthetic_workload(rng.randint(1, 8), seed=trial, n=(1, 2, 3), arrival_every=rng.choice([0.5, 1, 2]),
                                  mean_prompt_len=len(prefix) + rng.choice([4, 12]),
                                  mean_output_len=rng.choice([3, 12]), max_len=len(prefix) + 32, shared_prefix=prefix)
    num_gpu, num_cpu = rng.randint(6, 30), rng.randint(0, 20)
    mgr = SelfAttnBlockSpaceManager(block_size, num_gpu, num_cpu, watermark=rng.choice([0.0, 0.1, 0.2]),
                                    enable_caching=caching)
    sched, _ = run_checked(mgr, requests, preemption_mode=rng.choice(["swap", "recompute"]))
    assert mgr.get_num_free_gpu_blocks() == num_gpu and mgr.get_num_free_cpu_blocks() == num_cpu
    assert not mgr.block_tables
    for record in sched.history:
        assert len(record.gpu_owners) == num_gpu - record.num_free_gpu_blocks


# --- the scheduler without the simulation: what a model runner gets and gives back ---------------

def test_the_scheduler_tells_the_model_runner_what_to_run_and_knows_no_model():
    # An engine of its own: two requests, a fixed token per step, a stop after three tokens.
    mgr = SelfAttnBlockSpaceManager(4, 16, 0, watermark=0.0)
    sched = FcfsScheduler(mgr)
    a = Sequence(0, [1, 2, 3, 4, 5], 4)
    b1, b2 = Sequence(1, [6, 7, 8], 4), Sequence(2, [6, 7, 8], 4)
    sched.add_seq_group(SequenceGroup("a", [a]))
    sched.add_seq_group(SequenceGroup("b", [b1, b2]))
    first = sched.schedule()
    assert [(s.seq_group.request_id, s.token_chunk_size, s.is_prefill) for s in first.scheduled_seq_groups] == \
        [("a", 5, True), ("b", 3, True)]
    assert first.num_batched_tokens == 5 + 2 * 3
    assert sched.update(first, {0: 100, 1: 101, 2: 102}) == []
    assert a.get_token_ids()[-1] == 100 and a.data.get_num_computed_tokens() == 5
    second = sched.schedule()
    assert [(s.seq_group.request_id, s.token_chunk_size, s.is_prefill) for s in second.scheduled_seq_groups] == \
        [("a", 1, False), ("b", 1, False)]
    assert second.num_batched_tokens == 3 and second.blocks_to_copy      # b's samples diverge: a copy on write
    finished = sched.update(second, {0: 200, 1: 201, 2: 202}, finished_seq_ids={1})
    assert finished == [b1] and b1.status == SequenceStatus.FINISHED_LENGTH_CAPPED and 1 not in mgr.block_tables
    assert sched.has_unfinished_seqs()
    third = sched.schedule()
    assert sum(len(s.seq_group.get_seqs(SequenceStatus.RUNNING)) for s in third.scheduled_seq_groups) == 2
    sched.update(third, {}, finished_seq_ids={0, 2})
    assert not sched.has_unfinished_seqs() and not mgr.block_tables and sched.done_ids == ["a", "b"]


def test_add_seq_group_rejects_bad_input():
    sched = FcfsScheduler(SelfAttnBlockSpaceManager(4, 8, 0))
    with pytest.raises(TypeError, match="SequenceGroup"):
        sched.add_seq_group(Sequence(0, [1], 4))
    sched.add_seq_group(SequenceGroup("a", [Sequence(0, [1], 4)]))
    with pytest.raises(ValueError, match="already added"):
        sched.add_seq_group(SequenceGroup("a", [Sequence(1, [1], 4)]))
    with pytest.raises(ValueError, match="seq_id"):
        sched.add_seq_group(SequenceGroup("b", [Sequence(0, [1], 4)]))
    running = Sequence(2, [1], 4)
    running.status = SequenceStatus.RUNNING
    with pytest.raises(ValueError, match="WAITING"):
        sched.add_seq_group(SequenceGroup("c", [running]))
