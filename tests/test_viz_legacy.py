"""paged_attention.viz.legacy: the pure helpers agree with the allocators, the drawings draw."""
import copy

import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from paged_attention.legacy.block_table import BlockTable  # noqa: E402
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator  # noqa: E402
from paged_attention.legacy.evictor import LRUEvictor  # noqa: E402
from paged_attention.legacy.interfaces import BlockAllocator  # noqa: E402
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlock  # noqa: E402
from paged_attention.utils import Device  # noqa: E402
from paged_attention.viz import (  # noqa: E402
    allocation_order, draw_eviction_order, draw_hash_chain, draw_legacy_block_tables, eviction_order,
    physical_blocks, refcounts, short_hash,
)


def texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


def fingerprint(ax: Axes):
    return texts(ax), [(type(p).__name__, p.get_xy() if hasattr(p, "get_xy") else None) for p in ax.patches]


def forked():
    """A: 12 tokens plus a lookahead block; B forked from A and appended one token (copy on write)."""
    allocator = CpuGpuBlockAllocator.create("naive", 8, 2, 4)
    a = BlockTable(4, allocator)
    a.allocate(list(range(10)))
    a.append_token_ids([10, 11])
    a.ensure_num_empty_slots(5)
    b = a.fork()
    b.append_token_ids([99])
    return allocator, {"A": a, "B": b}


def cached(times=(1.0, 2.0)):
    """Prefix caching: A (10 tokens) and B (same 8, then 5 others); A accessed at t0, B at t1."""
    allocator = CpuGpuBlockAllocator.create("prefix_caching", 8, 0, 4)
    a, b = BlockTable(4, allocator), BlockTable(4, allocator)
    a.allocate(list(range(10)))
    b.allocate(list(range(8)) + [50, 51, 52, 53, 54])
    allocator.mark_blocks_as_accessed(list(b.physical_block_ids), times[1])
    allocator.mark_blocks_as_accessed(list(a.physical_block_ids), times[0])
    return allocator, {"A": a, "B": b}


def drain(allocator) -> list[int]:
    """The ids fresh allocations get from a copy of ``allocator``, until none is left."""
    allocator = copy.deepcopy(allocator)
    ids = []
    while True:
        try:
            ids.append(allocator.allocate_mutable_block(None, Device.GPU).block_id)
        except BlockAllocator.NoFreeBlocksError:
            return ids


# --- the pure helpers ---------------------------------------------------------------------------

def test_eviction_order_is_the_order_the_evictor_evicts():
    evictor = LRUEvictor()
    # (id, hash, tokens, time): ties on time broken by more tokens first, then lower id, then hash.
    for entry in [(7, 70, 4, 3.0), (2, 20, 8, 1.0), (5, 50, 4, 1.0), (3, 30, 4, 1.0), (9, 90, 12, 2.0),
                  (1, 10, 12, 3.0)]:
        evictor.add(*entry)
    evictor.update(9, 0.5)              # moved to the front
    order = eviction_order(evictor)
    assert order == [9, 2, 3, 5, 1, 7]
    victims = copy.deepcopy(evictor)
    assert [victims.evict()[0] for _ in range(victims.num_blocks)] == order
    assert evictor.num_blocks == 6      # the original is untouched


def test_eviction_order_on_an_allocator_after_frees():
    allocator, tables = cached()
    for table in tables.values():
        table.free()
    evictor = allocator.allocators[Device.GPU].evictor
    victims = copy.deepcopy(evictor)
    assert eviction_order(evictor) == [victims.evict()[0] for _ in range(victims.num_blocks)]
    assert eviction_order(allocator) == eviction_order(allocator.allocators[Device.GPU]) == eviction_order(evictor)
    # A stamped the shared blocks 0 and 1 last (t = 1), B's own block 3 is at t = 2: 1 (the longer
    # prefix) before 0, then 3.
    assert eviction_order(evictor) == [1, 0, 3]


def test_allocation_order_naive_is_lifo():
    allocator, tables = forked()
    tables["A"].free()
    order = allocation_order(allocator)
    assert order == drain(allocator)
    assert order[0] == 3        # A freed 0, 1, 2 (still held by B), then 3 (A's alone): 3 comes out first


