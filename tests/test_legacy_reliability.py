"""The legacy block layer driven carelessly: a swapped-out request freed by an abort, a chunked
prefill with prefix caching, and bad arguments to every public entry point. Each case is a small
fixed reproduction; a refused call must leave every count, table, cache and tracker as it was.
"""
import math
from dataclasses import astuple

import numpy as np
import pytest

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator
from paged_attention.legacy.evictor import LRUEvictor
from paged_attention.legacy.naive_block import NaiveBlock, NaiveBlockAllocator
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlockAllocator
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device

from legacy_state import allocator_state

GPU, CPU = Device.GPU, Device.CPU
RUNNING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.SWAPPED


# ---- helpers ----------------------------------------------------------------------------------------


def _device_state(a):
    return [allocator_state(a._allocators[d]) for d in (GPU, CPU)] + [dict(a._swap_mapping)]


def _table_state(t):
    return (list(t.physical_block_ids), [list(b.token_ids) for b in t.blocks], t.num_full_slots,
            [id(b) for b in t.blocks])


def _state(mgr):
    """A manager's whole state, cached-token counts and access times included."""
    tracker = mgr._computed_blocks_tracker
    return (_device_state(mgr.block_allocator), {k: _table_state(t) for k, t in mgr.block_tables.items()},
            {k: list(v) for k, v in tracker._seq_id_to_blocks_hashes.items()},
            dict(tracker._seq_id_to_num_tokens_computed),
            dict(mgr._last_access_blocks_tracker._seq_last_access))


def _refused(state_of, call, error, match=None):
    """``call`` raises ``error`` and ``state_of()`` is the same before and after."""
    before = state_of()
    with pytest.raises(error, match=match):
        call()
    assert state_of() == before


def _running(mgr, seq_id, tokens, n=1):
    """An admitted group of ``n`` samples, marked running (nothing computed yet)."""
    seqs = [Sequence(seq_id + i, list(tokens), mgr.block_size) for i in range(n)]
    group = SequenceGroup(f"r{seq_id}", seqs)
    mgr.allocate(group)
    for seq in seqs:
        seq.status = RUNNING
    return seqs[0], group


def _pools_consistent(a):
    """Every pool's free slots are distinct, inside the pool, and not an object a table uses."""
    for inner in a._allocators.values():
        pool = inner._block_pool
        free = list(pool._free_ids)
        assert len(set(free)) == len(free) and all(0 <= i < len(pool._pool) for i in free)


# ---- a swapped-out request freed by an abort ---------------------------------------------------------

@pytest.mark.parametrize("caching", [False, True])
def test_a_swapped_out_request_freed_by_an_abort_gives_its_blocks_back_to_their_own_pool(caching):
    mgr = SelfAttnBlockSpaceManager(4, 8, 1, watermark=0, enable_caching=caching)
    groups = [_running(mgr, i, [10 * i + j for j in range(4)])[1] for i in range(5)]
    mgr.swap_out(groups[4])
    groups[4].seqs[0].status = SWAPPED
    groups[4].seqs[0].status = SequenceStatus.FINISHED_ABORTED
    mgr.free(groups[4].seqs[0])                       # the abort: its block object was made on the GPU
    _pools_consistent(mgr.block_allocator)
    assert mgr.can_swap_out(groups[3])
    pairs = mgr.swap_out(groups[3])                   # raised IndexError, leaving a GPU block freed
    groups[3].seqs[0].status = SWAPPED
    assert len(pairs) == 1 and mgr.get_num_free_cpu_blocks() == 0
    assert mgr.block_tables[3].physical_block_ids == [8]
    _pools_consistent(mgr.block_allocator)
    held = {b for t in mgr.block_tables.values() for b in t.physical_block_ids}
    assert mgr.get_num_free_gpu_blocks() == 8 - len(held & set(range(8)))
    # Everything still works: new requests, the swapped one back in, everything freed.
    more = [_running(mgr, 10 + i, [100 + i] * 4)[0] for i in range(3)]
    assert len({id(b) for t in mgr.block_tables.values() for b in t.blocks}) == 7   # no object twice
    mgr.swap_in(groups[3])
    groups[3].seqs[0].status = RUNNING
    for seq in [g.seqs[0] for g in groups[:4]] + more:
        mgr.free(seq)
    assert mgr.get_num_free_gpu_blocks() == 8 and mgr.get_num_free_cpu_blocks() == 1
    _pools_consistent(mgr.block_allocator)


