"""Decode context parallelism across real ranks, through ``torch.distributed``.

Read in this order: ``dcp`` (each rank attends over its share of the KV cache; the partials are
all-gathered and merged with their log-sum-exps; ``DcpDecodePlan`` does the three moves per
layer with buffers made once), ``workload`` (a whole DCP decode step on one rank: its v1 table,
its share written through the DCP slot mapping, the decode; and the dense oracle), ``spawn`` (a
group of processes on one machine: gloo on the CPU, nccl on GPUs).

This package sits beside ``model``: it uses ``v1``'s table and the kernels, and nothing below
the engine imports it.
"""
from paged_attention.distributed.dcp import (
    IMPLS, DcpDecodePlan, PartialsExchange, all_gather_partials, dcp_decode_attention,
    get_dcp_local_seq_lens, merge_rank_partials, partial_decode_attention,
)
from paged_attention.distributed.spawn import default_backend, free_port, spawn
from paged_attention.distributed.workload import (
    DcpDecodeProblem, RankCache, RankResult, dcp_merge_weights, run_dcp_rank, write_rank_cache,
)

__all__ = [
    "IMPLS", "DcpDecodePlan", "PartialsExchange", "all_gather_partials", "dcp_decode_attention",
    "get_dcp_local_seq_lens", "merge_rank_partials", "partial_decode_attention",
    "default_backend", "free_port", "spawn", "DcpDecodeProblem", "RankCache", "RankResult",
    "dcp_merge_weights", "run_dcp_rank", "write_rank_cache",
]