def test_allocation_order_prefix_caching_uses_the_free_list_then_the_evictor():
    allocator, tables = cached()
    tables["B"].free()
    order = allocation_order(allocator)
    assert order == drain(allocator)
    evictor = allocator.allocators[Device.GPU].evictor
    assert order[-evictor.num_blocks:] == eviction_order(evictor) == [3]


def test_physical_blocks_counts_sharing_holders_and_null():
    allocator, tables = forked()
    pool = physical_blocks(tables, allocator)
    assert refcounts(allocator) == [p.refcount for p in pool]
    assert [p.block_id for p in pool] == list(range(8))          # GPU ids only, not the CPU's 8, 9
    assert [p.refcount for p in pool] == [2, 2, 2, 1, 2, 1, 0, 0]
    assert [p.shared for p in pool] == [True, True, True, False, True, False, False, False]
    assert pool[5].holders == [("B", 3)] and pool[3].holders == [("A", 3)]
    assert pool[0].holders == [("A", 0), ("B", 0)]
    assert (pool[3].filled, pool[5].filled, pool[4].filled) == (0, 1, 0)
    assert [p.next_rank for p in pool] == [None] * 6 + [0, 1]

    window = CpuGpuBlockAllocator.create("naive", 16, 0, 4)
    t = BlockTable(4, window, max_block_sliding_window=2)
    t.allocate(list(range(10)))
    for tokens, computed in (([10], 10), ([11, 12], 11), ([13], 16)):
        t.append_token_ids(tokens, num_computed_slots=computed)
    pool = physical_blocks({"s": t}, window)
    assert [p.block_id for p in pool if p.null] == [3]
    assert pool[3].holders == [("s", 0), ("s", 1)] and pool[3].refcount == 1


def test_physical_blocks_marks_evictable():
    allocator, tables = cached()
    tables["B"].free()
    pool = physical_blocks(tables, allocator)
    assert [p.block_id for p in pool if p.evictable] == [3]
    assert allocation_order(allocator) == [4, 5, 6, 7, 3]   # B's partial block 4 went back on the left
    assert pool[3].free and pool[3].next_rank == 4


def test_the_accessors_the_drawings_read_are_read_only():
    allocator, tables = forked()
    with pytest.raises(TypeError):
        allocator.allocators[Device.GPU] = None                  # a read-only view
    gpu = allocator.allocators[Device.GPU]
    free = gpu.free_block_ids
    free.clear()                                                 # a copy: the allocator is unchanged
    assert gpu.free_block_ids == allocation_order(allocator) and gpu.get_num_free_blocks() > 0
    assert gpu.block_size == 4 and allocator.null_block is None
    assert all(table.allocator is allocator for table in tables.values())
    cached_allocator, cached_tables = cached()
    block = cached_tables["A"].blocks[0]
    assert block.allocator is cached_allocator.allocators[Device.GPU] and block.allocator.is_block_cached(block)
    evictor = LRUEvictor()
    evictor.add(7, 70, 4, 2.0)
    evictor.add(3, 30, 4, 1.0)
    assert evictor.eviction_order() == eviction_order(evictor) == [3, 7]


def test_short_hash():
    assert short_hash(0x1234ABCD) == "abcd"
    assert short_hash(-1) == "ffff"
    assert short_hash(0x1234ABCD, digits=6) == "34abcd"
    assert short_hash(None) == "none"
    with pytest.raises(TypeError):
        short_hash("abcd")
    with pytest.raises(ValueError, match="digits"):
        short_hash(5, digits=0)


def test_helpers_reject_bad_input():
    with pytest.raises(TypeError, match="evictor"):
        eviction_order({})
    with pytest.raises(TypeError, match="evictor"):
        eviction_order(forked()[0])                 # a naive allocator has no evictor
    with pytest.raises(TypeError, match="allocator"):
        refcounts([1, 2])
    with pytest.raises(TypeError, match="allocator"):
        allocation_order(object())
    allocator, tables = forked()
    with pytest.raises(TypeError, match="tables"):
        physical_blocks([tables["A"]], allocator)
    with pytest.raises(TypeError, match="BlockTable"):
        physical_blocks({"A": [0, 1]}, allocator)
    with pytest.raises(TypeError, match="allocator"):
        physical_blocks(tables, allocator.allocators[Device.GPU])
    other, _ = forked()
    with pytest.raises(ValueError, match="another allocator"):
        physical_blocks(tables, other)


