"""A snapshot of everything a legacy block allocator holds, for tests that a refused or failed
call changed nothing (compared before and after)."""
from dataclasses import astuple

from paged_attention.legacy.prefix_caching_block import PrefixCachingBlockAllocator


def allocator_state(inner) -> list:
    """Everything one device's allocator holds."""
    state = [inner.get_num_free_blocks(), {i: inner.refcounter.get(i) for i in inner.all_block_ids},
             list(inner._cow_tracker._copy_on_writes), list(inner._block_pool._free_ids)]
    if isinstance(inner, PrefixCachingBlockAllocator):
        state += [list(inner._hashless_allocator._free_block_indices), dict(inner._cached_blocks),
                  {i: astuple(m) for i, m in inner.evictor.free_table.items()}, set(inner._touched_blocks),
                  {i: (t.active, t.last_accessed, t.computed) for i, t in inner._block_tracker.items()},
                  astuple(inner.metric_data)]
    else:
        state.append(list(inner._free_block_indices))
    return state