def test_a_block_made_on_the_cpu_and_swapped_in_appends_through_the_gpu_allocator():
    a = CpuGpuBlockAllocator.create("naive", 4, 4, 4)
    table = BlockTable(4, a)
    table.allocate([1, 2, 3], device=CPU)
    a.swap(table.blocks, CPU, GPU)
    table.update(table.blocks)
    forked = table.fork()
    table.append_token_ids([4])                       # shared: copied on write, on the GPU
    assert a.clear_copy_on_writes() == [(0, 1)] and table.physical_block_ids == [1]
    assert forked.physical_block_ids == [0]
    table.free()
    forked.free()
    assert a.get_num_free_blocks(GPU) == 4 and a.get_num_free_blocks(CPU) == 4
    _pools_consistent(a)


# ---- chunked prefill with prefix caching ---------------------------------------------------------------

PROMPT = list(range(100, 113))                        # 13 tokens: blocks of 4, 4, 4 and 1


def _hashes(mgr, seq):
    mgr.get_num_cached_tokens(seq)
    return mgr._computed_blocks_tracker._seq_id_to_blocks_hashes[seq.seq_id]


def test_a_prefill_chunk_marks_only_the_blocks_it_covers():
    mgr = SelfAttnBlockSpaceManager(4, 16, 0, watermark=0, enable_caching=True)
    gpu = mgr.block_allocator._allocators[GPU]
    a, group_a = _running(mgr, 0, PROMPT)
    mgr.mark_blocks_as_computed(group_a, token_chunk_size=4)      # the first chunk is scheduled
    b, _ = _running(mgr, 1, PROMPT)
    a_ids = mgr.get_block_table(a)
    assert mgr.get_block_table(b)[:3] == a_ids[:3]                # shared, computed or not
    assert mgr.get_num_cached_tokens(b) == 4                      # was 12: blocks 1 and 2 have no KV
    assert mgr.get_common_computed_block_ids([b]) == a_ids[:1]
    hashes = _hashes(mgr, b)
    assert gpu.find_cached_blocks_prefix(hashes) == hashes[:1]
    assert [gpu.block_is_computed(i) for i in a_ids[:3]] == [True, False, False]
    a.data.update_num_computed_tokens(4)
    mgr.mark_blocks_as_computed(group_a, token_chunk_size=6)      # 10 tokens: block 1 now, not block 2
    assert [gpu.block_is_computed(i) for i in a_ids[:3]] == [True, True, False]
    a.data.update_num_computed_tokens(6)
    mgr.mark_blocks_as_computed(group_a, token_chunk_size=3)      # the whole prompt
    assert [gpu.block_is_computed(i) for i in a_ids[:3]] == [True, True, True]
    c, _ = _running(mgr, 2, PROMPT)
    assert mgr.get_num_cached_tokens(c) == 12


def test_a_request_freed_before_its_kv_was_written_offers_none_of_it():
    mgr = SelfAttnBlockSpaceManager(4, 16, 0, watermark=0, enable_caching=True)
    gpu = mgr.block_allocator._allocators[GPU]
    a, _ = _running(mgr, 0, PROMPT)
    a_ids = list(mgr.get_block_table(a))
    a.data.update_num_computed_tokens(4)              # the first chunk ran; no mark call at all
    mgr.free(a)
    # Cached but not computed: the blocks wait in the evictor (and count as free), never as KV.
    assert all(i in gpu.evictor for i in a_ids[:3]) and mgr.get_num_free_gpu_blocks() == 16
    assert [gpu.block_is_computed(i) for i in a_ids[:3]] == [True, False, False]
    b, group_b = _running(mgr, 1, PROMPT)
    assert mgr.get_block_table(b)[:3] == a_ids[:3]    # revived from the evictor
    assert mgr.get_num_cached_tokens(b) == 4 and mgr.get_common_computed_block_ids([b]) == a_ids[:1]
    assert [gpu._block_tracker[i].computed for i in a_ids[:3]] == [True, False, False]
    assert [blk.computed for blk in mgr.block_tables[1].blocks[:3]] == [True, False, False]
    b.data.update_num_computed_tokens(4)
    mgr.mark_blocks_as_computed(group_b, token_chunk_size=9)      # b computes the rest itself
    assert all(gpu.block_is_computed(i) for i in a_ids[:3])

    # Freed with nothing computed: nothing is offered.
    mgr2 = SelfAttnBlockSpaceManager(4, 16, 0, watermark=0, enable_caching=True)
    x, _ = _running(mgr2, 0, PROMPT)
    mgr2.free(x)
    y, _ = _running(mgr2, 1, PROMPT)
    assert mgr2.get_num_cached_tokens(y) == 0 and mgr2.get_common_computed_block_ids([y]) == []


