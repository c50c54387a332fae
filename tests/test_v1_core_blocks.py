"""The V1 core's blocks, free queue, block hashes and block pool, on their own (no vLLM needed)."""
import pickle
from hashlib import sha256 as hashlib_sha256
from types import SimpleNamespace

import pytest

from paged_attention.v1.core import kv_cache_utils as ku
from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    make_block_hash_with_group_id,
)
from paged_attention.v1.core.request import Request

PARAMS = SimpleNamespace(max_tokens=4)


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_of(n):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


# --------------------------------------------------------------------------------------------
# The free queue
# --------------------------------------------------------------------------------------------

def test_queue_starts_in_id_order_and_pops_from_the_front():
    blocks, q = queue_of(5)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    assert ids(q.get_all_free_blocks()) == [3, 4] and q.num_free_blocks == 2
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None


def test_queue_removes_from_the_middle_and_puts_back_at_either_end():
    blocks, q = queue_of(6)
    q.remove(blocks[3])
    q.remove(blocks[1])
    assert ids(q.get_all_free_blocks()) == [0, 2, 4, 5]
    q.append(blocks[3])
    q.prepend_n([blocks[1]])
    assert ids(q.get_all_free_blocks()) == [1, 0, 2, 4, 5, 3]
    taken = q.popleft_n(6)
    q.append_n(taken[:3])
    q.prepend_n(taken[3:])
    assert ids(q.get_all_free_blocks()) == [4, 5, 3, 1, 0, 2] and q.num_free_blocks == 6


def test_queue_refuses_bad_moves_and_stays_as_it_was():
    blocks, q = queue_of(3)
    q.remove(blocks[1])
    before = ids(q.get_all_free_blocks())
    with pytest.raises(ValueError):
        q.remove(blocks[1])                      # not in the queue
    with pytest.raises(ValueError):
        q.append(blocks[0])                      # already in it
    with pytest.raises(ValueError):
        q.popleft_n(3)                           # only 2 free
    assert ids(q.get_all_free_blocks()) == before and q.num_free_blocks == 2
    q.popleft_n(2)
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()


def _links(blocks):
    return [(b.prev_free_block, b.next_free_block) for b in blocks]


