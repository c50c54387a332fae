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
with kernels shaped like vLLM's), then ``block_table_fast`` (``FastBlockTables``: the same tables
with our faster kernels); ``common`` holds the little both kernel sets share.
``make_block_tables(..., impl=)`` builds either by name.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

import paged_attention.runtime  # noqa: F401  (sets TRITON_INTERPRET before the kernels below)
from paged_attention.v2.block_table import BlockTables, gather_kinds, vllm_slot_programs
from paged_attention.v2.block_table_fast import FastBlockTables, fast_slot_programs
from paged_attention.v2.buffers import (StagedWrite, StagedWriteTensor, UnsupportedDtypeError, UvaBackedTensor,
                                        UvaBuffer, UvaBufferPool, apply_writes, async_copy_to_gpu)
from paged_attention.v2.common import SlotProgram

IMPLS = ("triton", "vllm")
"""The kernel sets, by name: ours (``"triton"``, ``FastBlockTables``) and those shaped like vLLM's
(``"vllm"``, ``BlockTables``)."""

_CLASSES = {"triton": FastBlockTables, "vllm": BlockTables}


def make_block_tables(block_sizes: Sequence[int], max_num_reqs: int, max_num_batched_tokens: int,
                      max_model_len: int, device: Union[torch.device, str], *,
                      impl: str = "triton") -> BlockTables:
    """``FastBlockTables(...)`` for ``impl="triton"``, ``BlockTables(...)`` for ``impl="vllm"``: the
    choice of kernels by name (a benchmark or an engine option); both give the same results."""
    if not isinstance(impl, str) or impl not in _CLASSES:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return _CLASSES[impl](block_sizes, max_num_reqs, max_num_batched_tokens, max_model_len, device)


__all__ = [
    "BlockTables", "FastBlockTables", "IMPLS", "SlotProgram", "StagedWrite", "StagedWriteTensor",
    "UnsupportedDtypeError", "UvaBackedTensor", "UvaBuffer", "UvaBufferPool", "apply_writes", "async_copy_to_gpu",
    "fast_slot_programs", "gather_kinds", "make_block_tables", "vllm_slot_programs",
]
