"""The legacy block manager (admission, appends, forks, swaps, prefix caching) and the sequences it reads."""
import pytest

from paged_attention.legacy.block_manager import AllocStatus, SelfAttnBlockSpaceManager
from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.sequence import Sequence, SequenceGroup, SequenceStatus
from paged_attention.utils import Device

BS = 4


def _group(request_id, prompts, first_seq_id=0, encoder=None):
    seqs = [Sequence(first_seq_id + i, list(p), BS) for i, p in enumerate(prompts)]
    return SequenceGroup(str(request_id), seqs, encoder_seq=encoder), seqs


def _run(seqs):
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
        seq.data.update_num_computed_tokens(seq.get_len() - seq.data.get_num_computed_tokens())


def _state(mgr):
    a = mgr.block_allocator
    return (mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks(),
            {i: a._allocators[d].refcounter.get(i) for d in (Device.GPU, Device.CPU)
             for i in a._allocators[d].all_block_ids},
            {k: list(t.physical_block_ids) for k, t in mgr.block_tables.items()})


def test_sequence_basics():
    seq = Sequence(7, [1, 2, 3], BS)
    assert seq.status == SequenceStatus.WAITING and seq.is_prefill() and seq.extra_hash() is None
    seq.data.update_num_computed_tokens(3)
    seq.append_token_id(4)
    assert not seq.is_prefill() and seq.get_token_ids() == [1, 2, 3, 4] and seq.get_len() == 4
    assert seq.data.prompt_token_ids == [1, 2, 3] and seq.data.output_token_ids == [4]
    assert Sequence(8, [1], BS, lora_int_id=3).extra_hash() == hash(3)
    with pytest.raises(ValueError):
        seq.data.update_num_computed_tokens(2)           # only 1 token left to compute
    group = SequenceGroup("r", [seq])
    assert group.get_seqs(SequenceStatus.WAITING) == [seq] and not group.is_encoder_decoder()
    with pytest.raises(ValueError):
        SequenceGroup("r", [])


def test_can_allocate_with_the_watermark():
    mgr = SelfAttnBlockSpaceManager(BS, num_gpu_blocks=100, num_cpu_blocks=0, watermark=0.05)   # 5 kept back
    big, _ = _group(0, [range(4 * 96)])                  # 96 blocks: 100 - 96 < 5, never
    assert mgr.can_allocate(big) == AllocStatus.NEVER
    fits, _ = _group(1, [range(4 * 90)])
    assert mgr.can_allocate(fits) == AllocStatus.OK
    mgr.allocate(fits)
    later, _ = _group(2, [range(4 * 6)], first_seq_id=1)  # 10 free - 6 < 5: not now
    assert mgr.can_allocate(later) == AllocStatus.LATER
    assert mgr.can_allocate(later, num_lookahead_slots=0) == AllocStatus.LATER
    small, _ = _group(3, [range(4 * 5)], first_seq_id=2)
    assert mgr.can_allocate(small) == AllocStatus.OK
    with pytest.raises(ValueError):
        SelfAttnBlockSpaceManager(BS, 10, 10, watermark=-0.1)


def test_parallel_samples_share_the_prompt_and_copy_on_write():
    mgr = SelfAttnBlockSpaceManager(BS, 16, 16, watermark=0)
    group, seqs = _group(0, [range(6)] * 3)
    mgr.allocate(group)
    assert [mgr.get_block_table(s) for s in seqs] == [[0, 1]] * 3 and mgr.get_num_free_gpu_blocks() == 14
    _run(seqs)
    for i, seq in enumerate(seqs):
        seq.append_token_id(100 + i)
    assert mgr.can_append_slots(group, num_lookahead_slots=0)
    cows = [mgr.append_slots(seq, num_lookahead_slots=0) for seq in seqs]
    assert cows == [[(1, 2)], [(1, 3)], []]              # the last holder writes in place
    assert [mgr.get_block_table(s) for s in seqs] == [[0, 2], [0, 3], [0, 1]]
    again, _ = _group(1, [range(6)], first_seq_id=2)     # seq id 2 has a table already
    with pytest.raises(ValueError, match="already exists"):
        mgr.allocate(again)
    child = Sequence(9, seqs[0].get_token_ids(), BS)
    mgr.fork(seqs[0], child)
    assert mgr.get_block_table(child) == [0, 2]
    mgr.fork(Sequence(50, [1], BS), Sequence(51, [1], BS))   # a parent with no table: nothing
    assert 51 not in mgr.block_tables
    for seq in seqs + [child]:
        mgr.free(seq)
    mgr.free(child)                                          # freeing again is a no-op
    assert mgr.get_num_free_gpu_blocks() == 16 and mgr.block_tables == {}
    with pytest.raises(KeyError):
        mgr.append_slots(child, 0)


