"""Cheap calls: plans checked once (decode, cache write), and vLLM's own Triton kernel loaded as a
peer. The Launcher the plans launch through: ``test_triton_launch.py``."""
import sys

import pytest
import torch

from paged_attention.kernels import reference as ref
from paged_attention.kernels.triton import cache, decode, paged_attention_decode, reshape_and_cache_flash
from paged_attention.kernels.triton.decode import DecodePlan
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem

SMALL = dict(num_heads=8, num_kv_heads=2, head_size=32, block_size=16)


def _problem(device, lens=(1, 40, 70, 17), layout="NHD", seed=0, dtype=torch.float32):
    return make_decode_problem(list(lens), device=device, layout=layout, seed=seed, dtype=dtype, **SMALL)


def _plan_args(p):
    return p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens


# ---- DecodePlan -------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [1, 3])
def test_plan_runs_match_the_oracle_with_new_contents(device, splits):
    # One plan, two problems of the same shapes (the next step, another layer): both right.
    a, b = _problem(device, seed=1), _problem(device, seed=2)
    plan = DecodePlan(*_plan_args(a), a.scale, max_seq_len=70, num_splits=splits, launch=(16, 1, 1))
    assert plan.num_splits == splits
    for p in (a, b, a):
        out = torch.full_like(p.query, float("nan"))
        plan.run(out, *_plan_args(p))
        assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))


def test_plan_honours_hnd_strides(device):
    p = _problem(device, layout="HND")
    out = torch.empty_like(p.query)
    DecodePlan(*_plan_args(p), p.scale, max_seq_len=70).run(out, *_plan_args(p))
    assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))


def test_plan_refuses_what_it_was_not_planned_for_and_writes_nothing(device):
    p = _problem(device)
    plan = DecodePlan(*_plan_args(p), p.scale, max_seq_len=70)
    q, k, v, bt, sl = _plan_args(p)
    out = torch.zeros_like(q)
    hnd = _problem(device, layout="HND")
    bad = {
        "shape": ((out[:2], q[:2], k, v, bt[:2], sl[:2]), ValueError),
        "strides": ((out, q, hnd.key_cache, hnd.value_cache, bt, sl), ValueError),
        "dtype": ((out.half(), q.half(), k.half(), v.half(), bt, sl), ValueError),
        "seq_lens dtype": ((out, q, k, v, bt, sl.long()), ValueError),
        "not a tensor": ((out, q, k, v, bt, sl.tolist()), TypeError),
        "alibi not planned": ((out, q, k, v, bt, sl, torch.ones(8, device=q.device)), ValueError),
        "alibi not a tensor": ((out, q, k, v, bt, sl, 0.5), TypeError),
    }
    for name, (call, error) in bad.items():
        with pytest.raises(error, match="plan|Tensor"):
            plan.run(*call)
        assert out.abs().sum() == 0, name            # refused before the launch


def test_plan_checks_what_a_checked_call_checks(device):
    p = _problem(device)
    with pytest.raises(ValueError):                                      # a table id past the cache
        bt = p.block_tables.clone()
        bt[0, 0] = p.key_cache.size(0)
        DecodePlan(p.query, p.key_cache, p.value_cache, bt, p.seq_lens, p.scale)
    with pytest.raises(ValueError):                                      # bound below the longest
        DecodePlan(*_plan_args(p), p.scale, max_seq_len=69)
    with pytest.raises(ValueError, match="TILE_N"):
        DecodePlan(*_plan_args(p), p.scale, max_seq_len=70, launch=(24, 1, 1))
    with pytest.raises(ValueError):                                      # a broadcast output
        DecodePlan(*_plan_args(p), p.scale, out=torch.zeros(1, 8, 32, device=p.query.device).expand(4, 8, 32))


def test_unchecked_calls_are_planned_once_per_signature(device):
    decode._PLANS.clear()
    p, hnd = _problem(device), _problem(device, layout="HND")
    out = torch.empty_like(p.query)
    for _ in range(3):
        paged_attention_decode(out, *p.decode_args(), max_seq_len=70, check_ids=False)
    assert len(decode._PLANS) == 1
    assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))
    # Other strides are another plan (honoured, not mistaken for the first).
    paged_attention_decode(out, *hnd.decode_args(), max_seq_len=70, check_ids=False)
    assert len(decode._PLANS) == 2
    assert_close_to_oracle(out, ref.ref_decode_attention(*hnd.decode_args()))
    # A bad first call raises and plans nothing.
    with pytest.raises(TypeError):
        paged_attention_decode(out, p.query.half(), *p.decode_args()[1:], max_seq_len=70, check_ids=False)
    assert len(decode._PLANS) == 2


