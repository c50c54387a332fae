"""Steps replayed from CUDA graphs: every decode step, and steps with prefills of a recurring shape.

A step of a 135M-parameter model launches some 300 small kernels; run eagerly, the step costs
what Python and the driver take to launch them (about 9 ms on an H100's host), several times
what the GPU takes to run them. A CUDA graph records those launches once and replays them with
one call. vLLM and nano-vllm capture decode steps for a set of batch sizes (1, 2, 4, 8, then
every 16); so does this class, lazily: the first step of a shape runs eagerly, and its launches
are then captured for the next ones.

A graph replays the same kernels on the same addresses: the model runner keeps every input in a
buffer that never moves (``engine/model_runner.py``), and a step runs the graph of its shape
padded up:

* a **decode** step of ``n`` requests runs the graph of the smallest size ``bs >= n``, rows
  ``n .. bs-1`` being padding (a padding request state, sequence length 1, slot
  ``PAD_SLOT_ID``: they read one key and write nothing);
* a step **with prefills** (``mixed_key``) pads its requests the same way, its tokens to a
  bucket (a power of two up to 1024, then a multiple of 1024, at most the step's budget) and its
  longest query to a power
  of two, which the prefill kernel's grid is sized by: the padding requests bring no token and
  the padding tokens belong to none. vLLM captures such steps in pieces around the attention
  (its compiler splits the graph there); the paged prefill kernel here reads its batch's layout
  from the device, so the whole step is one graph. At most ``max_mixed`` such graphs are kept;
  a step of yet another shape runs eagerly.

The decode kernel sizes its split of long contexts by the batch's ``max_seq_len``, a Python int
fixed at capture, so keys carry it too, rounded up to a power of two (at least 256) by the
runner: a short context does not pay for a split sized for the longest one. A graph ends at the
final hidden states, or, for a greedy batch, at the sampled tokens (the runner's choice). On a
GPU a decode graph also begins with the copy of its inputs from a pinned buffer and the tables'
gather, and a greedy one ends with the copy of its tokens to another: the runner keys it by those
buffers too (two of each, used in turn).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from paged_attention.utils import next_power_of_2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def token_bucket(num_tokens: int) -> int:
    """The padded token count of a step with prefills: a power of two up to 1024, then the next
    multiple of 1024 (at most 1023 padding tokens, a few percent of a large step's work)."""
    return next_power_of_2(num_tokens) if num_tokens <= 1024 else -(-num_tokens // 1024) * 1024


class StepGraphs:
    """CUDA graphs of the model's steps, keyed by ``(requests, tokens, longest query,
    max_seq_len bucket)`` padded, plus what the runner adds (its greedy variant, its buffers' turns)."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_model_len: int, device: torch.device,
                 max_mixed: int = 32) -> None:
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        self.max_num_tokens, self.max_model_len = max_num_tokens, max_model_len
        self.device = device
        self.max_mixed = max_mixed
        self.pool = None         # the graphs' shared memory pool, made at the first capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._mixed_shapes: set[tuple] = set()
        self._bucket_of = {}     # batch size -> its bucket (a lookup: this runs every step)
        for b in range(1, max_num_seqs + 1):
            self._bucket_of[b] = next(s for s in self.batch_sizes if s >= b)

    def key(self, num_reqs: int, max_seq_len: int) -> Optional[tuple[int, int, int, int]]:
        """The graph a decode batch of ``num_reqs`` runs (``max_seq_len`` already rounded up by
        the runner), or None when it is larger than any captured size."""
        bs = self._bucket_of.get(num_reqs)
        return None if bs is None else (bs, bs, 1, max_seq_len)

    def mixed_key(self, num_reqs: int, num_tokens: int, max_query_len: int,
                  max_seq_len: int) -> Optional[tuple[int, int, int, int]]:
        """The graph a step with prefills runs (its tokens padded at most to the step's budget),
        or None (run it eagerly) when ``max_mixed`` other shapes have graphs already."""
        bs = self._bucket_of.get(num_reqs)
        if bs is None:
            return None
        tokens = min(token_bucket(num_tokens), self.max_num_tokens)
        shape = (bs, tokens, min(next_power_of_2(max_query_len), tokens), max_seq_len)
        if shape not in self._mixed_shapes:
            if len(self._mixed_shapes) >= self.max_mixed:
                return None
            self._mixed_shapes.add(shape)
        return shape

    def run(self, key: tuple, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay the graph ``key`` and return its output, a tensor the graph writes at every
        replay. Without a graph yet, run ``forward`` eagerly (this step's answer: it compiles
        the kernels and makes their plans too), then capture it for the next steps. The capture
        records without running: a step runs once, which matters because a step's forward may
        change its own inputs (a greedy one stores each request's token where the next step
        reads it)."""
        entry = self.graphs.get(key)
        if entry is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            out = forward()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.graphs[key] = (graph, forward())
            torch.cuda.synchronize(self.device)
            return out
        entry[0].replay()
        return entry[1]