def test_marking_a_group_is_cheap_and_exact_for_parallel_samples_and_decodes():
    mgr = SelfAttnBlockSpaceManager(4, 16, 0, watermark=0, enable_caching=True)
    gpu = mgr.block_allocator._allocators[GPU]
    a, group = _running(mgr, 0, PROMPT[:7], n=2)      # two samples share block 0 (full) and block 1
    mgr.mark_blocks_as_computed(group, token_chunk_size=7)
    assert gpu.block_is_computed(mgr.get_block_table(a)[0]) and not gpu._touched_blocks
    for seq in group.seqs:
        seq.data.update_num_computed_tokens(7)
        seq.append_token_id(7 + seq.seq_id)           # block 1 fills up: each sample its own
        mgr.append_slots(seq, 0)
    assert len(gpu._touched_blocks) == 2              # promoted, not computed yet
    mgr.mark_blocks_as_computed(group, token_chunk_size=1)
    assert not gpu._touched_blocks
    assert all(gpu.block_is_computed(i) for seq in group.seqs for i in mgr.get_block_table(seq))


def test_a_swap_keeps_whether_a_block_is_computed():
    mgr = SelfAttnBlockSpaceManager(4, 8, 8, watermark=0, enable_caching=True)
    gpu = mgr.block_allocator._allocators[GPU]
    a, group = _running(mgr, 0, PROMPT)
    mgr.mark_blocks_as_computed(group, token_chunk_size=8)        # blocks 0 and 1 of 3 full ones
    mgr.swap_out(group)
    a.status = SWAPPED
    cpu = mgr.block_allocator._allocators[CPU]
    assert [cpu.block_is_computed(i) for i in mgr.get_block_table(a)[:3]] == [True, True, False]
    mgr.swap_in(group)
    a.status = RUNNING
    assert [gpu.block_is_computed(i) for i in mgr.get_block_table(a)[:3]] == [True, True, False]
    b, _ = _running(mgr, 1, PROMPT)
    assert mgr.get_num_cached_tokens(b) == 8


def test_the_allocator_alone_still_marks_every_new_block_when_given_no_ids():
    a = PrefixCachingBlockAllocator(num_blocks=4, block_size=4)
    blocks = a.allocate_immutable_blocks(None, [[1, 2, 3, 4], [5, 6, 7, 8]])
    a.mark_blocks_as_computed([blocks[1].block_id])   # only that one
    assert [a.block_is_computed(b.block_id) for b in blocks] == [False, True]
    a.mark_blocks_as_computed([])                     # vLLM's call: every block cached so far
    assert [a.block_is_computed(b.block_id) for b in blocks] == [True, True]
    state = lambda: allocator_state(a)
    _refused(state, lambda: a.mark_blocks_as_computed([0, 99]), KeyError)
    _refused(state, lambda: a.mark_blocks_as_computed([0, 3]), ValueError, "free")   # never allocated
    _refused(state, lambda: a.mark_blocks_as_computed("01"), TypeError)
    _refused(state, lambda: a.block_is_computed(None), TypeError)
    _refused(state, lambda: a.block_is_computed(99), KeyError)