@pytest.mark.parametrize("insert", ["append_n", "prepend_n"])
def test_a_bad_insert_unlinks_what_it_linked_and_names_the_first_queued_block(insert):
    # Insertion checks and links in one pass: a queued block found after others were linked
    # must leave every link (the sentinels' too) as it was, and name the first queued block.
    blocks, q = queue_of(8)
    taken = q.popleft_n(5)                       # 0..4 out, 5..7 queued
    everything = blocks + [q.fake_free_list_head, q.fake_free_list_tail]
    before = _links(everything)
    cases = [
        ([taken[0], taken[1], blocks[6], taken[2], blocks[5]], "block 6 is already"),
        ([blocks[7]], "block 7 is already"),
        ([taken[0], taken[0], taken[1], blocks[5]], "block 5 is already"),
        ([taken[3], taken[4], taken[3]], "block 3 is given twice"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            getattr(q, insert)(bad)
        assert _links(everything) == before and q.num_free_blocks == 3
    getattr(q, insert)(taken[::-1])
    expected = [4, 3, 2, 1, 0, 5, 6, 7] if insert == "prepend_n" else [5, 6, 7, 4, 3, 2, 1, 0]
    assert ids(q.get_all_free_blocks()) == expected and q.num_free_blocks == 8


# --------------------------------------------------------------------------------------------
# Block hashes
# --------------------------------------------------------------------------------------------

def _sha(x):
    return hashlib_sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_hashes_chain_from_the_fixed_none_hash(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    ku.init_none_hash(ku.sha256)
    assert ku.NONE_HASH == _sha("vllm-none-hash")
    request = Request("a", list(range(10)), PARAMS, None,
                      block_hasher=get_request_block_hasher(4, ku.sha256))
    h0 = _sha((ku.NONE_HASH, (0, 1, 2, 3), None))
    h1 = _sha((h0, (4, 5, 6, 7), None))
    assert request.block_hashes == [h0, h1]           # tokens 8, 9: not a full block
    request.append_output_token_ids([10, 11])
    assert request.block_hashes[2] == _sha((h1, (8, 9, 10, 11), None))


def test_any_hash_function_chains_the_same_way():
    """The hasher calls sha256 written out, and any other function as given: both chain the
    same triples (large token ids too, which pickle writes in other opcodes)."""
    tokens = [0, 255, 256, 70000, 2**31, 2**40, 7, 8]
    salted = dict(cache_salt="s")
    plain = Request("a", tokens, PARAMS, None, **salted, block_hasher=get_request_block_hasher(4, ku.sha256))
    h0 = _sha((ku.NONE_HASH, tuple(tokens[:4]), (("cache_salt", "s"),)))
    assert plain.block_hashes == [h0, _sha((h0, tuple(tokens[4:]), None))]
    seen = []

    def other(triple):
        seen.append(triple)
        return repr(triple).encode()

    mine = Request("b", tokens, PARAMS, None, **salted, block_hasher=get_request_block_hasher(4, other))
    assert seen == [(ku.NONE_HASH, tuple(tokens[:4]), (("cache_salt", "s"),)),
                    (repr(seen[0]).encode(), tuple(tokens[4:]), None)]
    assert mine.block_hashes == [repr(t).encode() for t in seen]
    # A block filled by one appended token at a time takes the hasher's one-block pass: the
    # same triple, with either function.
    for token in (9, 10, 11, 12):
        plain.append_output_token_ids(token)
        mine.append_output_token_ids(token)
    assert seen[2] == (mine.block_hashes[1], (9, 10, 11, 12), None)
    assert mine.block_hashes[2] == repr(seen[2]).encode()
    assert plain.block_hashes[2] == _sha((plain.block_hashes[1], (9, 10, 11, 12), None))


def test_the_hasher_reads_any_request_through_its_public_view():
    # Not our Request (a stand-in with the attributes vLLM's has): the same hashes, read
    # through num_tokens and all_token_ids.
    hasher = get_request_block_hasher(4, ku.sha256)
    tokens = list(range(50, 65))
    ours = Request("a", tokens, PARAMS, None, block_hasher=hasher)
    other = SimpleNamespace(block_hashes=[], num_tokens=len(tokens), all_token_ids=tuple(tokens),
                            lora_request=None, cache_salt=None)
    other.block_hashes.extend(hasher(other))
    assert other.block_hashes == ours.block_hashes and len(ours.block_hashes) == 3
    other.all_token_ids += (65,)
    other.num_tokens += 1
    ours.append_output_token_ids(65)
    assert hasher(other) == ours.block_hashes[3:] and len(ours.block_hashes) == 4


def test_extra_keys_separate_salts_and_adapters():
    hasher = get_request_block_hasher(4, ku.sha256)
    plain = Request("a", list(range(8)), PARAMS, None, block_hasher=hasher)
    again = Request("b", list(range(8)), PARAMS, None, block_hasher=hasher)
    salted = Request("c", list(range(8)), PARAMS, None, cache_salt="s", block_hasher=hasher)
    lora = Request("d", list(range(8)), PARAMS, None, block_hasher=hasher,
                   lora_request=SimpleNamespace(lora_name="x", lora_path="/x"))
    assert plain.block_hashes == again.block_hashes
    # The salt enters the first block only, and every later hash through the chain.
    assert salted.block_hashes[0] == _sha((ku.NONE_HASH, (0, 1, 2, 3), (("cache_salt", "s"),)))
    assert salted.block_hashes[1] == _sha((salted.block_hashes[0], (4, 5, 6, 7), None))
    assert lora.block_hashes[1] == _sha((lora.block_hashes[0], (4, 5, 6, 7),
                                         (("lora", "x", "/x"),)))
    assert len({plain.block_hashes[1], salted.block_hashes[1], lora.block_hashes[1]}) == 3


def test_a_block_is_hashed_by_the_token_that_fills_it():
    """Appending one token at a time, a block's hash appears with its last token, not later
    (the request calls the hasher only when a block may have filled)."""
    r = Request("a", [1, 2, 3], PARAMS, None, block_hasher=get_request_block_hasher(4, ku.sha256))
    for token in range(4, 14):
        r.append_output_token_ids(token)
        assert len(r.block_hashes) == r.num_tokens // 4, r.num_tokens
    none = Request("b", [1, 2, 3, 4], PARAMS, None)
    none.append_output_token_ids(5)
    assert none.block_hashes == []


@pytest.mark.parametrize("first", [1, 3, 4, 9])
def test_hashes_do_not_depend_on_how_the_tokens_arrive(first):
    """A salted LoRA request's hashes, its tokens given at once or in pieces of any size, are
    the same (the hasher reads the extra keys once per call, the salt's for block 0 only)."""
    hasher = get_request_block_hasher(4, ku.sha256)
    extra = dict(cache_salt="s", lora_request=SimpleNamespace(lora_name="x", lora_path="/x"),
                 block_hasher=hasher)
    tokens = list(range(100, 123))
    whole = Request("a", tokens, PARAMS, None, **extra)
    pieces = Request("b", tokens[:first], PARAMS, None, **extra)
    rest = tokens[first:]
    while rest:
        step, rest = rest[:len(rest) % 5 + 1], rest[len(rest) % 5 + 1:]
        pieces.append_output_token_ids(step if len(step) > 1 else step[0])
    assert len(whole.block_hashes) == 5 and pieces.block_hashes == whole.block_hashes
    parent = ku.NONE_HASH
    for i, h in enumerate(whole.block_hashes):
        keys = (("lora", "x", "/x"),) + ((("cache_salt", "s"),) if i == 0 else ())
        parent = _sha((parent, tuple(tokens[4 * i:4 * i + 4]), keys))
        assert h == parent


def test_pythonhashseed_changes_the_none_hash(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    ku.init_none_hash(ku.sha256)
    try:
        assert ku.NONE_HASH == _sha("7")
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        ku.init_none_hash(ku.sha256)
    assert ku.NONE_HASH == _sha("vllm-none-hash")


def test_coarser_blocks_read_every_kth_hash():
    view = BlockHashListWithBlockSize([b"A", b"B", b"C", b"D", b"E"], 16, 32)
    assert len(view) == 2 and list(view) == [b"B", b"D"] and view[1] == b"D" and view[-1] == b"D"
    assert view[0:2] == [b"B", b"D"]
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(ValueError):
        BlockHashListWithBlockSize([], 16, 24)


def test_group_id_is_packed_after_the_hash():
    key = make_block_hash_with_group_id(b"abc", 258)
    assert key == b"abc\x00\x00\x01\x02"
    assert ku.get_block_hash(key) == b"abc" and ku.get_group_id(key) == 258


def test_hasher_and_request_refuse_bad_input():
    with pytest.raises(ValueError):
        get_request_block_hasher(0, ku.sha256)
    with pytest.raises(TypeError):
        get_request_block_hasher(4, "sha256")
    with pytest.raises(TypeError):
        Request("a", [1, "2"], PARAMS, None)
    with pytest.raises(ValueError):
        Request("a", [], PARAMS, None)
    with pytest.raises(ValueError):
        Request("a", [1], SimpleNamespace(), None)
    with pytest.raises(TypeError):
        Request(1, [1], PARAMS, None)
    r = Request("a", [1, 2, 3, 4], PARAMS, None,
                block_hasher=get_request_block_hasher(4, ku.sha256))
    with pytest.raises(TypeError):
        r.append_output_token_ids(["x"])
    assert r.num_tokens == 4 and len(r.block_hashes) == 1


# --------------------------------------------------------------------------------------------
# The block pool
# --------------------------------------------------------------------------------------------

def _request(rid, tokens, block_size=4):
    return Request(rid, tokens, PARAMS, None,
                   block_hasher=get_request_block_hasher(block_size, ku.sha256))


def _pool_state(pool):
    return (ids(pool.free_block_queue.get_all_free_blocks()), [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], dict(pool.cached_block_hash_to_block._cache))


def test_block_zero_is_the_null_block_and_never_handed_out():
    pool = BlockPool(5, enable_caching=True, hash_block_size=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4] and pool.get_usage() == 1.0
    pool.free_blocks([pool.null_block])                  # ignored, as in vLLM
    assert pool.get_num_free_blocks() == 0


def test_freed_blocks_return_in_eviction_order():
    """Two 11-token prompts sharing 8 tokens (block 4): tables [1, 2, 3] and [1, 2, 4]. Freed
    tail first, the never-full blocks 3 and 4 go to the front, the cached 2 and 1 to the back,
    the shared head (1) last of all."""
    pool = BlockPool(10, enable_caching=True, hash_block_size=4)
    a = _request("a", list(range(11)))
    b = _request("b", list(range(8)) + [50, 51, 52])
    blocks_a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, blocks_a, 0, 2, 4, 0)
    hit = [pool.get_cached_block(h, [0])[0] for h in b.block_hashes[:2]]
    assert ids(hit) == [1, 2]
    pool.touch(hit)
    blocks_b = hit + pool.get_new_blocks(1)
    assert ids(blocks_b) == [1, 2, 4]
    pool.free_blocks(reversed(blocks_a))
    pool.free_blocks(reversed(blocks_b))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 8, 9, 2, 1]


def test_reusing_a_cached_block_evicts_it():
    pool = BlockPool(3, enable_caching=True, hash_block_size=4)
    r = _request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, 4, 0)
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(r.block_hashes[0], [0]) is not None   # free, still cached
    assert ids(pool.get_new_blocks(1)) == [2]            # the tail is evicted first
    assert pool.get_cached_block(r.block_hashes[1], [0]) is None
    assert pool.blocks[2].block_hash is None
    assert pool.get_cached_block(r.block_hashes[0], [0])[0].block_id == 1


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(4, enable_caching=True, hash_block_size=4)
    r = _request("a", list(range(4)))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(r, [block], 0, 1, 4, 0)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    pool.touch([block, block])
    assert block.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3]


