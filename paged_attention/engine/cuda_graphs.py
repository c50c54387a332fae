"""Decode steps replayed from CUDA graphs.

A decode step of a 135M-parameter model launches some 400 small kernels; run eagerly, the step
costs what Python and the driver take to launch them, several times what the GPU takes to run
them. A CUDA graph records those launches once and replays them with one call. vLLM and nano-vllm
capture decode steps for a set of batch sizes; so does this class, lazily (a graph is captured
the first time a step needs it).

A graph replays the same kernels on the same addresses, so every input lives in a static buffer
sized for the largest batch, and a step copies its inputs in. A batch of ``n`` requests runs the
graph of the smallest captured size ``bs >= n``; rows ``n .. bs-1`` are padding: slot
``PAD_SLOT_ID`` (their keys and values are not written anywhere), sequence length 1 (they read
one key of block 0), and their logits are dropped. The kernels also size their work by the
batch's ``max_seq_len``, a Python int fixed at capture, so graphs are keyed by the batch size and
by ``max_seq_len`` rounded up to a power of two (at least 256).
"""
from __future__ import annotations

import torch

from paged_attention.model.batch import ForwardBatch
from paged_attention.utils import PAD_SLOT_ID, cdiv, next_power_of_2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """CUDA graphs of the model's decode step, keyed by ``(batch size, max_seq_len bucket)``."""

    def __init__(self, model, kv_caches: list, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        device = model.device
        self.model, self.kv_caches = model, kv_caches
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n, width = max_num_seqs, cdiv(max_model_len, block_size)
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
            self.positions = torch.zeros(n, dtype=torch.int64, device=device)
            self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
            self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=torch.int64, device=device)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def key(self, num_reqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """The graph a batch runs, or None when it is larger than any captured size."""
        if num_reqs > self.batch_sizes[-1]:
            return None
        bs = next(b for b in self.batch_sizes if b >= num_reqs)
        return bs, min(max(256, next_power_of_2(max_seq_len)), self.max_model_len)

    def _batch(self, bs: int, max_seq_len: int) -> ForwardBatch:
        return ForwardBatch(self.query_start_loc[:bs + 1], self.seq_lens[:bs], self.block_tables[:bs],
                            self.slot_mapping[:bs], max_query_len=1, max_seq_len=max_seq_len)

    def _capture(self, key: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        bs, max_seq_len = key
        # Padding values everywhere: the warm-up and the capture write nothing into the caches.
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.seq_lens.fill_(1)
        args = (self.input_ids[:bs], self.positions[:bs], self._batch(bs, max_seq_len), self.kv_caches)
        self.model.forward(*args, check=False)          # compiles Triton kernels, warms the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(*args, check=False)
        torch.cuda.synchronize()
        self.graphs[key] = (graph, logits)
        return graph, logits

    @torch.inference_mode()
    def run(self, key: tuple[int, int], input_ids: torch.Tensor, positions: torch.Tensor,
            batch: ForwardBatch) -> torch.Tensor:
        """The decode step's logits ``[num_reqs, vocab]``, replayed from the graph ``key``."""
        graph, logits = self.graphs.get(key) or self._capture(key)
        bs, n = key[0], batch.num_reqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :batch.block_tables.size(1)].copy_(batch.block_tables)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        if n < bs:
            self.seq_lens[n:bs].fill_(1)
            self.slot_mapping[n:bs].fill_(PAD_SLOT_ID)
        graph.replay()
        return logits[:n]
