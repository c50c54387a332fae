"""Property-based stateful tests of the legacy block layer (issue 5).

Hypothesis drives random sequences of allocate / append / ensure-slots / fork / free / swap /
mark-computed on small pools, with tokens drawn from a tiny alphabet so prefixes repeat and the
prefix cache gets hits. A plain model keeps each table's expected tokens. After every step:

* reference counts are >= 0 and equal the number of table blocks holding each id (no leak);
* free + used = total on each device;
* every table holds exactly its model's tokens (copy-on-write isolation);
* two table blocks on the same physical id hold the same tokens (what the KV cache needs);
* every hashed block's hash is the chain hash of its table's tokens, and every cached hash
  points at a block that is held or waiting in the evictor;
* an operation that runs out of blocks leaves every count, table and hit rate as it was.

At teardown everything is freed and everything must be free again, except the null block.
"""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import CpuGpuBlockAllocator, NullBlock
from paged_attention.legacy.interfaces import BlockAllocator
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlock
from paged_attention.utils import Device

GPU, CPU = Device.GPU, Device.CPU
NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 10, 6
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=9)


class _Table:
    """A block table and what the model says it holds."""

    def __init__(self, table: BlockTable, token_ids: list[int], windowed: bool):
        self.table = table
        self.token_ids = list(token_ids)
        self.windowed = windowed
        self.device = GPU


