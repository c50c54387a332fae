"""The block pool's one-pass ``free_blocks`` against its block-by-block path
(``_free_blocks_checked``): the same queue, counts and errors, call after call."""
import random
from types import SimpleNamespace

import pytest

from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.kv_cache_utils import make_block_hash_with_group_id


def _state(pool):
    """Everything a free may change: the queue in both directions, its count, every count."""
    q = pool.free_block_queue
    forward = [b.block_id for b in q.get_all_free_blocks()]
    backward, block = [], q.fake_free_list_tail.prev_free_block
    while block is not q.fake_free_list_head:
        backward.append(block.block_id)
        block = block.prev_free_block
    links = [(b.prev_free_block is None, b.next_free_block is None) for b in pool.blocks]
    return forward, backward[::-1], q.num_free_blocks, [b.ref_cnt for b in pool.blocks], links


def _checked(pool, blocks):
    """The block-by-block path on what ``free_blocks`` gives it (the null blocks left out)."""
    pool._free_blocks_checked([b for b in blocks if not b.is_null])


def _twins(seed, caching):
    """Two pools given the same random history: requests holding blocks, some sharing an
    earlier request's first block, some blocks cached, some tables opening with the null
    block."""
    rng = random.Random(seed)
    plan = []
    for r in range(8):
        shared = rng.randrange(r) if r and rng.random() < 0.4 else None
        plan.append((rng.randint(1, 4), shared, [rng.random() < 0.6 for _ in range(5)]))
    pools, tables = [], []
    for _ in range(2):
        pool = BlockPool(40, enable_caching=caching, hash_block_size=4)
        pool_tables = []
        for r, (n, shared, cached) in enumerate(plan):
            blocks = pool.get_new_blocks(n)
            for b, c in zip(blocks, cached):
                if c:
                    b.set_block_hash(make_block_hash_with_group_id(bytes([r, b.block_id]), 0))
            if shared is not None:
                hit = [b for b in pool_tables[shared] if not b.is_null][:1]
                pool.touch(hit)
                blocks = hit + blocks
            if r % 3 == 2:
                blocks = [pool.null_block] + blocks
            pool_tables.append(blocks)
        pools.append(pool)
        tables.append(pool_tables)
    return pools, tables


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_one_pass_free_matches_the_block_by_block_path(seed, caching):
    (fast, slow), (fast_tables, slow_tables) = _twins(seed, caching)
    assert _state(fast) == _state(slow)
    order = list(range(len(fast_tables)))
    random.Random(seed).shuffle(order)
    for i in order:
        fast.free_blocks(reversed(fast_tables[i]))
        _checked(slow, reversed(slow_tables[i]))
        assert _state(fast) == _state(slow)
    assert fast.get_num_free_blocks() == 39      # every block back, the null block aside


def _bad_calls(pool, tables):
    """Calls that must fail, each with its anomaly after blocks the one pass has chained."""
    other = BlockPool(40, enable_caching=True, hash_block_size=4).blocks[5]
    t0, t1 = tables[0], tables[1]
    free_block = pool.free_block_queue.get_all_free_blocks()[0]
    return [
        list(reversed(t1)) + [other],                      # a foreign block last
        list(reversed(t1)) + [t1[-1]],                     # a block freed twice
        list(reversed(t1)) + [free_block],                 # a block with no user
        list(reversed(t1)) + [t1[-1], other],              # both: the foreign block is named
        list(reversed(t0)) + ["not a block"],              # not a block at all
        [other] + ["not a block"],                         # which comes first decides
        list(reversed(t1)) + [SimpleNamespace(is_null=False)],                # no id
        list(reversed(t1)) + [SimpleNamespace(is_null=False, block_id="7")],  # not an int
        list(reversed(t1)) + [SimpleNamespace(is_null=False, block_id="7"), other],
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_bad_free_fails_as_the_block_by_block_path_does(case):
    (fast, slow), (fast_tables, slow_tables) = _twins(3, True)
    fast_call = _bad_calls(fast, fast_tables)[case]
    slow_call = _bad_calls(slow, slow_tables)[case]
    with pytest.raises(Exception) as fast_error:
        fast.free_blocks(iter(fast_call))
    with pytest.raises(Exception) as slow_error:
        _checked(slow, slow_call)
    assert type(fast_error.value) is type(slow_error.value)
    assert str(fast_error.value) == str(slow_error.value)
    assert _state(fast) == _state(slow)


def test_a_queued_block_with_a_user_fails_as_the_block_by_block_path_does():
    """A broken state (a block both queued and used): the block-by-block path counts every
    block down before the queue refuses it, and the one pass leaves the same."""
    (fast, slow), (fast_tables, slow_tables) = _twins(1, True)
    for pool, tables in ((fast, fast_tables), (slow, slow_tables)):
        queued = pool.free_block_queue.get_all_free_blocks()[2]
        queued.ref_cnt = 1
        pool.bad = list(reversed(tables[0])) + [queued]
    with pytest.raises(ValueError, match="already in the free queue"):
        fast.free_blocks(fast.bad)
    with pytest.raises(ValueError, match="already in the free queue"):
        _checked(slow, slow.bad)
    assert _state(fast) == _state(slow)


def test_the_one_pass_does_the_whole_free():
    """The usual call never reaches the block-by-block path (else the pass would be dead code
    and the comparisons above would test one path against itself)."""
    (pool, _), (tables, _) = _twins(0, True)

    def refuse(blocks):
        raise AssertionError("the block-by-block path ran")

    pool._free_blocks_checked = refuse
    for table in tables:
        pool.free_blocks(reversed(table))
    assert pool.get_num_free_blocks() == 39
