"""vLLM's model runner v2 block tables: the tables live on the GPU and Triton kernels build
everything the attention kernels read from them.

v1 (``paged_attention.v1``) keeps a batch-ordered table on the CPU, edits it with numpy and
copies the rows in use to the GPU every step. v2 turns this around:

* the persistent tables are on the GPU, one row per *request state* (a slot a request keeps
  for its whole life, whatever its place in the batch);
* the CPU only *stages* the few ids that changed this step; one kernel scatters them into the
  device tables (``StagedWriteTensor``);
* the per-request block counts are read by kernels straight from pinned host memory
  (``UvaBackedTensor``, unified virtual addressing: no copy);
* each step a kernel gathers the rows of the scheduled requests, in batch order, into the
  tables attention reads (``gather_block_tables``), and another computes every token's slot,
  for every KV-cache group in one launch (``compute_slot_mappings``).

Read in this order: ``buffers`` (the two host/device buffers), ``block_table`` (``BlockTables``
with kernels shaped like vLLM's), then ``block_table_fast`` (``FastBlockTables``: our faster
kernels, what ``BlockTables(...)`` makes by default).
"""
import paged_attention.runtime  # noqa: F401  (sets TRITON_INTERPRET before the kernels below)
from paged_attention.v2.block_table import IMPLS, BlockTables, SlotProgram, vllm_slot_programs
from paged_attention.v2.block_table_fast import FastBlockTables, fast_slot_programs
from paged_attention.v2.buffers import (StagedWriteTensor, UnsupportedDtypeError, UvaBackedTensor,
                                        UvaBuffer, UvaBufferPool, async_copy_to_gpu)

__all__ = [
    "BlockTables", "FastBlockTables", "IMPLS", "SlotProgram", "StagedWriteTensor", "UnsupportedDtypeError",
    "UvaBackedTensor", "UvaBuffer", "UvaBufferPool", "async_copy_to_gpu", "fast_slot_programs",
    "vllm_slot_programs",
]