def test_plan_cache_is_bounded(device, monkeypatch):
    decode._PLANS.clear()
    monkeypatch.setattr(decode, "_MAX_PLANS", 2)
    p = _problem(device)
    out = torch.empty_like(p.query)
    for bound in (70, 71, 72):
        paged_attention_decode(out, *p.decode_args(), max_seq_len=bound, check_ids=False)
    assert len(decode._PLANS) == 2
    decode._PLANS.clear()


# ---- Cache writes ---------------------------------------------------------------------------------
def _write_problem(device, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(n, 2, 32, generator=g).to(device)
    value = torch.randn(n, 2, 32, generator=g).to(device)
    slots = torch.randperm(8 * 16, generator=g)[:n].to(device)
    slots[1] = -1                                         # a padding token
    return key, value, slots


def test_unchecked_cache_writes_are_planned_once_and_right(device):
    cache._PLANS.clear()
    one = torch.ones(1, device=device)
    kc, vc = torch.zeros(8, 16, 2, 32, device=device), torch.zeros(8, 16, 2, 32, device=device)
    want_k, want_v = kc.clone(), vc.clone()
    for seed in (0, 1):
        key, value, slots = _write_problem(device, seed=seed)
        reshape_and_cache_flash(key, value, kc, vc, slots, "auto", one, one, check_slots=False)
        ref.reshape_and_cache_flash(key, value, want_k, want_v, slots, "auto", one, one)
    assert len(cache._PLANS) == 1
    torch.testing.assert_close(kc, want_k)
    torch.testing.assert_close(vc, want_v)


def test_cache_write_plan_refuses_other_tensors(device):
    one = torch.ones(1, device=device)
    kc, vc = torch.zeros(8, 16, 2, 32, device=device), torch.zeros(8, 16, 2, 32, device=device)
    key, value, slots = _write_problem(device)
    plan = cache.CacheWritePlan(key, value, kc, vc, slots, "auto", one, one)
    with pytest.raises(ValueError, match="plan"):
        plan.run(key[:4], value[:4], kc, vc, slots[:4])
    with pytest.raises(ValueError, match="plan"):
        plan.run(key, value, kc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3), vc, slots)
    with pytest.raises(TypeError):
        plan.run(key, value, kc, vc, slots.tolist())
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0
    plan.run(key, value, kc, vc, slots)
    assert kc.abs().sum() > 0


@pytest.mark.cuda
def test_decode_plan_in_a_cuda_graph_matches_eager():
    p = _problem("cuda", lens=(1, 700, 2000, 33), dtype=torch.bfloat16)
    plan = DecodePlan(*_plan_args(p), p.scale, max_seq_len=2048, num_splits=4)
    eager, replayed = torch.empty_like(p.query), torch.empty_like(p.query)
    plan.run(eager, *_plan_args(p))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(replayed, *_plan_args(p))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(replayed, eager)
    assert_close_to_oracle(eager, ref.ref_decode_attention(*p.decode_args()))


# ---- vLLM's Triton kernel as a peer -----------------------------------------------------------------
def test_vllm_triton_unavailable_says_why(monkeypatch, tmp_path):
    from paged_attention.kernels import vllm_triton
    monkeypatch.setenv("PAGED_ATTENTION_VLLM_KERNELS", str(tmp_path))
    vllm_triton._module.cache_clear()
    try:
        ok, why = vllm_triton.available()
        assert not ok and "triton_unified_attention.py" in why
        with pytest.raises(vllm_triton.VllmUnavailableError):
            vllm_triton.VllmTritonDecode(8, 2, 32, 4, "cpu")
    finally:
        vllm_triton._module.cache_clear()


@pytest.mark.parametrize("lens", [(1, 40, 70, 17), tuple(range(1, 41))])   # split-K (3D) and one pass (2D)
def test_vllm_triton_matches_the_oracle(device, lens):
    from paged_attention.kernels import vllm_triton
    ok, why = vllm_triton.available()
    if not ok:
        pytest.skip(why)
    # float16: vLLM's kernel multiplies float32 in TF32 on a GPU, outside float32's tolerance.
    p = make_decode_problem(list(lens), device=device, seed=3, num_heads=8, num_kv_heads=8, head_size=32,
                            block_size=16, dtype=torch.float16)
    peer = vllm_triton.VllmTritonDecode(8, 8, 32, 64, device)
    assert (len(lens) > peer.seq_threshold_3d) == (len(lens) == 40)
    out = torch.full_like(p.query, float("nan"))
    peer(out, *p.decode_args()[:6], max_seq_len=max(lens))
    assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))
    # The stand-ins for vLLM's modules were only there while its files executed.
    assert "vllm.triton_utils" not in sys.modules and "vllm.platforms" not in sys.modules
