"""Bad input: a typed error naming the argument, and nothing written."""
import pytest
import torch

from paged_attention.kernels import KernelUnavailable
from paged_attention.kernels import reference as ref
from paged_attention.kernels import triton as tk
from paged_attention.kernels.workloads import make_decode_problem

DECODERS = {
    "triton": lambda out, *a, **kw: tk.paged_attention_decode(out, *a, **kw),
    "oracle": lambda out, *a, **kw: out.copy_(ref.ref_decode_attention(*a, **kw)),
}


@pytest.fixture
def problem(device):
    return make_decode_problem([20, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, device=device)


def _call(name, p, **changes):
    kw = dict(query=p.query, key_cache=p.key_cache, value_cache=p.value_cache, block_tables=p.block_tables,
              seq_lens=p.seq_lens, scale=p.scale, alibi_slopes=p.alibi_slopes)
    kw.update(changes)
    DECODERS[name](torch.zeros_like(p.query), *kw.values())


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("change,error,match", [
    (lambda p: dict(block_tables=torch.where(p.block_tables == p.block_tables[0, 1], 10_000, p.block_tables)),
     ValueError, "block id 10000"),
    (lambda p: dict(block_tables=p.block_tables - 100), ValueError, "block id"),
    (lambda p: dict(seq_lens=p.seq_lens * 10), ValueError, "columns"),
    (lambda p: dict(seq_lens=p.seq_lens * 0), ValueError, "seq_lens must all be >= 1"),
    (lambda p: dict(seq_lens=p.seq_lens[:1]), ValueError, "seq_lens must have 2"),
    (lambda p: dict(block_tables=p.block_tables.float()), TypeError, "block_tables must have dtype"),
    (lambda p: dict(query=p.query[:, :3]), ValueError, "multiple of num_kv_heads"),
    (lambda p: dict(query=p.query[..., :16]), ValueError, "key_cache must have shape"),
    (lambda p: dict(key_cache=p.key_cache.half()), TypeError, "query's dtype"),
    (lambda p: dict(value_cache=p.value_cache[:-1]), ValueError, "value_cache must have shape"),
    (lambda p: dict(query=p.query.tolist()), TypeError, "query must be a torch.Tensor"),
    (lambda p: dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have 4"),
    (lambda p: dict(block_tables=p.block_tables.cpu().numpy()), TypeError,
     "block_tables must be a torch.Tensor, got numpy.ndarray"),
    (lambda p: dict(seq_lens=p.seq_lens.tolist()), TypeError, "seq_lens must be a torch.Tensor, got list"),
    (lambda p: dict(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda p: dict(scale=float("inf")), ValueError, "scale must be finite"),
    (lambda p: dict(scale=torch.tensor(p.scale)), TypeError, "scale must be a real number"),
])
def test_decode_bad_input(problem, name, change, error, match):
    with pytest.raises(error, match=match):
        _call(name, problem, **change(problem))


def test_decode_bad_input_leaves_out_untouched(problem):
    out = torch.full_like(problem.query, 7.0)
    with pytest.raises(ValueError):
        tk.paged_attention_decode(out, problem.query, problem.key_cache, problem.value_cache,
                                  problem.block_tables + 1000, problem.seq_lens, problem.scale)
    assert (out == 7.0).all()


def test_decode_wrong_out_and_splits(device):
    p = make_decode_problem([5], num_heads=2, num_kv_heads=1, head_size=16, block_size=8, device=device)
    with pytest.raises(TypeError, match="out must have dtype"):
        tk.paged_attention_decode(torch.empty_like(p.query).half(), *p.decode_args())
    with pytest.raises(ValueError, match="num_splits"):
        tk.paged_attention_decode(torch.empty_like(p.query), *p.decode_args(), num_splits=0)


def test_interpreter_refuses_bf16():
    p = make_decode_problem([5], num_heads=2, num_kv_heads=1, head_size=16, block_size=8, dtype=torch.bfloat16)
    from paged_attention import runtime
    if runtime.HAS_CUDA:
        pytest.skip("bf16 is fine compiled")
    with pytest.raises(KernelUnavailable, match="bfloat16"):
        tk.paged_attention_decode(torch.empty_like(p.query), *p.decode_args())


WRITERS = {"reference": ref.reshape_and_cache_flash, "triton": tk.reshape_and_cache_flash}


@pytest.mark.parametrize("name", list(WRITERS))
@pytest.mark.parametrize("change,error,match", [
    (lambda a: dict(slot_mapping=torch.tensor([0, 64])), ValueError, "only 64 slots"),
    (lambda a: dict(slot_mapping=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "slot_mapping must have dtype"),
    (lambda a: dict(slot_mapping=torch.arange(5)), ValueError, "only 3 tokens"),
    (lambda a: dict(key_cache=a["key_cache"][:, :, :1]), ValueError, "key_cache must have shape"),
    (lambda a: dict(value=a["value"][:2]), ValueError, "value must have shape"),
    (lambda a: dict(kv_cache_dtype="int4"), ValueError, "Unsupported fp8 kv cache data type"),
    (lambda a: dict(k_scale=torch.ones(3)), ValueError, "k_scale must have shape"),
    (lambda a: dict(k_scale=1.0), TypeError, "k_scale must be a torch.Tensor"),
    (lambda a: dict(key_cache=a["key_cache"].transpose(2, 3)), ValueError, "key_cache must have shape"),
    (lambda a: dict(slot_mapping=[0, 1, 2]), TypeError, "slot_mapping must be a torch.Tensor, got list"),
    (lambda a: dict(value=a["value"].half()), TypeError, "value must have the key's dtype"),
])
def test_cache_write_bad_input(device, name, change, error, match):
    a = dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16), key_cache=torch.zeros(8, 8, 2, 16),
             value_cache=torch.zeros(8, 8, 2, 16), slot_mapping=torch.tensor([0, 1, 2]), kv_cache_dtype="auto",
             k_scale=torch.ones(1), v_scale=torch.ones(1))
    a.update(change(a))
    a = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    before = (a["key_cache"].clone(), a["value_cache"].clone())
    with pytest.raises(error, match=match):
        WRITERS[name](*a.values())
    assert torch.equal(a["key_cache"], before[0]) and torch.equal(a["value_cache"], before[1])


def test_v0_attention_bad_input(device):
    p = make_decode_problem([20, 9], num_heads=4, num_kv_heads=2, head_size=32, block_size=8, device=device)
    k0, v0 = ref.flash_to_v0(p.key_cache, p.value_cache)
    one = torch.ones(1, device=device)
    out = torch.zeros_like(p.query)
    base = [out, p.query, k0, v0, 2, p.scale, p.block_tables, p.seq_lens, 8, 20, None, "auto", one, one]
    for index, value, error, match in [
        (9, 10, ValueError, "max_seq_len"),
        (8, 16, ValueError, "key_cache must have shape"),
        (4, 1, ValueError, "key_cache must have shape"),
        (11, "fp9", ValueError, "Unsupported"),
        (11, "fp8", TypeError, "uint8"),
    ]:
        bad = list(base)
        bad[index] = value
        with pytest.raises(error, match=match):
            ref.paged_attention_v1(*bad)
    assert (out == 0).all()
    with pytest.raises(KernelUnavailable, match="block-sparse"):
        ref.paged_attention_v1(*base, blocksparse_vert_stride=4)


def test_block_copy_bad_input():
    cache = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="outside"):
        ref.copy_blocks([cache], [cache], torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="same number of layers"):
        ref.copy_blocks([cache], [], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"\[num_pairs, 2\]"):
        ref.copy_blocks([cache], [cache], torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="outside"):
        ref.swap_blocks(cache, torch.zeros(2, 8), torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="exceeds"):
        ref.swap_blocks(cache, torch.zeros(2, 8), 64, torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="block_mapping"):
        ref.swap_blocks(cache, torch.zeros(2, 8))
    assert (cache == 0).all()