# ---- half-done operations ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["naive", "prefix_caching"])
def test_numpy_token_ids_work_and_bad_ones_take_nothing(kind):
    a = CpuGpuBlockAllocator.create(kind, 8, 2, 4)
    table = BlockTable(4, a)
    table.allocate(np.arange(6))                      # took two blocks, then failed, leaking them
    assert table.physical_block_ids == [0, 1] and table.blocks[1].token_ids == [4, 5]
    assert all(type(t) is int for b in table.blocks for t in b.token_ids)
    table.append_token_ids(np.array([6, 7, 8], dtype=np.int64))
    assert table._get_all_token_ids() == list(range(9))
    other = BlockTable(4, a)
    state = lambda: (_device_state(a), _table_state(table), _table_state(other))
    for bad in (np.arange(6.0), np.zeros((2, 3), dtype=np.int64), "abcdef", b"abc", [1, 2.0], [1, None],
                [True, 2], None, 7):
        _refused(state, lambda: other.allocate(bad), TypeError)
        _refused(state, lambda: table.append_token_ids(bad), TypeError)
    other.free()


@pytest.mark.parametrize("kind", ["naive", "prefix_caching"])
def test_a_swap_checks_every_block_before_moving_any(kind):
    a = CpuGpuBlockAllocator.create(kind, 4, 4, 4)
    table = BlockTable(4, a)
    table.allocate([1, 2, 3, 4, 5])
    b, c = table.blocks
    state = lambda: (_device_state(a), _table_state(table))
    _refused(state, lambda: a.swap([b, b], GPU, CPU), ValueError, "more than once")
    _refused(state, lambda: a.swap([b, c], GPU, GPU), ValueError, "between devices")
    _refused(state, lambda: a.swap([b, c], CPU, GPU), ValueError, "not a block of")
    _refused(state, lambda: a.swap([b, None], GPU, CPU), TypeError)
    _refused(state, lambda: a.swap(b, GPU, CPU), TypeError)
    _refused(state, lambda: a.swap([b], "gpu", CPU), TypeError)
    _refused(state, lambda: a._allocators[GPU].swap_out([b, b]), ValueError)
    assert a.swap([b, c], GPU, CPU) == {0: 4, 1: 5}


@pytest.mark.parametrize("make", [
    lambda: NaiveBlockAllocator(create_block=NaiveBlock, num_blocks=4, block_size=4),
    lambda: PrefixCachingBlockAllocator(num_blocks=4, block_size=4),
])
def test_freeing_an_id_where_a_block_is_expected_changes_nothing(make):
    a = make()
    b = a.allocate_immutable_blocks(None, [[1, 2, 3, 4]])[0]
    m = a.allocate_mutable_block(b)
    m.append_token_ids([5])
    state = lambda: (allocator_state(a), b.block_id, m.block_id, list(m.token_ids))
    for bad in (b.block_id, None, "0", [b]):
        _refused(state, lambda: a.free(bad), TypeError)
        _refused(state, lambda: a.fork(bad), TypeError)
        _refused(state, lambda: a.cow_block_if_not_appendable(bad), TypeError)
        _refused(state, lambda: a.swap_out([bad]), TypeError)
        _refused(state, lambda: a.get_num_full_blocks_touched([bad]), TypeError)
        if bad is not None:                           # no previous block is fine
            _refused(state, lambda: a.allocate_mutable_block(bad), TypeError)
            _refused(state, lambda: a.allocate_immutable_block(bad, [1, 2, 3, 4]), TypeError)
    for bad in ("0", None, 1.0, True):
        _refused(state, lambda: a.free_block_id(bad), TypeError)
        _refused(state, lambda: a.get_physical_block_id(bad), TypeError)
    _refused(state, lambda: a.free_block_id(99), KeyError)
    _refused(state, lambda: a.get_physical_block_id(99), KeyError)
    _refused(state, lambda: a.allocate_mutable_block(None, extra_hash="lora"), TypeError)
    _refused(state, lambda: a.allocate_immutable_blocks(None, "abcd"), TypeError)
    _refused(state, lambda: a.allocate_immutable_blocks(None, [[1, 2, 3, 4], "abcd"]), TypeError)
    _refused(state, lambda: a.allocate_immutable_block(None, "abcd"), TypeError)
    _refused(state, lambda: a.get_common_computed_block_ids([[0], None]), TypeError)
    _refused(state, lambda: a.find_cached_blocks_prefix([None]), TypeError)
    a.free(m)
    a.free(b)
    assert a.get_num_free_blocks() == 4