# --- draw_legacy_block_tables --------------------------------------------------------------------

def test_draw_legacy_block_tables():
    allocator, tables = forked()
    ax = draw_legacy_block_tables(tables, allocator)
    assert isinstance(ax, Axes)
    labels = texts(ax)
    assert "A\n12 tokens" in labels and "B\n13 tokens" in labels
    assert labels.count("rc 2") == 4 and labels.count("rc 1") == 2
    assert "#1" in labels and "#2" in labels
    assert "→ 5" in labels and "→ 3" in labels
    assert "free list, next first: 6, 7" in labels
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == 10                     # one per table entry
    assert "shared (rc > 1)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_draw_legacy_block_tables_null_block_and_evictor():
    window = CpuGpuBlockAllocator.create("naive", 16, 0, 4)
    t = BlockTable(4, window, max_block_sliding_window=2)
    t.allocate(list(range(10)))
    for tokens, computed in (([10], 10), ([11, 12], 11), ([13], 16)):
        t.append_token_ids(tokens, num_computed_slots=computed)
    ax = draw_legacy_block_tables({"seq": t}, window)
    assert texts(ax).count("null") == 3          # two table entries and the pool block
    assert "null block" in [x.get_text() for x in ax.get_legend().get_texts()]

    allocator, tables = cached()
    tables["B"].free()
    ax = draw_legacy_block_tables(tables, allocator, title="mine")
    assert ax.get_title() == "mine"
    assert "(no blocks)" in texts(ax)
    assert any(x.startswith("free list, next first: ") and x.endswith("then evictable: 3") for x in texts(ax))


def test_draw_legacy_block_tables_uses_the_given_axes_and_is_deterministic():
    allocator, tables = forked()
    _, given = plt.subplots()
    assert draw_legacy_block_tables(tables, allocator, ax=given) is given
    again, again_tables = forked()
    assert fingerprint(draw_legacy_block_tables(tables, allocator)) == fingerprint(
        draw_legacy_block_tables(again_tables, again))
    assert not any("0x" in x for x in texts(given))


def test_draw_legacy_block_tables_rejects_bad_input():
    allocator, tables = forked()
    with pytest.raises(TypeError, match="tables"):
        draw_legacy_block_tables(list(tables.values()), allocator)
    with pytest.raises(TypeError, match="allocator"):
        draw_legacy_block_tables(tables, None)
    with pytest.raises(TypeError, match="names"):
        draw_legacy_block_tables({0: tables["A"]}, allocator)


# --- draw_hash_chain -----------------------------------------------------------------------------

def test_draw_hash_chain_shows_each_hash_and_what_is_shared():
    allocator, tables = cached()
    a, b = tables["A"].blocks, tables["B"].blocks
    ax = draw_hash_chain({"A": a, "B": b})
    assert isinstance(ax, Axes)
    labels = texts(ax)
    for block in a[:2] + b[:3]:
        assert f"…{short_hash(block.content_hash)}" in labels
    assert labels.count(f"…{short_hash(a[0].content_hash)}") == 2      # the shared prefix: same hash twice
    assert labels.count("not full: no hash") == 2
    assert "block 0  rc 2" in labels and "block 3  rc 1" in labels
    # Each block's hash covers its tokens and the previous hash.
    assert b[2].content_hash == PrefixCachingBlock.hash_block_tokens(False, b[1].content_hash, b[2].token_ids)
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 4                                             # blocks 0 and 1, in both rows


def test_draw_hash_chain_single_list_and_determinism():
    _, tables = cached()
    ax = draw_hash_chain(tables["A"].blocks)
    assert "start" in texts(ax)
    assert fingerprint(ax) == fingerprint(draw_hash_chain(cached()[1]["A"].blocks))


def test_draw_hash_chain_rejects_bad_input():
    allocator, tables = cached()
    with pytest.raises(TypeError):
        draw_hash_chain(tables["A"])
    with pytest.raises(ValueError):
        draw_hash_chain([])
    with pytest.raises(ValueError, match="does not follow"):
        draw_hash_chain(tables["A"].blocks[1:])
    naive, naive_tables = forked()
    with pytest.raises(TypeError, match="PrefixCachingBlock"):
        draw_hash_chain(naive_tables["A"].blocks)