def test_swap_out_and_in_return_device_relative_pairs_and_restore_tokens():
    mgr = SelfAttnBlockSpaceManager(BS, 8, 8, watermark=0)
    group, seqs = _group(0, [range(10)])
    mgr.allocate(group)
    _run(seqs)
    assert mgr.can_swap_out(group)
    before = list(seqs[0].get_token_ids())
    gpu_table = mgr.get_block_table(seqs[0])
    assert mgr.swap_out(group) == [(0, 0), (1, 1), (2, 2)]   # GPU 0-2 -> CPU 0-2 (absolute 8-10)
    assert gpu_table == [0, 1, 2]                            # a table fetched before keeps its ids
    assert mgr.get_block_table(seqs[0]) == [8, 9, 10] and mgr.get_num_free_gpu_blocks() == 8
    with pytest.raises(ValueError, match="not on GPU"):
        mgr.swap_out(group)
    for seq in seqs:
        seq.status = SequenceStatus.SWAPPED
    assert mgr.can_swap_in(group, num_lookahead_slots=0) == AllocStatus.OK
    pairs = mgr.swap_in(group)
    assert [cpu for cpu, _ in pairs] == [0, 1, 2] and len(mgr.get_block_table(seqs[0])) == 3
    assert mgr.block_tables[0]._get_all_token_ids() == before and mgr.get_num_free_cpu_blocks() == 8


def test_a_swap_that_does_not_fit_moves_nothing():
    mgr = SelfAttnBlockSpaceManager(BS, 8, 4, watermark=0)
    group, seqs = _group(0, [range(12), range(12)])
    mgr.allocate(group)
    _run(seqs)
    for i, seq in enumerate(seqs):                       # diverge: 4 + 1 + 1 GPU blocks
        seq.append_token_id(i)
        mgr.append_slots(seq, 0)
    assert not mgr.can_swap_out(group)
    before = _state(mgr)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        mgr.swap_out(group)
    assert _state(mgr) == before


def test_sliding_window_caps_admission_and_keeps_the_null_block():
    mgr = SelfAttnBlockSpaceManager(BS, 8, 0, watermark=0, sliding_window=8)
    assert mgr.max_block_sliding_window == 4
    group, seqs = _group(0, [range(40)])                 # 10 blocks, but only 4 are ever needed
    assert mgr.can_allocate(group) == AllocStatus.OK
    small, (seq,) = _group(1, [range(6)], first_seq_id=5)
    mgr.allocate(small)
    _run([seq])
    for t in range(30):                                  # 36 tokens: 9 blocks of 4
        seq.append_token_id(t)
        mgr.append_slots(seq, 0)
        seq.data.update_num_computed_tokens(1)
    table = mgr.get_block_table(seq)
    # The last append saw 35 computed slots: 8 blocks, 4 beyond the window -> null block in 0-3.
    assert len(table) == 9 and len(set(table[:4])) == 1 and table[0] not in table[4:]
    assert mgr.get_num_free_gpu_blocks() == 8 - 5 - 1
    mgr.free(seq)
    assert mgr.get_num_free_gpu_blocks() == 7            # the null block stays


def test_prefix_caching_counts_cached_tokens_and_common_blocks():
    mgr = SelfAttnBlockSpaceManager(BS, 16, 0, watermark=0, enable_caching=True)
    prompt = list(range(10))
    g1, (s1,) = _group(0, [prompt])
    mgr.allocate(g1)
    assert mgr.get_num_cached_tokens(s1) == 0            # promoted, not yet computed
    mgr.mark_blocks_as_computed(g1, token_chunk_size=10)
    _run([s1])
    g2, (s2,) = _group(1, [prompt + [77]], first_seq_id=1)
    mgr.allocate(g2)
    assert mgr.get_num_cached_tokens(s2) == 8
    assert mgr.get_common_computed_block_ids([s1, s2]) == [0, 1]
    assert mgr.get_prefix_cache_hit_rate(Device.GPU) == 0.5
    mgr.access_all_blocks_in_seq(s1, now=3.0)
    mgr.free(s1)
    assert mgr.block_allocator._allocators[Device.GPU]._block_tracker[2].active is False
    g3, (s3,) = _group(2, [[5, 5, 5]], first_seq_id=2)
    mgr.allocate(g3)
    mgr.free(s3)                                         # never asked about: still fine
    mgr.free(s2)
    assert mgr.get_num_free_gpu_blocks() == 16
    assert mgr.reset_prefix_cache() is True and mgr.get_prefix_cache_hit_rate(Device.GPU) == 0.0


