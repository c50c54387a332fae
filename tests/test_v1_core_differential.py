"""Our V1 KV-cache manager against vLLM 0.33's own, on seeded random traces.

Each configuration replays a few thousand operations (requests sharing prefixes, chunked
prefills, decodes, finishes, preemptions, prefix-cache resets) on both managers and compares,
after every operation, the answers (hit tokens, blocks) and the whole state: block ids per
request and group, the free count and the free queue in order, reference counts, block hashes
and the cached-block map. Planted bugs (a freed block at the wrong end of the queue, a request
freed head first, a hit not agreed between hybrid groups) must make the comparison fail.
Skipped, with the reason, where vLLM's core files are absent (``tools/vllm_kernels.py
fetch-core``).
"""
import logging

import pytest

from paged_attention.v1.core import kv_cache_coordinator, oracle
from paged_attention.v1.core.block_pool import BlockPool
from paged_attention.v1.core.differential import (
    Mismatch,
    TraceConfig,
    our_side,
    replay,
    vllm_side,
)
from paged_attention.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

OK, WHY = oracle.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"vLLM's core not available: {WHY}")

NUM_OPS = 3000
CONFIGS = [
    TraceConfig("full attention, block 4", [("full", 4)], num_blocks=48),
    TraceConfig("full attention, block 16", [("full", 16)], num_blocks=24, prefix_len=(8, 80),
                suffix_len=(1, 40), chunk=(1, 48)),
    TraceConfig("hybrid full + window 8, block 4", [("full", 4), ("window", 4, 8)],
                num_blocks=64),
    TraceConfig("hybrid full block 8 + window 5 block 4", [("full", 8), ("window", 4, 5)],
                num_blocks=64),
    TraceConfig("hybrid full + two windows", [("full", 4), ("window", 4, 6), ("window", 4, 12)],
                num_blocks=96),
    TraceConfig("sliding window only", [("window", 4, 6)], num_blocks=32),
    TraceConfig("prefix caching off", [("full", 4)], num_blocks=32, enable_caching=False),
]


@pytest.fixture(scope="module")
def o():
    vllm = oracle.load()
    # vLLM logs every refused prefix-cache reset; the traces try many.
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return vllm


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_same_answers_and_state_after_every_operation(o, config):
    assert replay(config, [our_side(config), vllm_side(o, config)], seed=1,
                  num_ops=NUM_OPS) == NUM_OPS


def test_a_second_seed_on_the_hybrid_layouts(o):
    for config in CONFIGS[2:4]:
        replay(config, [our_side(config), vllm_side(o, config)], seed=7, num_ops=NUM_OPS)


# --------------------------------------------------------------------------------------------
# Planted bugs: the comparison must catch each
# --------------------------------------------------------------------------------------------

def _replay_fails(o, config, match):
    with pytest.raises(Mismatch, match=match):
        replay(config, [our_side(config), vllm_side(o, config)], seed=1, num_ops=NUM_OPS)


def test_a_freed_cached_block_at_the_wrong_end_fails(o, monkeypatch):
    original = BlockPool.free_blocks

    def front_for_all(self, ordered_blocks):
        # The bug: cached blocks go to the front too (reused first, their cache lost early).
        blocks = list(ordered_blocks)
        for b in blocks:
            if not b.is_null and b.ref_cnt == 1 and b.block_hash is not None:
                b.ref_cnt = 0
                self.free_block_queue.prepend_n([b])
            else:
                original(self, [b])
    monkeypatch.setattr(BlockPool, "free_blocks", front_for_all)
    _replay_fails(o, CONFIGS[0], "free queue|answered")


def test_a_request_freed_head_first_fails(o, monkeypatch):
    def head_first(self, request_id):
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))
    monkeypatch.setattr(SingleTypeKVCacheManager, "free", head_first)
    _replay_fails(o, CONFIGS[0], "free queue|answered")


def test_a_hit_not_agreed_between_hybrid_groups_fails(o, monkeypatch):
    cls = kv_cache_coordinator.HybridKVCacheCoordinator

    def each_group_its_own_hit(self, block_hashes, max_cache_hit_length):
        # The bug: every group keeps its own longest hit; the shortest is reported.
        blocks, lengths = [], []
        for spec, group_ids, manager_cls, _ in sorted(self.attention_groups,
                                                      key=lambda g: g.group_ids[0]):
            b, n = manager_cls.find_longest_cache_hit(block_hashes, max_cache_hit_length,
                                                      group_ids, self.block_pool, spec, False,
                                                      self.scheduler_block_size)
            blocks.extend(b)
            lengths.append(n)
        return tuple(blocks), min(lengths), 0
    monkeypatch.setattr(cls, "find_longest_cache_hit", each_group_its_own_hit)
    _replay_fails(o, CONFIGS[2], "answered|differs")
