"""Matplotlib drawings shared by the notebooks.

Every function takes an optional ``ax`` (a new figure is made when it is None), returns the
Axes it drew on, never calls ``plt.show()`` and draws the same picture for the same input.
The palette lives in :mod:`paged_attention.viz.style`.
"""
from paged_attention.viz.kernels import (
    OnlineSoftmaxStep, ThreadMapping, draw_decode_bandwidth, draw_decode_times, online_softmax_steps, draw_thread_mapping, draw_v0_key_layout, draw_v2_partitions,
    V1Launch, v0_key_offset, v0_value_offset, v1_launch, v1_thread_mapping, v2_merge_weights, v2_partitions,
)
from paged_attention.legacy.cpu_gpu_block_allocator import allocation_order, eviction_order, refcounts
from paged_attention.viz.legacy import (
    PhysicalBlock, draw_eviction_order, draw_hash_chain, draw_legacy_block_tables, physical_blocks, short_hash,
)
from paged_attention.viz.manager import (
    OwnerRun, draw_pool_over_time, draw_pools_over_time, draw_sharing_savings, event_steps, owner_runs,
    request_color,
)
from paged_attention.viz.kv_cache import (
    KVPage, draw_element_order, draw_raw_to_views, draw_shared_tensors, kv_dim_of, kv_pages,
)
from paged_attention.viz.engine import ENGINE_SYSTEMS, draw_engine_throughput
from paged_attention.viz.memory import draw_waste_breakdown
from paged_attention.viz.overview import GENERATIONS, PIPELINE, draw_pipeline
from paged_attention.viz.source import Listing, source_excerpt
from paged_attention.viz.paging import draw_block_table, draw_slot_mapping, slot_mapping
from paged_attention.viz.style import CATEGORY_COLORS, IMPL_COLORS, SEQ_COLORS, seq_color
from paged_attention.viz.v1 import (
    RowsSnapshot, cell_kinds, draw_dcp_ownership, draw_kernel_blocks, draw_row_history,
    draw_slot_mapping_arrows, draw_slot_mapping_times, request_kinds, snapshot_rows,
)
from paged_attention.viz.v2 import (
    StagedWrite, UvaSnapshot, draw_gather, draw_slot_mapping_grid, draw_staged_writes, draw_uva_counters,
    draw_v2_step_times, snapshot_uva, staged_writes,
)

__all__ = [
    "draw_waste_breakdown", "draw_block_table", "draw_slot_mapping", "slot_mapping",
    "draw_v0_key_layout", "draw_thread_mapping", "draw_v2_partitions", "draw_decode_times", "draw_decode_bandwidth",
    "v0_key_offset", "v0_value_offset", "ThreadMapping", "v1_thread_mapping", "v2_partitions",
    "v2_merge_weights", "V1Launch", "v1_launch", "OnlineSoftmaxStep", "online_softmax_steps", "Listing", "source_excerpt", "GENERATIONS", "PIPELINE", "draw_pipeline",
    "draw_legacy_block_tables", "draw_hash_chain", "draw_eviction_order", "physical_blocks",
    "allocation_order", "eviction_order", "refcounts", "short_hash", "PhysicalBlock",
    "draw_pools_over_time", "draw_pool_over_time", "draw_sharing_savings", "owner_runs", "event_steps",
    "OwnerRun", "request_color",
    "CATEGORY_COLORS", "IMPL_COLORS", "SEQ_COLORS", "seq_color",
    "RowsSnapshot", "snapshot_rows", "cell_kinds", "draw_row_history", "request_kinds",
    "draw_slot_mapping_arrows", "draw_dcp_ownership", "draw_kernel_blocks", "draw_slot_mapping_times",
    "StagedWrite", "staged_writes", "draw_staged_writes", "UvaSnapshot", "snapshot_uva",
    "draw_uva_counters", "draw_gather", "draw_slot_mapping_grid", "draw_v2_step_times",
    "KVPage", "kv_pages", "kv_dim_of", "draw_raw_to_views", "draw_element_order",
    "draw_shared_tensors", "ENGINE_SYSTEMS", "draw_engine_throughput",
]
