"""The Triton paged decode kernel against the float64 oracle."""
import pytest
import torch

from paged_attention.kernels import reference as ref
from paged_attention.kernels.reference import ref_decode_attention
from paged_attention.kernels.triton import choose_num_splits, paged_attention_decode
from paged_attention.kernels.triton.decode import DecodePlan, MergePlan, merge_partials
from paged_attention.kernels.workloads import assert_close_to_oracle, every_other, make_decode_problem

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


def test_launch_shape_follows_latency_or_bandwidth(monkeypatch):
    """Short contexts over few programs take fewer, larger loop steps (bound by each program's
    chain of loads); many programs or long contexts keep the streaming shape. The rule is asked
    about a GPU of 132 multiprocessors without one (it only reads the count)."""
    from paged_attention.kernels.triton import decode
    monkeypatch.setattr(decode, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert decode.choose_launch(gpu, 256, 1, 3) == (256, 8, 1)            # one request, 3 KV heads
    assert decode.choose_launch(gpu, 100, 1, 48) == (128, 8, 1)           # one tile holds every context
    assert decode.choose_launch(gpu, 256, 1, 192) == (128, 4, 2)          # 64 requests
    assert decode.choose_launch(gpu, 256, 1, 768) == (64, 4, 3)           # 256 requests: bandwidth
    assert decode.choose_launch(gpu, 4096, 1, 3) == (64, 4, 3)            # a long context streams
    assert decode.choose_launch(gpu, 4096, 8, 24) == (64, 4, 2)
    assert decode.choose_launch(gpu, 256, 1) == (64, 4, 3)                # programs not given
    for programs in (1, 66, 67, 264, 265):
        decode.check_launch(decode.choose_launch(gpu, 256, 1, programs))


@pytest.mark.cuda
@pytest.mark.parametrize("launch", [(256, 8, 1), (128, 4, 2), (64, 4, 3)])
def test_every_default_launch_shape_with_rope(launch):
    """The launch shapes ``choose_launch`` picks for short contexts (one tile per sequence, two,
    four), each with the rotary embedding and the cache write fused in: the caches as the rotary
    kernel writes them, and the output the reference attention computes over them."""
    from paged_attention.kernels.triton.layer_ops import rotary_and_cache_
    p, (H, KV, D) = _rope_problem(torch.device("cuda"), torch.float16, lens=(5, 1, 200, 256, 129, 64), H=9, KV=3,
                                  D=64, B=16)
    qkv, kc, vc = p["qkv"].clone(), p["kc"].clone(), p["vc"].clone()
    q = rotary_and_cache_(qkv, p["cos_sin"], p["pos"], p["slots"], kc, vc, H, KV)
    got = _fused(p, (H, KV, D), launch=launch)
    assert torch.equal(got[2], vc)
    torch.testing.assert_close(got[1], kc, atol=2e-2, rtol=1e-2)
    assert_close_to_oracle(got[0], ref_decode_attention(q, kc, vc, p["table"], p["seq_lens"], D ** -0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_gqa_batch_on_gpu(dtype):
    p = make_decode_problem([1, 511, 512, 513, 4096, 9000, 2047, 16], num_heads=32, num_kv_heads=8, head_size=128,
                            block_size=16, dtype=dtype, device="cuda", seed=9)
    assert_close_to_oracle(_run(p), ref_decode_attention(*p.decode_args()))
    assert_close_to_oracle(_run(p, num_splits=16), ref_decode_attention(*p.decode_args()))


# ---- Log-sum-exps: what a caller needs to merge attention over parts of a context -------------

@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_lse_matches_the_reference(device, num_splits):
    p = make_decode_problem([1, 9, 70], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                            device=device, seed=5)
    oracle, oracle_lse = ref.ref_decode_attention(*p.decode_args(), return_lse=True)
    out = torch.empty_like(p.query)
    lse = torch.full((3, 4), float("nan"), device=device)
    # 16-token tiles, so that the interpreter too cuts the 70 tokens into num_splits ranges and
    # the log-sum-exp comes from the merge kernel
    plan = DecodePlan(*p.decode_args(), out=out, num_splits=num_splits, launch=(16, 1, 1), lse=lse)
    assert plan.num_splits == num_splits
    plan.run(out, *p.decode_args()[:-2], None, lse)
    torch.testing.assert_close(lse.double().cpu(), oracle_lse.cpu(), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), oracle, rtol=0, atol=1e-5)


def test_triton_lse_refuses_bad_buffers(device):
    p = make_decode_problem([5, 9], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                            device=device)
    out = torch.empty_like(p.query)
    bad = {TypeError: [torch.empty(2, 4, dtype=torch.float64, device=device), [0.0] * 8],
           ValueError: [torch.empty(2, 3, device=device), torch.empty(4, 2, device=device).t(),
                        torch.empty(8, device=device)]}
    for error, buffers in bad.items():
        for lse in buffers:
            out.fill_(7.0)
            with pytest.raises(error):
                paged_attention_decode(out, *p.decode_args(), lse=lse)
            assert (out == 7.0).all()               # refused before the launch


@pytest.mark.parametrize("num_splits", [1, 3])
def test_lse_of_an_empty_sequence_is_minus_inf(device, num_splits):
    """An unchecked call may pass a length of 0 (a DCP rank holding none of a sequence's tokens):
    zero output, lse = -inf, with or without splits, and the other sequences unchanged."""
    p = make_decode_problem([4, 9, 70, 2], num_heads=4, num_kv_heads=2, head_size=16, block_size=8,
                            device=device, seed=6)
    oracle, oracle_lse = ref_decode_attention(*p.decode_args(), return_lse=True)
    lens = p.seq_lens.clone()
    lens[[0, 3]] = 0
    out = torch.full_like(p.query, float("nan"))
    lse = torch.full((4, 4), float("nan"), device=device)
    paged_attention_decode(out, p.query, p.key_cache, p.value_cache, p.block_tables, lens, p.scale,
                           num_splits=num_splits, max_seq_len=70, check_ids=False, launch=(16, 1, 1),
                           lse=lse)
    assert (out[[0, 3]] == 0).all() and torch.isneginf(lse[[0, 3]]).all()      # not NaN = 0 / 0
    torch.testing.assert_close(out[1:3].double(), oracle[1:3], rtol=0, atol=1e-5)
    torch.testing.assert_close(lse[1:3].double().cpu(), oracle_lse[1:3].cpu(), rtol=0, atol=1e-5)
    # the checked path still refuses a length of 0: no decode step has an empty sequence
    with pytest.raises(ValueError):
        paged_attention_decode(out, p.query, p.key_cache, p.value_cache, p.block_tables, lens, p.scale)


def _parts(device, dtype=torch.float32, num_parts=3, seed=0):
    """Attention over ``num_parts`` random parts of 5 sequences, as (outputs, lses): sequence 1's
    last part is empty, and all of sequence 3's."""
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.randn(num_parts, 5, 4, 16, generator=gen, dtype=torch.float64)
    lses = 3 * torch.randn(num_parts, 5, 4, generator=gen, dtype=torch.float64)
    lses[-1, 1] = float("-inf")
    lses[:, 3] = float("-inf")
    outputs[-1, 1] = 0.0
    outputs[:, 3] = 0.0
    return outputs.to(device, dtype), lses.to(device, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_parts", [1, 2, 5])
def test_lse_merge_matches_the_reference(device, dtype, num_parts):
    """The Triton merge of parts given by their log-sum-exps (decode context parallelism's ranks)
    against ``reference.merge_partials`` in float64, through strided views."""
    outputs, lses = _parts(device, dtype, num_parts)
    expected, expected_lse = ref.merge_partials(outputs.double(), lses.double(), dim=0)
    strided_outputs = every_other(outputs, 1, float("nan"))      # gaps of NaN between sequences
    strided_lses = lses.transpose(1, 2).contiguous().transpose(1, 2)
    out = every_other(torch.full((5, 4, 16), float("nan"), device=device, dtype=dtype), 1, 7.0)
    lse = torch.full((5, 4), float("nan"), device=device)
    merge_partials(out, strided_outputs, strided_lses, lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected.nan_to_num(0.0), rtol=0, atol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=0, atol=1e-5)
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()   # all parts empty: 0, -inf
    if num_parts > 1:        # a merge that does not rescale by the log-sum-exps is wrong
        assert (outputs.double().mean(0) - expected)[[0, 2, 4]].abs().max() > 1e-2


def test_lse_merge_plan_runs_again_and_refuses_bad_arguments(device):
    outputs, lses = _parts(device)
    out = torch.empty(5, 4, 16, device=device)
    plan = MergePlan(out, outputs, lses)
    outputs2, lses2 = _parts(device, seed=1)
    plan.run(out, outputs2, lses2)                          # new contents, same plan
    expected = ref.merge_partials(outputs2.double(), lses2.double(), dim=0)[0].nan_to_num(0.0)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    bad = {TypeError: [(out, outputs, lses.double(), None), (out, outputs.int(), lses, None),
                       (out, outputs, lses, torch.empty(5, 4, device=device, dtype=torch.float64))],
           ValueError: [(out, outputs, lses[:, :4], None), (out[:4], outputs, lses, None),
                        (out, outputs[..., ::2], lses, None), (out, outputs[:0], lses[:0], None),
                        (torch.empty(1, 4, 16, device=device).expand(5, 4, 16), outputs, lses, None),
                        (out, outputs, lses, torch.empty(4, 5, device=device).t())]}
    for error, cases in bad.items():
        for case in cases:
            out.fill_(7.0)
            with pytest.raises(error):
                merge_partials(*case)
            assert (out == 7.0).all()                       # refused before the launch
    with pytest.raises(ValueError):
        plan.run(out, outputs.transpose(1, 2).contiguous().transpose(1, 2), lses)   # other strides



# ---- The rotary embedding and the cache write inside the decode kernel (rope=) ----------------

def _rope_problem(device, dtype, lens=(5, 1, 40, 20), H=4, KV=2, D=16, B=4, seed=0):
    """QKV rows of a decode step, caches, tables, positions (each sequence's last) and slots (one
    of them -1: a padding row writes nothing)."""
    from paged_attention.model.layer_ops import RotaryEmbedding
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor(lens)
    S, cols = len(lens), -(-max(lens) // B)
    num_blocks = S * cols + 3
    table = torch.randperm(num_blocks, generator=g)[:S * cols].view(S, cols).int()
    kc = torch.randn(num_blocks, B, KV, D, generator=g).to(dtype)
    vc = torch.randn(num_blocks, B, KV, D, generator=g).to(dtype)
    pos = seq_lens - 1
    slots = table[torch.arange(S), pos // B].long() * B + pos % B
    slots[1] = -1
    qkv = torch.randn(S, (H + 2 * KV) * D, generator=g).to(dtype)
    cos_sin = RotaryEmbedding(D, max(64, max(lens)), 10000.0, torch.device("cpu")).cos_sin
    to = {"device": device}
    return {k: v.to(**to) for k, v in dict(qkv=qkv, kc=kc, vc=vc, table=table, seq_lens=seq_lens, pos=pos,
                                            slots=slots, cos_sin=cos_sin).items()}, (H, KV, D)


def _unfused(p, heads, **kw):
    """The two launches the fused kernel replaces: the rotary kernel with the cache write, then decode."""
    from paged_attention.kernels.triton.layer_ops import rotary_and_cache_
    H, KV, D = heads
    qkv, kc, vc = p["qkv"].clone(), p["kc"].clone(), p["vc"].clone()
    q = rotary_and_cache_(qkv, p["cos_sin"], p["pos"], p["slots"], kc, vc, H, KV)
    out = torch.empty_like(q)
    paged_attention_decode(out, q, kc, vc, p["table"], p["seq_lens"], D ** -0.5, **kw)
    return out, kc, vc


def _fused(p, heads, pos=None, **kw):
    H, KV, D = heads
    qkv, kc, vc = p["qkv"].clone(), p["kc"].clone(), p["vc"].clone()
    q = qkv[:, :H * D].view(-1, H, D)
    out = torch.empty_like(q)
    paged_attention_decode(out, q, kc, vc, p["table"], p["seq_lens"], D ** -0.5,
                           rope=(p["cos_sin"], p["pos"] if pos is None else pos, p["slots"]), **kw)
    return out, kc, vc


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_rope_equals_rotary_kernel_then_decode(device, dtype, num_splits):
    """Rotating the queries and the new keys and writing the keys and values inside the decode
    kernel gives what the rotary-and-cache kernel then the decode kernel give: the same output
    and the same caches, bit for bit where both run the same float32 arithmetic (the interpreter;
    compiled, each kernel's own contraction of the products may move a rounding). With three
    splits the writer is the program whose range holds the last token (later ones are empty for
    short sequences)."""
    p, heads = _rope_problem(device, dtype)
    kw = dict(num_splits=num_splits, launch=(16, 1, 1))
    want, got = _unfused(p, heads, **kw), _fused(p, heads, **kw)
    if device.type == "cpu":
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    else:
        assert torch.equal(got[2], want[2])                                   # values: copied
        for a, b in zip(got[:2], want[:2]):
            torch.testing.assert_close(a, b, atol=2e-2 if dtype != torch.float32 else 1e-5, rtol=1e-2)
    assert not torch.equal(got[1], p["kc"])                                   # the keys were written
    # The check can fail: the positions one off rotate by the wrong angles.
    wrong = _fused(p, heads, pos=p["pos"] + 1, **kw)
    assert not torch.allclose(wrong[0], want[0], atol=1e-3) and not torch.allclose(wrong[1], want[1], atol=1e-3)


def test_decode_with_rope_refuses_bad_input_before_launch(device):
    p, (H, KV, D) = _rope_problem(device, torch.float32)
    kc, q = p["kc"].clone(), p["qkv"][:, :H * D].view(-1, H, D)
    out = torch.empty_like(q)
    good = (p["cos_sin"], p["pos"], p["slots"])
    bad = [
        (TypeError, (p["cos_sin"], p["pos"])),                                      # not three
        (TypeError, (p["cos_sin"].double(), p["pos"], p["slots"])),
        (TypeError, (p["cos_sin"], p["pos"].float(), p["slots"])),
        (ValueError, (p["cos_sin"], p["pos"][:-1], p["slots"])),
        (ValueError, (p["cos_sin"][:, :, :-1], p["pos"], p["slots"])),             # not [P, 2, D/2]
        (ValueError, (p["cos_sin"], torch.stack([p["pos"]] * 2, 1)[:, 0], p["slots"])),   # strided
    ]
    for error, rope in bad:
        with pytest.raises(error):
            paged_attention_decode(out, q, kc, p["vc"], p["table"], p["seq_lens"], D ** -0.5, rope=rope)
    # A query that is not the first columns of QKV rows (its rows end with it: no keys after it).
    with pytest.raises(ValueError):
        paged_attention_decode(out, q.contiguous(), kc, p["vc"], p["table"], p["seq_lens"], D ** -0.5, rope=good)
    assert torch.equal(kc, p["kc"])                                                 # nothing written
    # A plan made with rope refuses a run without it, and the other way round.
    plan = DecodePlan(q, kc, p["vc"], p["table"], p["seq_lens"], D ** -0.5, out=out, rope=good)
    with pytest.raises(ValueError):
        plan.run(out, q, kc, p["vc"], p["table"], p["seq_lens"])
    plain = DecodePlan(q, kc, p["vc"], p["table"], p["seq_lens"], D ** -0.5, out=out)
    with pytest.raises(ValueError):
        plain.run(out, q, kc, p["vc"], p["table"], p["seq_lens"], rope=good)
    assert torch.equal(kc, p["kc"])
    plan.run(out, q, kc, p["vc"], p["table"], p["seq_lens"], rope=good)
    assert not torch.equal(kc, p["kc"])