class LegacyBlockLayer(RuleBasedStateMachine):
    allocator_type = "naive"
    steps_checked = 0                  # how many states the invariants saw (the test asserts on it)
    blocks_ran_out = 0                 # how many operations hit NoFreeBlocksError

    @initialize(block_size=st.sampled_from([1, 2, 4]))
    def setup(self, block_size):
        self.block_size = block_size
        self.allocator = CpuGpuBlockAllocator.create(self.allocator_type, NUM_GPU_BLOCKS, NUM_CPU_BLOCKS, block_size)
        self.tables: list[_Table] = []
        self.now = 0.0

    # ---- helpers ------------------------------------------------------------------------------
    def _pick(self, index, device=GPU):
        candidates = [t for t in self.tables if t.device == device]
        return candidates[index % len(candidates)] if candidates else None

    def _snapshot(self):
        a = self.allocator
        state = []
        for device in (GPU, CPU):
            inner = a._allocators[device]
            state.append((a.get_num_free_blocks(device), {i: inner.refcounter.get(i) for i in inner.all_block_ids},
                          a.get_prefix_cache_hit_rate(device), dict(getattr(inner, "_cached_blocks", {}))))
        for t in self.tables:
            state.append((list(t.table.physical_block_ids), [list(b.token_ids) for b in t.table.blocks],
                          t.table.num_full_slots))
        return state

    def _all_or_nothing(self, operation):
        """Run ``operation``; if blocks run out, nothing may have changed. True if it ran."""
        before = self._snapshot()
        try:
            operation()
        except BlockAllocator.NoFreeBlocksError:
            assert self._snapshot() == before
            type(self).blocks_ran_out += 1
            return False
        return True

    # ---- rules --------------------------------------------------------------------------------
    @rule(token_ids=tokens.filter(bool), windowed=st.booleans())
    def allocate(self, token_ids, windowed):
        table = BlockTable(self.block_size, self.allocator, max_block_sliding_window=2 if windowed else None)
        if self._all_or_nothing(lambda: table.allocate(token_ids)):
            self.tables.append(_Table(table, token_ids, windowed))
        else:
            assert table.physical_block_ids == []

    @precondition(lambda self: any(t.device == GPU for t in self.tables))
    @rule(index=st.integers(0, 99), token_ids=tokens, lookahead=st.integers(0, 3))
    def append(self, index, token_ids, lookahead):
        t = self._pick(index)
        if self._all_or_nothing(lambda: t.table.append_token_ids(
                token_ids, num_lookahead_slots=lookahead, num_computed_slots=len(t.token_ids))):
            t.token_ids.extend(token_ids)

    @precondition(lambda self: any(t.device == GPU for t in self.tables))
    @rule(index=st.integers(0, 99), num_slots=st.integers(0, 9))
    def ensure_slots(self, index, num_slots):
        t = self._pick(index)
        self._all_or_nothing(lambda: t.table.ensure_num_empty_slots(num_slots))

    @precondition(lambda self: any(t.device == GPU for t in self.tables))
    @rule(index=st.integers(0, 99))
    def fork(self, index):
        t = self._pick(index)
        self.tables.append(_Table(t.table.fork(), t.token_ids, t.windowed))

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 99))
    def free(self, index):
        t = self.tables.pop(index % len(self.tables))
        if t.device == GPU and self.allocator_type == "prefix_caching":
            self.now += 1
            self.allocator.mark_blocks_as_accessed([b.block_id for b in t.table.blocks
                                                    if not isinstance(b, NullBlock)], self.now)
        t.table.free()

    @precondition(lambda self: any(t.device == GPU and not t.windowed for t in self.tables))
    @rule(index=st.integers(0, 99))
    def swap_out(self, index):
        candidates = [t for t in self.tables if t.device == GPU and not t.windowed]
        t = candidates[index % len(candidates)]
        self._swap(t, GPU, CPU)

    @precondition(lambda self: any(t.device == CPU for t in self.tables))
    @rule(index=st.integers(0, 99))
    def swap_in(self, index):
        self._swap(self._pick(index, CPU), CPU, GPU)

    def _swap(self, t, src, dst):
        blocks = t.table.blocks
        before = [b.block_id for b in blocks]
        moved = {}

        def swap():
            moved.update(self.allocator.swap(blocks, src, dst))
        if self._all_or_nothing(swap):
            t.table.update(blocks)
            t.device = dst
            assert set(moved) <= set(before) and len(moved) == len(set(before))

    @precondition(lambda self: self.allocator_type == "prefix_caching")
    @rule()
    def mark_computed(self):
        self.allocator.mark_blocks_as_computed([])

    @rule()
    def clear_copy_on_writes(self):
        for src, dst in self.allocator.clear_copy_on_writes():
            assert src != dst and dst < NUM_GPU_BLOCKS

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def counts_add_up(self):
        if not hasattr(self, "allocator"):
            return
        type(self).steps_checked += 1
        a = self.allocator
        holders = {i: 0 for i in a.all_block_ids}
        null = a._null_block
        if null is not None:
            holders[null.block_id] += 1          # held by the allocator itself
        for t in self.tables:
            for block in t.table.blocks:
                if not isinstance(block, NullBlock):
                    assert block.block_id in a._allocators[t.device].all_block_ids
                    holders[block.block_id] += 1
        for device in (GPU, CPU):
            inner = a._allocators[device]
            used = 0
            for block_id in inner.all_block_ids:
                count = inner.refcounter.get(block_id)
                assert count >= 0
                assert count == holders[block_id], (device, block_id, count, holders[block_id])
                used += count > 0
            assert a.get_num_free_blocks(device) + used == a.get_num_total_blocks(device)

    @invariant()
    def tables_hold_their_own_tokens(self):
        if not hasattr(self, "allocator"):
            return
        contents = {}
        for t in self.tables:
            table = t.table
            assert table.num_full_slots == len(t.token_ids)
            held = []
            for i, block in enumerate(table.blocks):
                if isinstance(block, NullBlock):
                    assert t.windowed
                    held.extend(t.token_ids[i * self.block_size:(i + 1) * self.block_size])
                    continue
                held.extend(block.token_ids)
                previous = contents.setdefault((t.device, block.block_id), list(block.token_ids))
                assert previous == block.token_ids       # one physical block, one content
            assert held == t.token_ids

    @invariant()
    def cached_hashes_match_their_chains(self):
        if not hasattr(self, "allocator") or self.allocator_type != "prefix_caching":
            return
        for t in self.tables:
            if t.windowed:
                continue
            prev_hash = None
            for i, block in enumerate(t.table.blocks):
                chunk = t.token_ids[i * self.block_size:(i + 1) * self.block_size]
                if len(chunk) < self.block_size:
                    assert block.content_hash is None
                    break
                prev_hash = PrefixCachingBlock.hash_block_tokens(i == 0, prev_hash, chunk)
                assert block.content_hash == prev_hash
                inner = self.allocator._allocators[t.device]
                assert inner._cached_blocks.get(prev_hash) == block.block_id
        for device in (GPU, CPU):
            inner = self.allocator._allocators[device]
            for content_hash, block_id in inner._cached_blocks.items():
                assert (inner.refcounter.get(block_id) > 0) != (block_id in inner.evictor)

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for t in self.tables:
            t.table.free()
        a = self.allocator
        null = 1 if a._null_block is not None else 0
        assert a.get_num_free_blocks(GPU) == NUM_GPU_BLOCKS - null
        assert a.get_num_free_blocks(CPU) == NUM_CPU_BLOCKS


class PrefixCachingBlockLayer(LegacyBlockLayer):
    allocator_type = "prefix_caching"


_settings = settings(max_examples=150, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("machine", [LegacyBlockLayer, PrefixCachingBlockLayer], ids=["naive", "prefix_caching"])
def test_block_layer_state_machine(machine):
    machine.steps_checked = machine.blocks_ran_out = 0
    machine.TestCase.settings = _settings
    machine.TestCase().runTest()
    print(machine.__name__, machine.steps_checked, machine.blocks_ran_out)
    assert machine.steps_checked >= 5000 and machine.blocks_ran_out >= 100, (machine.steps_checked,
                                                                          machine.blocks_ran_out)
