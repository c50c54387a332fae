"""The Triton paged prefill kernel against plain-torch attention over the gathered blocks."""
import pytest
import torch
import torch.nn.functional as F

from paged_attention.kernels.reference import gather_kv
from paged_attention.kernels.triton import paged_attention_prefill
from paged_attention.utils import cdiv

from conftest import dtype_params


def _problem(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = cdiv(max(seq_lens), block_size)
    num_blocks = len(q_lens) * max_blocks + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g).to(device, dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=g).to(device, dtype)
    # scattered physical blocks, each request its own
    tables = torch.randperm(num_blocks, generator=g)[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1], num_heads, head_size, generator=g).to(device, dtype)
    return (query, key_cache, value_cache, tables.int().to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def _reference(query, key_cache, value_cache, tables, seq_lens, starts, scale):
    """Each request: its keys gathered in token order, its queries the sequence's last tokens."""
    out = torch.empty_like(query)
    starts = starts.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[r]: starts[r + 1]]
        k, v = gather_kv(key_cache, value_cache, tables[r], seq_len)
        q_pos = seq_len - q.size(0) + torch.arange(q.size(0), device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), k.transpose(0, 1)[None].double(),
                                           v.transpose(0, 1)[None].double(), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[starts[r]: starts[r + 1]] = o[0].transpose(0, 1).to(query.dtype)
    return out


def _run(problem, scale, **kw):
    query = problem[0]
    out = torch.full_like(query, float("nan"))
    max_q = int((problem[5][1:] - problem[5][:-1]).max())
    paged_attention_prefill(out, *problem, scale, max_query_len=max_q, **kw)
    return out


# fresh prompts, prefix hits (q_len < seq_len), single-token decodes, a long one
Q_LENS, SEQ_LENS = [1, 37, 5, 70, 16], [20, 37, 50, 90, 16]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (4, 2, 16), (8, 8, 32), (8, 1, 64)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_matches_reference(device, num_heads, num_kv_heads, head_size, block_size):
    p = _problem(Q_LENS, SEQ_LENS, num_heads, num_kv_heads, head_size, block_size, torch.float32, device)
    scale = head_size ** -0.5
    torch.testing.assert_close(_run(p, scale), _reference(*p, scale), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", dtype_params(include_fp32=False))
def test_half_precision(device, dtype):
    p = _problem(Q_LENS, SEQ_LENS, 8, 2, 64, 16, dtype, device, seed=1)
    torch.testing.assert_close(_run(p, 0.125), _reference(*p, 0.125), atol=2e-2, rtol=0)


def test_small_tiles_cross_blocks(device):
    # Tiles of 16 tokens and 16 keys: many tiles per request, tiles that start mid-block.
    p = _problem([33, 7], [60, 7], 4, 2, 32, 8, torch.float32, device, seed=2)
    torch.testing.assert_close(_run(p, 0.2, launch=(16, 16, 4, 1)), _reference(*p, 0.2), atol=1e-5, rtol=0)


def test_bad_input(device):
    query, kc, vc, tables, lens, starts = _problem([3, 4], [3, 6], 4, 2, 16, 8, torch.float32, device)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="query tokens and seq_len"):
        paged_attention_prefill(out, query, kc, vc, tables, torch.tensor([3, 2], dtype=torch.int32, device=device),
                                starts, 0.25, max_query_len=4)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention_prefill(out, query, kc, vc, tables, lens, starts, 0.25, max_query_len=2)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_prefill(out, query, kc, vc, tables, lens, starts + 1, 0.25, max_query_len=4)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention_prefill(out, query.half(), kc, vc, tables, lens, starts, 0.25, max_query_len=4)


def test_plan_runs_every_layer_and_refuses_other_tensors(device):
    """A ``PrefillPlan`` made for one layer's tensors runs another layer's (same shapes, other
    contents) and matches the reference; a tensor with other strides or another shape is refused
    before the launch, and ``out`` stays as it was."""
    from paged_attention.kernels.triton import PrefillPlan

    layers = [_problem(Q_LENS, SEQ_LENS, 4, 2, 16, 16, torch.float32, device, seed=s) for s in (1, 2)]
    scale, max_q = 0.25, max(Q_LENS)
    out = torch.empty_like(layers[0][0])
    plan = PrefillPlan(out, *layers[0], scale, max_query_len=max_q, max_seq_len=max(SEQ_LENS), check_ids=False)
    for p in layers:
        plan.run(out, *p)
        torch.testing.assert_close(out, _reference(*p, scale), atol=1e-5, rtol=0)
    query, key_cache = layers[1][0], layers[1][1]
    before = out.clone()
    with pytest.raises(ValueError, match="key_cache"):
        plan.run(out, query, key_cache.transpose(1, 2).contiguous().transpose(1, 2), *layers[1][2:])
    with pytest.raises(ValueError, match="query"):
        plan.run(out, query[:-1], *layers[1][1:])
    assert torch.equal(out, before)


def test_unchecked_calls_share_one_plan(device):
    """An engine's calls (``check_ids=False`` with a ``max_seq_len``) are checked once per
    combination of shapes: the layers of a step reuse the first layer's plan."""
    from paged_attention.kernels.triton import prefill

    prefill._PLANS.clear()
    for seed in (1, 2, 3):
        p = _problem(Q_LENS, SEQ_LENS, 4, 2, 16, 16, torch.float32, device, seed=seed)
        out = _run(p, 0.25, check_ids=False, max_seq_len=max(SEQ_LENS))
        torch.testing.assert_close(out, _reference(*p, 0.25), atol=1e-5, rtol=0)
    assert len(prefill._PLANS) == 1
    p = _problem(Q_LENS[:3], SEQ_LENS[:3], 4, 2, 16, 16, torch.float32, device)
    _run(p, 0.25, check_ids=False, max_seq_len=max(SEQ_LENS))
    assert len(prefill._PLANS) == 2