def test_encoder_decoder_groups():
    mgr = SelfAttnBlockSpaceManager(BS, 8, 0, watermark=0)
    encoder = Sequence(100, list(range(5)), BS)
    group, (dec,) = _group("ed", [range(3)], encoder=encoder)
    assert mgr.can_allocate(group) == AllocStatus.OK
    mgr.allocate(group)
    assert mgr.get_block_table(dec) == [0] and mgr.get_cross_block_table(group) == [1, 2]
    mgr.free_cross(group)
    mgr.free_cross(group)
    mgr.free(dec)
    assert mgr.get_num_free_gpu_blocks() == 8
    big_encoder = Sequence(101, list(range(40)), BS)
    group2, _ = _group("ed2", [range(3)], first_seq_id=3, encoder=big_encoder)
    before = _state(mgr)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        mgr.allocate(group2)
    assert _state(mgr) == before and "ed2" not in mgr.cross_block_tables
    for kwargs, match in (({"sliding_window": 8}, "Sliding window"), ({"enable_caching": True}, "Prefix caching")):
        guarded = SelfAttnBlockSpaceManager(BS, 8, 0, **kwargs)
        with pytest.raises(NotImplementedError, match=match):
            guarded.can_allocate(group)
        with pytest.raises(NotImplementedError):
            guarded.allocate(group)
        assert guarded.get_num_free_gpu_blocks() == 8


def test_bad_input_raises_and_changes_nothing():
    mgr = SelfAttnBlockSpaceManager(BS, 8, 4, watermark=0)
    group, (seq,) = _group(0, [range(6)])
    mgr.allocate(group)
    before = _state(mgr)

    # Allocating a group twice: its sequences still waiting (tables exist), or already running.
    with pytest.raises(ValueError, match="already exists"):
        mgr.allocate(group)
    _run([seq])
    with pytest.raises(ValueError, match="no waiting sequence"):
        mgr.allocate(group)
    with pytest.raises(ValueError, match="no waiting sequence"):
        mgr.can_allocate(group)
    # Appending to, or asking about, a sequence that has no table.
    stranger_group, (stranger,) = _group(1, [range(3)], first_seq_id=7)
    _run([stranger])
    with pytest.raises(KeyError, match="no block table"):
        mgr.append_slots(stranger, 0)
    with pytest.raises(KeyError, match="no block table"):
        mgr.can_append_slots(stranger_group, 0)
    with pytest.raises(KeyError):
        mgr.get_block_table(stranger)
    # Swapping in what was never swapped out (its blocks are on the GPU).
    seq.status = SequenceStatus.SWAPPED
    with pytest.raises(ValueError, match="not on CPU"):
        mgr.swap_in(group)
    seq.status = SequenceStatus.RUNNING
    # Forking onto a sequence that already has a table.
    with pytest.raises(ValueError, match="already has a block table"):
        mgr.fork(seq, seq)
    # Negative lookahead slots.
    with pytest.raises(ValueError, match="num_lookahead_slots"):
        mgr.can_append_slots(group, -1)
    with pytest.raises(ValueError, match="num_lookahead_slots"):
        mgr.append_slots(seq, -1)
    assert _state(mgr) == before

    # A scheduler that skips can_allocate: the table is made whole or not at all.
    big, (huge,) = _group(2, [range(40)], first_seq_id=20)
    with pytest.raises(BlockAllocator.NoFreeBlocksError):
        mgr.allocate(big)
    assert _state(mgr) == before and 20 not in mgr.block_tables

    for kwargs, error in (({"watermark": -0.01}, ValueError), ({"watermark": "1%"}, TypeError),
                          ({"sliding_window": 0}, ValueError), ({"sliding_window": 2.5}, TypeError)):
        with pytest.raises(error, match=next(iter(kwargs))):
            SelfAttnBlockSpaceManager(BS, 8, 4, **kwargs)
