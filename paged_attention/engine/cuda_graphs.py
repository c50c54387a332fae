"""Decode steps replayed from CUDA graphs.

A decode step of a 135M-parameter model launches some 300 small kernels; run eagerly, the step
costs what Python and the driver take to launch them, several times what the GPU takes to run
them. A CUDA graph records those launches once and replays them with one call. vLLM and nano-vllm
capture decode steps for a set of batch sizes (1, 2, 4, 8, then every 16); so does this class,
lazily: a graph is captured the first time a step needs it (warmed up first, eagerly, on that
step's own inputs: the caches get the same keys and values the replay writes).

A graph replays the same kernels on the same addresses: the model runner keeps every input in a
buffer that never moves (``engine/model_runner.py``), and a batch of ``n`` requests runs the
graph of the smallest size ``bs >= n``, rows ``n .. bs-1`` being padding (a padding request
state, sequence length 1, slot ``PAD_SLOT_ID``: they read one key and write nothing). The graph
ends at the final hidden states; the output projection and the sampler run after it, on the real
rows only. The decode kernel sizes its split of long contexts by the batch's ``max_seq_len``, a
Python int fixed at capture, so graphs are keyed by the batch size and by ``max_seq_len`` rounded
up to a power of two (at least 256): a short context does not pay for a split sized for the
longest one.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """CUDA graphs of the model's decode step, keyed by ``(batch size, max_seq_len bucket)``."""

    def __init__(self, max_num_seqs: int, max_model_len: int, device: torch.device) -> None:
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._bucket_of = {}     # batch size -> its bucket (a lookup: this runs every step)
        for b in range(1, max_num_seqs + 1):
            self._bucket_of[b] = next(s for s in self.batch_sizes if s >= b)

    def key(self, num_reqs: int, max_seq_len: int) -> Optional[tuple[int, int]]:
        """The graph a decode batch of ``num_reqs`` runs (``max_seq_len`` already rounded up by
        the runner), or None when it is larger than any captured size."""
        bs = self._bucket_of.get(num_reqs)
        return None if bs is None else (bs, max_seq_len)

    def run(self, key: tuple[int, int], forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay the graph ``key`` (capturing ``forward`` first if it has none) and return its
        output, a tensor the graph writes at every replay."""
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(forward)
        entry[0].replay()
        return entry[1]

    def _capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        forward()                                   # compiles Triton kernels, makes kernel plans
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        torch.cuda.synchronize(self.device)
        return graph, out