def test_bad_calls_change_nothing():
    pool = BlockPool(6, enable_caching=True, hash_block_size=4)
    r = _request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, blocks, 0, 2, 4, 0)
    before = _pool_state(pool)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)                            # 3 free
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    with pytest.raises(ValueError, match=r"blocks \[1\] would"):
        pool.free_blocks([blocks[1], blocks[0], blocks[0]])   # block 1 used once, freed twice
    with pytest.raises(ValueError):
        pool.free_blocks([blocks[1], pool.blocks[5]])     # the second is free already
    other = BlockPool(6, enable_caching=True, hash_block_size=4).blocks[3]
    with pytest.raises(ValueError, match="block 3 does not belong"):
        pool.free_blocks([blocks[1], other])              # not this pool's
    with pytest.raises(ValueError, match="block 3 does not belong"):
        # Over-freed before the foreign block is reached: the foreign block is still named.
        pool.free_blocks([blocks[1], blocks[1], other])
    with pytest.raises(ValueError):
        pool.touch([other])
    with pytest.raises(ValueError):
        pool.cache_full_blocks(r, blocks, 0, 3, 4, 0)     # no hash for a third block
    with pytest.raises(KeyError):
        pool.evict_blocks({99})
    assert _pool_state(pool) == before
    with pytest.raises(ValueError):
        BlockPool(0, True, 4)
    with pytest.raises(ValueError):
        BlockPool(4, True, 4, enable_kv_cache_events=True)


def test_reset_is_refused_while_blocks_are_used():
    pool = BlockPool(4, enable_caching=True, hash_block_size=4)
    r = _request("a", list(range(4)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(r, blocks, 0, 1, 4, 0)
    before = _pool_state(pool)
    assert pool.reset_prefix_cache() is False and _pool_state(pool) == before
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0 and blocks[0].block_hash is None
    # The freed block stays where it was in the queue; only its hash is gone.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [2, 3, 1]


def test_caching_off_puts_every_freed_block_at_the_front():
    pool = BlockPool(5, enable_caching=False, hash_block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4]

