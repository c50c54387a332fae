"""vLLM's V1 worker block table: the persistent, batch-ordered table the model runner
keeps on the CPU and copies to the GPU each step, and the slot mapping computed from it.

Read in this order: ``cpu_gpu_buffer`` (a tensor kept twice, on the host and on the device,
with a numpy view of the host copy), then ``block_table`` (``BlockTable`` for one KV-cache
group, ``MultiGroupBlockTable`` for all of them).
"""
from paged_attention.v1.block_table import BlockTable, MultiGroupBlockTable
from paged_attention.v1.cpu_gpu_buffer import CpuGpuBuffer

__all__ = ["BlockTable", "CpuGpuBuffer", "MultiGroupBlockTable"]