# --- draw_eviction_order -------------------------------------------------------------------------

def test_draw_eviction_order():
    allocator, tables = cached()
    for table in tables.values():
        table.free()
    order = eviction_order(allocator.allocators[Device.GPU].evictor)
    ax = draw_eviction_order(allocator)
    assert isinstance(ax, Axes)
    names = [x for x in texts(ax) if x.startswith("block ")]
    assert names == [f"block {i}" for i in order]
    assert "evicted first" in texts(ax)
    assert fingerprint(ax) == fingerprint(draw_eviction_order(allocator.allocators[Device.GPU]))


def test_draw_eviction_order_empty_and_bad_input():
    allocator, _ = cached()
    assert "(the evictor is empty)" in texts(draw_eviction_order(allocator))
    naive, _ = forked()
    with pytest.raises(TypeError, match="naive"):
        draw_eviction_order(naive)
    with pytest.raises(TypeError, match="allocator"):
        draw_eviction_order("gpu")


def test_hash_chain_marks_exactly_the_prefix_cache_hits():
    from paged_attention.legacy.block_table import BlockTable
    from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator
    from paged_attention.utils import Device
    from paged_attention.viz import draw_hash_chain

    pc = CpuGpuBlockAllocator.create("prefix_caching", num_gpu_blocks=12, num_cpu_blocks=0, block_size=4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    prompts = {"A": system + [20, 21], "B": system + [30, 31, 32, 33, 34], "C": [9, 9, 9, 9] + system}
    tables = {name: BlockTable(4, pc) for name in prompts}
    for name, table in tables.items():
        table.allocate(prompts[name])
    ax = draw_hash_chain({name: t.blocks for name, t in tables.items()})
    hits = [t for t in ax.texts if t.get_text() == "hit"]
    # B's two system blocks hit; C's do not (another first block changes every later hash).
    lookups = 2 + 3 + 3
    assert len(hits) == round(pc.get_prefix_cache_hit_rate(Device.GPU) * lookups) == 2


def test_crossings_counts_pairs_that_cross():
    from paged_attention.viz.legacy import crossings
    assert crossings([((0, 1), (1, 0)), ((0, 0), (1, 1))]) == 1           # an X
    assert crossings([((0, 1), (0, 0)), ((1, 1), (1, 0))]) == 0           # parallel
    assert crossings([((0, 1), (1, 0)), ((1, 0), (2, 1))]) == 0           # touching at an end
    assert crossings([((0, 1), (3, 0)), ((1, 1), (0, 0)), ((2, 1), (1, 0))]) == 2


def test_tangled_tables_name_the_holders_instead_of_drawing_arrows():
    """A table whose blocks land out of order (allocation after evictions) would draw crossing
    arrows: the holders are named under the pool blocks instead; untangled tables keep arrows."""
    allocator = CpuGpuBlockAllocator.create("naive", 8, 0, 4)
    scattered = BlockTable(4, allocator)
    scattered.allocate(list(range(16)))                  # blocks 0-3
    other = BlockTable(4, allocator)
    other.allocate(list(range(16)))                      # blocks 4-7
    scattered.free()
    late = BlockTable(4, allocator)
    late.allocate(list(range(16)))                       # freed blocks come back in reverse: 3, 2, 1, 0
    tables = {"other": other, "late": late}
    ax = draw_legacy_block_tables(tables, allocator)
    holders = [t.get_text() for t in ax.texts if t.get_gid() == "holders"]
    assert not [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert sorted(holders) == sorted([f"other[{j}]" for j in range(4)] + [f"late[{j}]" for j in range(4)])
    plt.close(ax.figure)
    forced = draw_legacy_block_tables(tables, allocator, arrows=True)
    assert len([t for t in forced.texts if getattr(t, "arrow_patch", None) is not None]) == 8
    plt.close(forced.figure)
    allocator, tables = forked()                         # a fork and one copy: arrows stay
    ax = draw_legacy_block_tables(tables, allocator)
    assert not [t for t in ax.texts if t.get_gid() == "holders"]
    plt.close(ax.figure)