# ---- access times ------------------------------------------------------------------------------------

def test_a_bad_access_time_is_refused_before_it_can_break_a_later_free():
    mgr = SelfAttnBlockSpaceManager(4, 8, 0, watermark=0, enable_caching=True)
    a, group = _running(mgr, 0, list(range(8)))
    a.data.update_num_computed_tokens(8)
    mgr.mark_blocks_as_computed(group, 0)
    gpu = mgr.block_allocator._allocators[GPU]
    ids = list(mgr.get_block_table(a))
    state = lambda: _state(mgr)
    for bad, error in (("soon", TypeError), (None, TypeError), (True, TypeError), (math.nan, ValueError),
                       (math.inf, ValueError), (np.float64("nan"), ValueError)):
        _refused(state, lambda: mgr.access_all_blocks_in_seq(a, bad), error, "now")
        _refused(state, lambda: mgr.block_allocator.mark_blocks_as_accessed(ids, bad), error, "now")
        _refused(state, lambda: gpu.mark_blocks_as_accessed(ids, bad), error, "now")
        _refused(state, lambda: mgr._last_access_blocks_tracker.update_last_access(0, bad), error)
    _refused(state, lambda: gpu.mark_blocks_as_accessed("01", 1.0), TypeError)
    mgr.access_all_blocks_in_seq(a, 3)
    mgr.free(a)                                       # raised inside the evictor's heap, half freed
    assert mgr.get_num_free_gpu_blocks() == 8 and gpu.evictor.num_blocks == 2
    evictor = gpu.evictor
    before = {i: astuple(m) for i, m in evictor.free_table.items()}, list(evictor.priority_queue)
    for bad, error in (("x", TypeError), (math.nan, ValueError)):
        with pytest.raises(error):
            evictor.update(ids[0], bad)
        with pytest.raises(error):
            evictor.add(7, 70, 4, bad)
    assert ({i: astuple(m) for i, m in evictor.free_table.items()}, list(evictor.priority_queue)) == before
    assert isinstance(evictor, LRUEvictor) and evictor.evict()[0] == ids[1]    # the chain's tail first


# ---- wrong types and values at the manager ----------------------------------------------------------

def test_manager_constructor_refuses_bad_arguments():
    for args, kwargs, error in (
            ((0, 8, 4), {"sliding_window": 8}, ValueError),        # was ZeroDivisionError
            ((4, 8, 4), {"watermark": math.inf}, ValueError),      # was OverflowError
            ((4, 8, 4), {"watermark": math.nan}, ValueError),
            ((4, 8, 4), {"watermark": 2.0}, ValueError),
            ((4, 8, 4), {"watermark": 1.0}, ValueError),
            ((4, 8, 4), {"watermark": True}, TypeError),
            ((4, 8, 4), {"watermark": None}, TypeError),
            ((4, 8, 4), {"enable_caching": "no"}, TypeError),
            ((4, 8, 4), {"enable_caching": 1}, TypeError),
            ((4, 8, 4), {"sliding_window": True}, TypeError),
            ((True, 8, 4), {}, TypeError),
            ((4, True, 4), {}, TypeError),
            ((4, 8, False), {}, TypeError),
            ((4.0, 8, 4), {}, TypeError),
            ((4, -1, 4), {}, ValueError),
            ((None, 8, 4), {}, TypeError)):
        with pytest.raises(error):
            SelfAttnBlockSpaceManager(*args, **kwargs)
    mgr = SelfAttnBlockSpaceManager(np.int64(4), 8, 4, watermark=np.float32(0.25), enable_caching=np.bool_(True))
    assert mgr.block_size == 4 and mgr.watermark_blocks == 2 and mgr.enable_caching is True


