"""Random decode batches over a paged cache, for tests, notebooks, ``check`` and benchmarks.

A batch is what one decode step of a server sees: a query per sequence, a KV cache of
``num_blocks`` physical blocks, and per sequence a block table row and a length. With
``shuffle=True`` the blocks of every sequence are scattered over the cache in random order, as
they are after a server has run for a while; with ``shuffle=False`` each sequence's blocks are
consecutive (the contiguous case paging is compared against).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from paged_attention.utils import cdiv


@dataclass
class DecodeProblem:
    """One decode step's inputs, flash layout ``[num_blocks, block_size, num_kv_heads, head_size]``."""

    query: torch.Tensor           # [num_seqs, num_heads, head_size]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor    # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor        # int32 [num_seqs]
    scale: float
    alibi_slopes: torch.Tensor | None = None

    @property
    def kv_bytes_read(self) -> int:
        """Bytes of keys and values a decode step must read: every cached token, K and V."""
        tokens = int(self.seq_lens.sum())
        _, _, num_kv_heads, head_size = self.key_cache.shape
        return 2 * tokens * num_kv_heads * head_size * self.key_cache.element_size()

    def decode_args(self) -> tuple:
        """Positional arguments after ``out`` for ``paged_attention_decode`` and ``ref_decode_attention``."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.scale, self.alibi_slopes)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes, the geometric sequence 2^(-8 i / num_heads) for i = 1 .. num_heads."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=torch.float32)


def make_decode_problem(
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layout: str = "NHD",
    shuffle: bool = True,
    alibi: bool = False,
    spare_blocks: int = 0,
    seed: int = 0,
) -> DecodeProblem:
    """A random decode batch whose sequences have the given lengths.

    The cache holds exactly the blocks the sequences need plus ``spare_blocks`` unused ones.
    Table entries past a sequence's last block hold random (valid) ids, as stale entries do in
    vLLM: a kernel that reads past the end gets wrong numbers rather than a lucky zero.
    ``layout`` "HND" stores each block head-major and returns the caches as a permuted view.
    """
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=1)

    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = order[used:used + n]
        used += n

    # Cache contents are drawn on the target device: a benchmark cache can be gigabytes.
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def cache() -> torch.Tensor:
        if layout == "NHD":
            shape = (num_blocks, block_size, num_kv_heads, head_size)
        else:
            shape = (num_blocks, num_kv_heads, block_size, head_size)
        c = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
        return c if layout == "NHD" else c.permute(0, 2, 1, 3)

    key_cache, value_cache = cache(), cache()
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(device=device, dtype=dtype)
    return DecodeProblem(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=table.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        scale=head_size ** -0.5,
        alibi_slopes=alibi_slopes(num_heads).to(device) if alibi else None,
    )


# Agreement with the float64 oracle expected of a kernel, per input dtype: (atol, rtol). Scores
# and sums are float32 in every kernel; the error comes from rounding the inputs, the
# probabilities fed to the P.V product, and the output to the input's dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.5e-2, 5e-2),
}


def assert_close_to_oracle(out: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """Raise ``AssertionError`` unless ``out`` matches the oracle within its dtype's tolerance."""
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.double(), expected.double().to(out.device), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what} ({out.dtype}) differs from the float64 oracle: {m}")


def every_other(t: torch.Tensor, dim: int, fill) -> torch.Tensor:
    """``t`` as every other entry along ``dim`` of a tensor twice as long whose other entries
    hold ``fill``: the same values through a strided view, to show that a kernel honours strides
    (a kernel that reads the gaps sees ``fill``)."""
    shape = list(t.shape)
    shape[dim] *= 2
    index = [slice(None)] * t.dim()
    index[dim] = slice(None, None, 2)
    view = torch.full(shape, fill, dtype=t.dtype, device=t.device)[tuple(index)]
    view.copy_(t)
    return view
