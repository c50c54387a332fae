"""A DCP decode step from end to end on one rank, for tests, notebooks and benchmarks.

``DcpDecodeProblem`` describes a batch (its whole-context lengths, the heads, the block size,
the interleave) and makes the same query, keys and values on every rank from its seed. On rank
``r`` of ``W``, ``write_rank_cache`` builds the rank's v1 ``BlockTable`` (``dcp_world_size=W,
dcp_rank=r``), computes the slot mapping of every token of every sequence, as a prefill would,
and writes the keys and values through it: the cache write skips the slots marked ``-1``, so
the rank ends up holding its share only. ``run_dcp_rank`` then runs ``dcp_decode_attention``
and returns what each move produced, for checking and drawing; ``spawn(run_dcp_rank, W,
problem)`` runs it on ``W`` processes.

The oracle is ``dense_reference``: float64 attention over each sequence's keys and values as
they were made, with no cache, table or rank in between.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from paged_attention.distributed import dcp
from paged_attention.kernels import reference as ref
from paged_attention.utils import cdiv, check_int, check_int_list
from paged_attention.v1.block_table import BlockTable


@dataclass(frozen=True)
class DcpDecodeProblem:
    """One decode step's batch: ``seq_lens`` whole-context lengths, flash-layout caches of
    ``block_size``-token blocks, ``interleave`` tokens to a rank at a time. ``spare_blocks``
    unused blocks are added to every rank's cache (holding random numbers, as every slot does
    before it is written). The numbers are drawn on the device from the seed: the same on
    every rank of one device type (GPUs of one model)."""

    seq_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 8
    interleave: int = 1
    dtype: torch.dtype = torch.float32
    seed: int = 0
    spare_blocks: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(check_int_list("seq_lens", self.seq_lens, 1)))
        if not self.seq_lens:
            raise ValueError("seq_lens must name at least one sequence")
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "interleave"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("spare_blocks", self.spare_blocks, minimum=0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.block_size % self.interleave:
            raise ValueError(f"the interleave ({self.interleave}) must divide the block size "
                             f"({self.block_size})")

    @property
    def scale(self) -> float:
        return self.head_size ** -0.5

    def _generator(self, device: torch.device, stream: int) -> torch.Generator:
        return torch.Generator(device).manual_seed(self.seed * 1_000_003 + stream)

    def query(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The step's query, ``[num_seqs, num_heads, head_size]``: the same on every rank."""
        device = torch.device(device)
        shape = (len(self.seq_lens), self.num_heads, self.head_size)
        gen = self._generator(device, 0)
        return torch.randn(shape, generator=gen, device=device).to(self.dtype)

    def sequence_kv(self, s: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every token of sequence ``s``, ``[seq_len, num_kv_heads, head_size]``
        each, in position order (made one sequence at a time, so a long batch never needs them
        all at once)."""
        device = torch.device(device)
        gen = self._generator(device, 1 + s)
        shape = (self.seq_lens[s], self.num_kv_heads, self.head_size)
        k = torch.randn(shape, generator=gen, device=device).to(self.dtype)
        v = torch.randn(shape, generator=gen, device=device).to(self.dtype)
        return k, v

    def block_ids(self, dcp_world_size: int) -> list[list[int]]:
        """Each sequence's block ids, the same on every rank (one scheduler allocates them): a
        block column covers ``block_size * W`` positions, so a sequence of ``L`` tokens needs
        ``cdiv(L, block_size * W)``. Scattered over the cache by a seeded shuffle."""
        per_seq = [cdiv(n, self.block_size * dcp_world_size) for n in self.seq_lens]
        order = np.random.default_rng(self.seed).permutation(sum(per_seq) + self.spare_blocks)
        starts = np.cumsum([0] + per_seq)
        return [order[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]

    def dense_reference(self, device: torch.device | str = "cpu",
                        seqs: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 ``(out, lse)`` of attention over each whole sequence (or those listed in
        ``seqs``), from its keys and values as made: a one-block "cache" per sequence that holds
        exactly its tokens in order."""
        query = self.query(device)
        outs, lses = [], []
        one_block = torch.zeros(1, 1, dtype=torch.int32, device=query.device)
        for s in range(len(self.seq_lens)) if seqs is None else seqs:
            n = self.seq_lens[s]
            k, v = self.sequence_kv(s, device)
            lens = torch.tensor([n], dtype=torch.int32, device=query.device)
            o, lse = ref.ref_decode_attention(query[s:s + 1], k[None], v[None], one_block, lens,
                                              self.scale, return_lse=True)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


@dataclass
class RankCache:
    """What one rank holds: its table (v1 ``BlockTable``), the committed rows as the kernels get
    them, its caches, and the slot every position of every sequence was mapped to (``-1``:
    another rank's token)."""

    table: BlockTable
    block_tables: torch.Tensor                 # int32 [num_seqs, columns], on the device
    key_cache: torch.Tensor                    # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    slots: list[np.ndarray]                    # per sequence, int64 [seq_len]


def write_rank_cache(problem: DcpDecodeProblem, dcp_world_size: int, dcp_rank: int,
                     device: torch.device | str = "cpu", impl: str = "reference") -> RankCache:
    """Build rank ``dcp_rank``'s table and write its share of every sequence through it.

    The table is vLLM's worker table with DCP on; each sequence's tokens are scheduled as one
    prefill (``req_indices`` = its row, ``positions`` = 0 .. L-1), ``compute_slot_mapping`` gives
    each token's slot on this rank or ``-1``, and ``reshape_and_cache_flash`` (the reference's or
    Triton's, by ``impl``) writes the tokens whose slot is not ``-1``. With ``dcp_world_size=1``
    this is an ordinary single-rank cache holding every token.
    """
    if impl not in dcp.IMPLS:
        raise ValueError(f"impl must be one of {dcp.IMPLS}, got {impl!r}")
    device = torch.device(device)
    p = problem
    ids = p.block_ids(dcp_world_size)
    table = BlockTable(p.block_size, len(p.seq_lens), max(map(len, ids)), max(p.seq_lens), False,
                       device, p.block_size, p.interleave, dcp_world_size=dcp_world_size,
                       dcp_rank=dcp_rank)
    num_blocks = sum(map(len, ids)) + p.spare_blocks
    gen = torch.Generator(device).manual_seed(10_007 + dcp_rank)
    shape = (num_blocks, p.block_size, p.num_kv_heads, p.head_size)
    # Random numbers in every slot, so that a slot nobody wrote cannot pass for a written one.
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=p.dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=p.dtype)
    if impl == "reference":
        write = ref.reshape_and_cache_flash
    else:
        from paged_attention.kernels.triton import reshape_and_cache_flash as write
    one = torch.ones(1, dtype=torch.float32, device=device)
    slots = []
    for s, n in enumerate(p.seq_lens):
        table.add_row(ids[s], s)
        table.compute_slot_mapping(np.full(n, s), np.arange(n))
        table.commit_slot_mapping(n)
        slot_mapping = table.slot_mapping.gpu[:n]
        key, value = p.sequence_kv(s, device)
        write(key, value, key_cache, value_cache, slot_mapping, "auto", one, one)
        slots.append(table.slot_mapping.np[:n].copy())
    table.commit_block_table(len(p.seq_lens))
    return RankCache(table, table.get_device_tensor(len(p.seq_lens)), key_cache, value_cache, slots)


