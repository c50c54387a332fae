"""The Triton paged decode kernel against the float64 oracle."""
import pytest
import torch

from paged_attention.kernels.reference import ref_decode_attention
from paged_attention.kernels.triton import choose_num_splits, paged_attention_decode
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem

from conftest import dtype_params

# Ragged lengths: 1, exact multiples of the block size, one past, and a long one.
LENS = [1, 16, 17, 64, 5, 300]


def _run(p, **kw):
    out = torch.full_like(p.query, float("nan"))
    paged_attention_decode(out, *p.decode_args(), **kw)
    return out


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])   # GQA 1, 4, 8
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_decode_matches_oracle(device, dtype, num_heads, num_kv_heads, layout):
    p = make_decode_problem(LENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64,
                            block_size=16, dtype=dtype, device=device, layout=layout, spare_blocks=3)
    assert_close_to_oracle(_run(p), ref_decode_attention(*p.decode_args()))


@pytest.mark.parametrize("block_size", [4, 8, 12, 32, 64])   # vLLM: powers of two >= 8
@pytest.mark.parametrize("head_size", [32, 80, 128])
def test_block_and_head_sizes(device, block_size, head_size):
    lens = [1, block_size, 2 * block_size + 3, 130]
    p = make_decode_problem(lens, num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size,
                            dtype=torch.float16, device=device)
    assert_close_to_oracle(_run(p), ref_decode_attention(*p.decode_args()))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("alibi", [False, True])
def test_split_context_and_merge(device, num_splits, alibi):
    # Splits of a ragged batch: short sequences leave later splits empty; the merge must ignore them.
    p = make_decode_problem([1, 40, 700, 333], num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                            device=device, alibi=alibi, seed=5)
    assert_close_to_oracle(_run(p, num_splits=num_splits), ref_decode_attention(*p.decode_args()))


def test_alibi_changes_the_result(device):
    p = make_decode_problem([50, 77], num_heads=4, num_kv_heads=4, head_size=32, block_size=16, device=device, alibi=True)
    with_alibi = _run(p)
    p.alibi_slopes = None
    assert (with_alibi - _run(p)).abs().max() > 1e-3


def test_shuffled_equals_identity_table(device):
    # The same cache contents, laid out in scattered blocks or consecutive ones, give one answer.
    p = make_decode_problem([70, 33], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, device=device)
    out = _run(p)
    lens, bs = p.seq_lens.tolist(), 16
    rows = [p.block_tables[s, : -(-n // bs)].long() for s, n in enumerate(lens)]
    key = torch.cat([p.key_cache[r] for r in rows])
    value = torch.cat([p.value_cache[r] for r in rows])
    table = torch.zeros_like(p.block_tables)
    start = 0
    for s, r in enumerate(rows):
        table[s, : len(r)] = torch.arange(start, start + len(r))
        start += len(r)
    out2 = torch.empty_like(out)
    paged_attention_decode(out2, p.query, key, value, table, p.seq_lens, p.scale)
    torch.testing.assert_close(out, out2)


def test_stale_table_entries_are_not_read(device):
    p = make_decode_problem([20, 3], num_heads=4, num_kv_heads=2, head_size=32, block_size=16, device=device,
                            spare_blocks=1)
    out = _run(p)
    # Point every entry past a sequence's last block at the spare block, filled with huge values.
    needed = [-(-n // 16) for n in p.seq_lens.tolist()]
    used = {b for s, n in enumerate(needed) for b in p.block_tables[s, :n].tolist()}
    (spare,) = set(range(p.key_cache.size(0))) - used
    p.key_cache[spare].fill_(1e4)
    p.value_cache[spare].fill_(1e4)
    for s, n in enumerate(needed):
        p.block_tables[s, n:] = spare
    assert (p.block_tables == spare).any()
    torch.testing.assert_close(_run(p), out)


def test_num_splits_heuristic_on_cpu_never_splits():
    assert choose_num_splits(1, 1, 1 << 17, torch.device("cpu")) == 1


@pytest.mark.cuda
def test_num_splits_heuristic_on_gpu():
    gpu = torch.device("cuda")
    assert choose_num_splits(64, 8, 4096, gpu) == 1           # 512 programs: enough already
    assert choose_num_splits(1, 8, 131072, gpu) >= 32         # 8 programs: split the context
    assert choose_num_splits(1, 8, 300, gpu) <= 2             # but keep >= 256 tokens per split


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_gqa_batch_on_gpu(dtype):
    p = make_decode_problem([1, 511, 512, 513, 4096, 9000, 2047, 16], num_heads=32, num_kv_heads=8, head_size=128,
                            block_size=16, dtype=dtype, device="cuda", seed=9)
    assert_close_to_oracle(_run(p), ref_decode_attention(*p.decode_args()))
    assert_close_to_oracle(_run(p, num_splits=16), ref_decode_attention(*p.decode_args()))