def test_other_constructors_refuse_bools_and_strs():
    for call in (lambda: CpuGpuBlockAllocator.create("naive", 4, 4, True),
                 lambda: CpuGpuBlockAllocator.create("naive", True, 4, 4),
                 lambda: CpuGpuBlockAllocator.create(None, 4, 4, 4),
                 lambda: CpuGpuBlockAllocator(None, None),
                 lambda: BlockTable(True, CpuGpuBlockAllocator.create("naive", 4, 4, 4)),
                 lambda: BlockTable(4, None),
                 lambda: BlockTable(4, CpuGpuBlockAllocator.create("naive", 4, 4, 4), max_block_sliding_window=2.0),
                 lambda: Sequence(0, [1, 2], True),
                 lambda: Sequence(0, "abc", 4),
                 lambda: Sequence(0, [1, "2"], 4),
                 lambda: Sequence("0", [1, 2], 4),
                 lambda: Sequence(0, [1, 2], 4, lora_int_id=None),
                 lambda: SequenceGroup(7, [Sequence(0, [1], 4)]),
                 lambda: SequenceGroup("r", [None]),
                 lambda: SequenceGroup("r", Sequence(0, [1], 4)),
                 lambda: SequenceGroup("r", [Sequence(0, [1], 4)], arrival_time="now"),
                 lambda: SequenceGroup("r", [Sequence(0, [1], 4)], encoder_seq=[1, 2])):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(ValueError):
        SequenceGroup("r", [Sequence(0, [1], 4), Sequence(0, [2], 4)])
    seq = Sequence(0, np.array([1, 2, 3]), 4)
    assert seq.get_token_ids() == [1, 2, 3] and all(type(t) is int for t in seq.get_token_ids())
    for bad in ("4", 4.0, None, True):
        with pytest.raises(TypeError):
            seq.append_token_id(bad)
        with pytest.raises(TypeError):
            seq.data.update_num_computed_tokens(bad)
    with pytest.raises(TypeError):
        SequenceGroup("r", [seq]).get_seqs("RUNNING")
    assert seq.get_token_ids() == [1, 2, 3] and seq.data.get_num_computed_tokens() == 0


@pytest.mark.parametrize("caching", [False, True])
def test_every_manager_method_refuses_wrong_types_before_changing_anything(caching):
    mgr = SelfAttnBlockSpaceManager(4, 8, 4, watermark=0, enable_caching=caching)
    a, group = _running(mgr, 0, list(range(6)))
    a.data.update_num_computed_tokens(6)
    mgr.mark_blocks_as_computed(group, 0)
    mgr.access_all_blocks_in_seq(a, 1.0)
    waiting = SequenceGroup("w", [Sequence(5, [1, 2, 3], 4)])
    state = lambda: _state(mgr)
    for bad in (None, 0, "r0", [a]):
        for call in (lambda: mgr.can_allocate(bad), lambda: mgr.allocate(bad),
                     lambda: mgr.can_append_slots(bad, 0), lambda: mgr.free_cross(bad),
                     lambda: mgr.get_cross_block_table(bad), lambda: mgr.mark_blocks_as_computed(bad, 1),
                     lambda: mgr.can_swap_in(bad, 0), lambda: mgr.can_swap_out(bad),
                     lambda: mgr.swap_in(bad), lambda: mgr.swap_out(bad)):
            _refused(state, call, TypeError, "seq_group")
        for call in (lambda: mgr.append_slots(bad, 0), lambda: mgr.free(bad), lambda: mgr.get_block_table(bad),
                     lambda: mgr.fork(a, bad), lambda: mgr.fork(bad, a),
                     lambda: mgr.access_all_blocks_in_seq(bad, 1.0), lambda: mgr.get_num_cached_tokens(bad),
                     lambda: mgr.remove_seq_from_computed_blocks_tracker(bad),
                     lambda: mgr.get_common_computed_block_ids([a, bad])):
            _refused(state, call, TypeError, "seq")
    _refused(state, lambda: mgr.get_common_computed_block_ids(a), TypeError)
    for bad, error in ((-1, ValueError), (1.5, TypeError), (None, TypeError), (True, TypeError)):
        _refused(state, lambda: mgr.can_allocate(waiting, bad), error, "num_lookahead_slots")
        _refused(state, lambda: mgr.can_append_slots(group, bad), error, "num_lookahead_slots")
        _refused(state, lambda: mgr.append_slots(a, bad), error, "num_lookahead_slots")
        _refused(state, lambda: mgr.can_swap_in(group, bad), error, "num_lookahead_slots")
        _refused(state, lambda: mgr.mark_blocks_as_computed(group, bad), error, "token_chunk_size")
    for bad in ("bogus", 0, "GPU"):
        _refused(state, lambda: mgr.get_prefix_cache_hit_rate(bad), TypeError, "device")
        _refused(state, lambda: mgr.reset_prefix_cache(bad), TypeError, "device")
    _refused(state, lambda: mgr.get_prefix_cache_hit_rate(None), TypeError, "device")
    _refused(state, lambda: mgr.get_block_table(Sequence(99, [1], 4)), KeyError)