@dataclass
class RankResult:
    """One rank's DCP decode step, every move of it, on the CPU: its slots, its token counts, its
    partial ``(out, lse)`` and the merged ``(out, lse)`` that ``dcp_decode_attention`` returned."""

    rank: int
    block_ids: list[list[int]]
    slots: list[np.ndarray]
    local_seq_lens: list[int]
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def run_dcp_rank(rank: int, world_size: int, problem: DcpDecodeProblem,
                 impl: str = "reference") -> RankResult:
    """Rank ``rank``'s part of a DCP decode step over ``problem`` (inside a ``torch.distributed``
    group of ``world_size``, as ``spawn`` makes): write its share, attend over it, all-gather,
    merge. The tensors come back on the CPU."""
    from paged_attention import runtime

    on_gpu = runtime.HAS_CUDA and torch.distributed.get_backend() == "nccl"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    cache = write_rank_cache(problem, world_size, rank, device, impl)
    query = problem.query(device)
    seq_lens = torch.tensor(problem.seq_lens, dtype=torch.int32, device=device)
    kv = (query, cache.key_cache, cache.value_cache, cache.block_tables)
    out, lse = dcp.dcp_decode_attention(*kv, seq_lens, problem.scale, interleave=problem.interleave,
                                        impl=impl, return_lse=True)
    # The partial again, on its own, to show what this rank contributed.
    local = dcp.get_dcp_local_seq_lens(seq_lens, world_size, rank, problem.interleave)
    partial_out, partial_lse = dcp.partial_decode_attention(*kv, local, problem.scale, impl=impl)
    return RankResult(rank, problem.block_ids(world_size), cache.slots, local.tolist(),
                      partial_out.cpu(), partial_lse.cpu(), out.cpu(), lse.cpu())


def dcp_merge_weights(results: Sequence[RankResult], seq: int = 0) -> np.ndarray:
    """``[ranks, heads]``: each rank's share of the softmax mass of sequence ``seq``,
    ``exp(lse_r - lse)``, its weight in the merge (the weights of a head sum to 1)."""
    if not results or not all(isinstance(r, RankResult) for r in results):
        raise TypeError("results must be a non-empty list of run_dcp_rank's results, one per rank")
    partial = torch.stack([res.partial_lse[seq].double() for res in results])
    return torch.exp(partial - results[0].lse[seq].double()).numpy()
