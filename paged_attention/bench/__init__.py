"""Every benchmark's workloads and timers; ``benchmarks/*.py`` are the command lines.

Read in this order: ``timing`` (the timers all of them share), ``decode`` (decode attention's
bandwidth against a copy, GPU), ``slot_mapping`` (v1's numpy slot mapping against a loop, host),
``v2_tables`` (v2's block-table kernels, vLLM's and ours, and v2's step against v1's, GPU).

The names notebooks call are also here: ``from paged_attention import bench`` then
``bench.decode_table()``, ``bench.kernel_times()``, ``bench.slot_mapping_times(...)``.
"""
from paged_attention.bench.decode import (CALL_SHAPES, CUDA_SHAPES, DECODE_SHAPES, MODEL, DecodeTiming,
                                          cache_write_calls, calls_table, cuda_attention_table, decode_table,
                                          kernel_times, kv_bytes_per_step, sweep, time_decode)
from paged_attention.bench.slot_mapping import (SLOT_MAPPING_BATCH_SWEEP, SLOT_MAPPING_IMPLS,
                                                SLOT_MAPPING_TOKEN_SWEEP, slot_mapping_batch, slot_mapping_times)
from paged_attention.bench.timing import (best_us, copy_bandwidth, cpu_name, graph_time_ms, time_ms,
                                          warm_up)

__all__ = [
    "CALL_SHAPES", "cache_write_calls", "calls_table", "CUDA_SHAPES", "DECODE_SHAPES", "MODEL", "DecodeTiming", "cuda_attention_table", "decode_table", "kernel_times",
    "kv_bytes_per_step", "sweep", "time_decode", "SLOT_MAPPING_BATCH_SWEEP", "SLOT_MAPPING_IMPLS", "SLOT_MAPPING_TOKEN_SWEEP",
    "slot_mapping_batch", "slot_mapping_times", "best_us", "copy_bandwidth", "cpu_name", "graph_time_ms",
    "time_ms", "warm_up",
]