def test_every_allocator_method_refuses_a_bogus_device_before_changing_anything():
    a = CpuGpuBlockAllocator.create("prefix_caching", 4, 4, 4)
    table = BlockTable(4, a)
    table.allocate([1, 2, 3, 4, 5])
    state = lambda: (_device_state(a), _table_state(table))
    for bad in ("bogus", None, 1, "GPU"):
        for call in (lambda: a.allocate_mutable_block(None, bad), lambda: a.allocate_immutable_block(None, [1] * 4, bad),
                     lambda: a.allocate_immutable_blocks(None, [[1] * 4], bad), lambda: a.get_num_free_blocks(bad),
                     lambda: a.get_num_total_blocks(bad), lambda: a.get_physical_block_id(bad, 0),
                     lambda: a.get_num_full_blocks_touched(table.blocks, bad), lambda: a.swap(table.blocks, bad, CPU),
                     lambda: a.swap(table.blocks, GPU, bad), lambda: a.get_prefix_cache_hit_rate(bad),
                     lambda: a.find_cached_blocks_prefix([], bad), lambda: BlockTable(4, a).allocate([1], bad)):
            _refused(state, call, TypeError, "device")
        if bad is not None:
            _refused(state, lambda: a.reset_prefix_cache(bad), TypeError, "device")
    for bad in (None, 0, "b"):
        _refused(state, lambda: a.free(bad), TypeError)
        _refused(state, lambda: a.fork(bad), TypeError)
        if bad is not None:
            _refused(state, lambda: a.allocate_mutable_block(bad, GPU), TypeError)
    _refused(state, lambda: a.get_physical_block_id(GPU, "0"), TypeError)
    _refused(state, lambda: a.get_physical_block_id(GPU, 5), KeyError)


def test_every_block_table_method_refuses_bad_arguments_before_changing_anything():
    a = CpuGpuBlockAllocator.create("naive", 8, 4, 4)
    table = BlockTable(4, a)
    table.allocate([1, 2, 3, 4, 5])
    state = lambda: (_device_state(a), _table_state(table))
    for bad, error in ((-1, ValueError), (1.5, TypeError), (None, TypeError), (True, TypeError)):
        _refused(state, lambda: table.append_token_ids([6], num_lookahead_slots=bad), error)
        _refused(state, lambda: table.ensure_num_empty_slots(bad), error)
        _refused(state, lambda: table.get_num_blocks_touched_by_append_slots([6], bad), error)
        _refused(state, lambda: BlockTable.get_num_required_blocks([6], 4, bad), error)
        _refused(state, lambda: BlockTable.get_num_required_blocks([6], bad), error)
    for bad in (1.5, "4", True):
        _refused(state, lambda: table.append_token_ids([6], num_computed_slots=bad), TypeError)
    for bad in ("ab", None, [None], 3):
        _refused(state, lambda: table.append_token_ids(bad), TypeError)
        if bad != [None]:                             # a list's tail is checked where it is used
            _refused(state, lambda: table.get_unseen_token_ids(bad), TypeError)
        _refused(state, lambda: table.get_num_blocks_touched_by_append_slots(bad, 0), TypeError)
    _refused(state, lambda: table.append_token_ids([6], extra_hash="lora"), TypeError)
    _refused(state, lambda: table.update([None]), TypeError)
    _refused(state, lambda: table.update(None), TypeError)
    _refused(state, lambda: table.allocate([1], device="gpu"), TypeError)
