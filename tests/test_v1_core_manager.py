"""The V1 core's managers, coordinators and ``KVCacheManager`` on their own (no vLLM needed)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paged_attention.kv_cache.interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from paged_attention.v1.core import kv_cache_utils as ku
from paged_attention.v1.core.differential import snapshot
from paged_attention.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    default_block_sizes,
)
from paged_attention.v1.core.kv_cache_manager import _NOT_TAKEN, KVCacheBlocks, KVCacheManager
from paged_attention.v1.core.request import Request, RequestStatus

PARAMS = SimpleNamespace(max_tokens=4)


def full(bs=4):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)


def window(w, bs=4):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32,
                             sliding_window=w)


def manager(num_blocks, *specs, **kwargs):
    config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec([f"l{i}"], s)
                                            for i, s in enumerate(specs)])
    sbs, hbs = default_block_sizes(config)
    m = KVCacheManager(config, 256, sbs, hbs, **kwargs)
    m.hasher = ku.get_request_block_hasher(hbs, ku.sha256)
    return m


def admit(m, rid, tokens, chunk=None):
    """Look up the prefix, allocate the (first) chunk, as the scheduler does; the hit."""
    r = Request(rid, tokens, PARAMS, None, block_hasher=m.hasher)
    blocks, hit, boundary = m.get_computed_blocks(r)
    n = len(tokens) - hit if chunk is None else chunk
    assert m.allocate_slots(r, n, hit, blocks) is not None
    r.num_computed_tokens = hit + n
    r.status = RequestStatus.RUNNING
    return r, hit


def test_get_computed_blocks_returns_blocks_hits_and_a_boundary():
    m = manager(16, full())
    admit(m, "a", list(range(12)))
    r = Request("b", list(range(12)), PARAMS, None, block_hasher=m.hasher)
    blocks, hit, boundary = m.get_computed_blocks(r)
    # All 12 tokens are cached, but the last must be computed: the hit stops a block short.
    assert hit == 8 and blocks.get_block_ids() == ([1, 2],) and boundary == 0
    r2 = Request("c", list(range(13)), PARAMS, None, block_hasher=m.hasher)
    assert m.get_computed_blocks(r2)[1] == 12
    assert m.get_computed_blocks(r2, max_cache_hit_length=5)[1] == 4


def test_a_hit_shares_blocks_and_new_tokens_get_new_ones():
    m = manager(10, full())
    a, hit_a = admit(m, "a", list(range(11)))
    b, hit_b = admit(m, "b", list(range(8)) + [50, 51, 52])
    assert (hit_a, hit_b) == (0, 8)
    assert m.get_block_ids("a") == ([1, 2, 3],) and m.get_block_ids("b") == ([1, 2, 4],)
    assert [blk.ref_cnt for blk in m.block_pool.blocks[1:5]] == [2, 2, 1, 1]
    assert m.usage == pytest.approx(4 / 9)


def test_free_gives_blocks_back_tail_first():
    m = manager(10, full())
    a, _ = admit(m, "a", list(range(11)))
    b, _ = admit(m, "b", list(range(8)) + [50, 51, 52])
    m.free(a)
    m.free(b)
    queue = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert queue == [4, 3, 5, 6, 7, 8, 9, 2, 1]
    m.free(b)                                     # freeing again: nothing left, a no-op
    assert m.block_pool.get_num_free_blocks() == 9


def test_chunked_prefill_caches_each_full_block_as_it_is_computed():
    m = manager(16, full())
    r, _ = admit(m, "a", list(range(10)), chunk=6)
    assert m.get_block_ids("a") == ([1, 2],)
    assert m.block_pool.blocks[1].block_hash is not None       # tokens 0-3 computed
    assert m.block_pool.blocks[2].block_hash is None           # 4-5 of 4-7 only
    assert m.allocate_slots(r, 4).get_block_ids() == ([3],)
    r.num_computed_tokens = 10
    assert m.block_pool.blocks[2].block_hash is not None
    r.append_output_token_ids([99, 98])                        # 12 tokens: block 3 full
    assert m.allocate_slots(r, 2).get_block_ids() == ([],)
    assert m.block_pool.blocks[3].block_hash is not None


def test_no_room_returns_none_and_changes_nothing():
    m = manager(6, full())
    admit(m, "a", list(range(12)))
    r = Request("b", list(range(100, 110)), PARAMS, None, block_hasher=m.hasher)
    before = snapshot(m, ["a"])
    blocks, hit, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 10, hit, blocks) is None        # 3 blocks needed, 2 free
    assert m.allocate_slots(r, 4, hit, blocks, full_sequence_must_fit=True) is None
    assert m.allocate_slots(r, 4, hit, blocks, reserved_blocks=2) is None
    assert snapshot(m, ["a", "b"]) == dict(before, **{"block ids": {"a": [[1, 2, 3]],
                                                                    "b": [[]]}})
    assert m.allocate_slots(r, 4, hit, blocks) is not None     # one chunk fits


def _admissions_on_misses(quick, forget_whole_request=False):
    """Requests admitted on prefix misses, as the scheduler admits them (a watermark of one
    block): each allocate_slots answer, the state after, and whether the quick pass answered."""
    m = manager(12, full(), watermark=0.1)
    if not quick:
        m._running_fast_path = False
        m.coordinator._plain_cache_test = False
    real, taken = m._allocate_running_full_attention, []

    def spy(request, n, delay, scheduled, whole=False):
        answer = real(request, n, delay, scheduled, False if forget_whole_request else whole)
        taken.append(answer is not _NOT_TAKEN)
        return answer

    m._allocate_running_full_attention = spy
    admit(m, "a", list(range(10)))                      # 3 blocks taken, 8 free
    answers, requests = [], {}
    # (id, prompt, tokens this step, full_sequence_must_fit, others scheduled)
    for rid, prompt, n, whole, scheduled in [
            ("b", range(100, 130), 4, True, True),      # whole: 8 + watermark > 8 free
            ("b", range(100, 130), 4, False, True),     # this step only: 1 block
            ("c", range(200, 218), 8, True, False),     # 5 blocks, no watermark
            ("d", range(300, 320), 12, True, True),     # 5 + watermark > 5 free
            ("d", range(300, 320), 5, False, False),    # 2 blocks, one full
            ("e", range(400, 420), 16, False, False)]:  # 4 blocks > 3 free
        r = requests.setdefault(rid, Request(rid, list(prompt), PARAMS, None,
                                             block_hasher=m.hasher))
        blocks, hit, _ = m.get_computed_blocks(r)
        assert hit == 0 or forget_whole_request     # (the slip admits "b" early)
        got = m.allocate_slots(r, n, hit, blocks, full_sequence_must_fit=whole,
                               has_scheduled_reqs=scheduled)
        answers.append(None if got is None else got.get_block_ids())
        if got is not None:
            r.num_computed_tokens, r.status = n, RequestStatus.RUNNING
    group = m.coordinator.single_type_managers[0]
    state = snapshot(m, ["a", *requests])
    state.update(cached_counts=dict(group.num_cached_block), holders=sorted(group.req_to_blocks))
    return answers, state, taken


def test_admission_on_a_miss_takes_the_quick_pass_with_the_general_answer():
    # allocate_slots' quick pass serves a request admitted on a prefix miss (the shared empty
    # hit): the whole request is checked first, then the step, with the watermark; the
    # answers and the state are the general path's.
    quick, general = _admissions_on_misses(True), _admissions_on_misses(False)
    assert quick[0] == general[0] == [None, ([4],), ([5, 6],), None, ([7, 8],), None]
    assert quick[1] == general[1]
    assert quick[2] and all(quick[2]) and not any(general[2])
    # A quick pass that forgot the whole-request check would admit "b" at once.
    assert _admissions_on_misses(True, forget_whole_request=True)[0] != general[0]


def test_bad_arguments_are_typed_errors_and_change_nothing():
    m = manager(8, full())
    a, _ = admit(m, "a", list(range(6)))
    before = snapshot(m, ["a"])
    # Each count that is not a plain int >= 0, including look-alikes of the scheduler's usual
    # call (a bool, a float 0 among the rarer counts), is refused by name.
    for kwargs in ({"num_new_tokens": -1}, {"num_new_tokens": 1.5},
                   {"num_new_tokens": True}, {"num_new_tokens": 1, "reserved_blocks": -2},
                   {"num_new_tokens": 1, "num_lookahead_tokens": 0.0},
                   {"num_new_tokens": 1, "num_external_computed_tokens": False},
                   {"num_new_tokens": 1, "num_new_computed_tokens": -4},
                   {"num_new_tokens": 1, "num_new_computed_tokens": False},
                   {"num_new_tokens": 1, "reserved_blocks": 0.0},
                   {"num_new_tokens": 0}):
        with pytest.raises(ValueError):
            m.allocate_slots(a, **kwargs)
    with pytest.raises(ValueError):
        m.allocate_slots(a, 1, new_computed_blocks=KVCacheBlocks(([], [])))   # two groups
    assert snapshot(m, ["a"]) == before
    # A numpy int is a count too (it takes the slower path, checked one by one).
    assert m.allocate_slots(a, np.int64(1), reserved_blocks=np.int32(0)) is not None
    with pytest.raises(TypeError):
        KVCacheManager("config", 64, 4, 4)
    with pytest.raises(ValueError):
        KVCacheManager(m.kv_cache_config, 0, 4, 4)
    with pytest.raises(ValueError):
        KVCacheManager(m.kv_cache_config, 64, 4, 4, watermark=1.5)
    with pytest.raises(ValueError):
        KVCacheManager(m.kv_cache_config, 64, 4, 2)     # one group hashes per block
    with pytest.raises(ValueError):
        KVCacheManager(m.kv_cache_config, 64, 4, 4, use_eagle=True)


def test_coordinator_kind_follows_groups_and_caching():
    assert isinstance(manager(8, full()).coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(manager(8, full(), window(8)).coordinator, HybridKVCacheCoordinator)
    assert isinstance(manager(8, full(), enable_caching=False).coordinator,
                      KVCacheCoordinatorNoPrefixCache)


def test_sliding_window_hits_hold_the_null_block_before_the_window():
    """Full attention and a window of 4, block 4, the same 13-token prompt twice."""
    m = manager(16, full(), window(4))
    admit(m, "a", list(range(13)))
    assert m.get_block_ids("a") == ([1, 2, 3, 4], [5, 6, 7, 8])
    _, hit = admit(m, "b", list(range(13)))
    assert hit == 12
    assert m.get_block_ids("b") == ([1, 2, 3, 9], [0, 0, 7, 10])


def test_sliding_window_gives_back_blocks_behind_the_window():
    m = manager(16, window(4))
    r, _ = admit(m, "a", list(range(8)), chunk=8)
    assert m.get_block_ids("a") == ([1, 2],)
    r.append_output_token_ids([70, 71, 72, 73, 74])
    # 8 computed: token 8 reads tokens 5..8, so block 0 (tokens 0-3) is behind the window.
    assert m.allocate_slots(r, 5).get_block_ids() == ([3, 4],)
    assert m.get_block_ids("a") == ([0, 2, 3, 4],)
    assert m.block_pool.blocks[1].ref_cnt == 0
    m.free(r)
    assert m.block_pool.get_num_free_blocks() == 15


def test_hybrid_groups_agree_on_one_hit_length():
    """The full-attention group has all 3 blocks cached; the window group lost the blocks its
    window needs at 12 tokens, so both settle for 8."""
    m = manager(32, full(), window(8))
    a, _ = admit(m, "a", list(range(13)))
    m.free(a)
    pool = m.block_pool
    # Evict the window group's copy of block 2 (tokens 8-11) only.
    wanted = ku.make_block_hash_with_group_id(a.block_hashes[2], 1)
    pool.evict_blocks({pool.cached_block_hash_to_block.get_one_block(wanted).block_id})
    r = Request("b", list(range(13)), PARAMS, None, block_hasher=m.hasher)
    blocks, hit, boundary = m.get_computed_blocks(r)
    assert hit == 8
    full_ids, window_ids = blocks.get_block_ids()
    assert len(full_ids) == 2 and len(window_ids) == 2 and window_ids[0] != 0
    # Full attention had cached 12 tokens: the shared prefix a window group lags behind.
    assert boundary == 12


def test_hybrid_with_coarser_full_attention_blocks():
    """Full attention with blocks of 8, a window with blocks of 4: hashes every 4 tokens, hits
    on multiples of 8 only, and the prompt's last hash boundary inside a full-attention block
    (20 of a 21-token prompt) is cached as an extra entry of that block."""
    m = manager(32, full(8), window(5, 4))
    assert (m.coordinator.scheduler_block_size, m.block_pool.hash_block_size) == (8, 4)
    a, _ = admit(m, "a", list(range(21)))
    pool = m.block_pool
    # 21 computed: cached up to 16 (the last multiple of 8); the window group keeps only the
    # last block before each boundary of 8 (its window of 5 needs one block of 4).
    assert [b.block_hash_num_tokens for b in pool.blocks[1:4]] == [8, 16, None]
    assert [b.block_hash_num_tokens for b in pool.blocks[4:10]] == [None, 8, None, 16, None,
                                                                     None]
    a.append_output_token_ids([90, 91, 92])
    m.allocate_slots(a, 3)
    a.num_computed_tokens = 24
    assert pool.blocks[3].block_hash_num_tokens == 24
    assert len(pool.cached_block_hashes_by_block[3]) == 1      # and the entry for 20
    _, hit = admit(m, "b", list(range(21)))
    assert hit == 16
    full_ids, window_ids = m.get_block_ids("b")
    # The window group hits only the block before 16 (tokens 12-15); before it: null blocks.
    assert len(full_ids) == 3 and window_ids[:4] == [0, 0, 0, 7] and len(window_ids) == 6


def test_prefix_cache_stats_count_lookups_and_resets():
    m = manager(16, full(), log_stats=True)
    a, _ = admit(m, "a", list(range(12)))
    m.record_prefix_cache_stats(a, 0)
    b, hit = admit(m, "b", list(range(12)))
    m.record_prefix_cache_stats(b, hit)
    b.num_preemptions = 1
    m.record_prefix_cache_stats(b, hit)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert (stats.preempted_requests, stats.preempted_hits) == (1, 8)
    assert m.make_prefix_cache_stats().requests == 0
    assert m.reset_prefix_cache() is False
    m.free(a)
    m.free(b)
    assert m.reset_prefix_cache() is True and m.make_prefix_cache_stats().reset
    assert manager(8, full()).make_prefix_cache_stats() is None


def test_skipping_the_prefix_cache_and_caching_off_never_hit():
    m = manager(16, full())
    admit(m, "a", list(range(12)))
    params = SimpleNamespace(max_tokens=4, skip_reading_prefix_cache=True)
    r = Request("b", list(range(12)), params, None, block_hasher=m.hasher)
    assert m.get_computed_blocks(r)[1] == 0
    off = manager(16, full(), enable_caching=False)
    admit(off, "a", list(range(12)))
    _, hit = admit(off, "b", list(range(12)))
    assert hit == 0 and off.get_block_ids("b") == ([4, 5, 6],)


def _fast_paths_off(side):
    """``side`` with the manager's and coordinator's quick passes forced off: every call takes
    the general path (each group's own cache_blocks, the general allocate_slots)."""
    side.manager._running_fast_path = False
    side.manager.coordinator._plain_cache_test = False
    side.name = "general paths"
    return side


@pytest.mark.parametrize("groups", [[("full", 4)], [("window", 4, 6)]], ids=["full", "window"])
def test_quick_passes_give_what_the_general_paths_give(groups):
    # The running-request fast path of allocate_slots and the coordinator's one-pass caching
    # (which caches a block boundary's blocks from the counts it found) against the general
    # paths, on one random trace, compared after every operation (one group: a hybrid
    # coordinator has its own rule for cacheable tokens and takes the general path).
    from paged_attention.v1.core.differential import Mismatch, TraceConfig, our_side, replay

    config = TraceConfig("quick vs general", groups, num_blocks=48)
    fast = our_side(config)
    assert fast.manager.coordinator._is_plain_cache_test()
    assert replay(config, [fast, _fast_paths_off(our_side(config))], seed=3, num_ops=600) == 600

    # A planted slip in the quick pass (it caches one block too few) is caught.
    fast = our_side(config)
    real = type(fast.manager.coordinator.single_type_managers[0])._cache_new_full_blocks

    def one_short(self, request, num_cached, num_full, *rest):
        if num_full - 1 > num_cached:
            return real(self, request, num_cached, num_full - 1, *rest)
        return real(self, request, num_cached, num_full, *rest)

    for m in fast.manager.coordinator.single_type_managers:
        m._cache_new_full_blocks = one_short.__get__(m)
    with pytest.raises(Mismatch):
        replay(config, [fast, _fast_paths_off(our_side(config))], seed=3, num_ops=600)
