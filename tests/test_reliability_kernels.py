"""Kernel front-ends refuse, before anything is launched or written, what they cannot honour:
safety flags that are not True or False, tensors without strides or data, counts beyond what a
kernel can hold, and tensors that are written while they share memory with another argument.
Every refusal leaves the outputs and the caches as they were; the good inputs next to each bad
one still run (a check that refused everything would pass the first half alone)."""
from __future__ import annotations

import pytest
import torch

from paged_attention.kernels import args
from paged_attention.kernels import reference as ref
from paged_attention.kernels.triton import cache as triton_cache
from paged_attention.kernels.triton import paged_attention_decode, paged_attention_prefill
from paged_attention.kernels.triton.cache import CacheWritePlan
from paged_attention.kernels.triton.decode import DecodePlan
from paged_attention.kernels.workloads import assert_close_to_oracle, make_decode_problem

SMALL = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=4)
ONE = torch.ones(1)


def problem(device, lens=(5, 9, 3)):
    return make_decode_problem(list(lens), device=device, seed=3, **SMALL)


def with_bad_block(p):
    """The problem's tables with one block id outside the cache, in a block a sequence reads."""
    tables = p.block_tables.clone()
    tables[1, 1] = p.key_cache.size(0) + 100
    return tables


def write_args(device, num_tokens=3, num_blocks=6):
    """A cache write: keys and values for ``num_tokens`` tokens, two zeroed caches, their slots."""
    g = torch.Generator().manual_seed(5)
    key = torch.randn(num_tokens, 2, 16, generator=g).to(device)
    value = torch.randn(num_tokens, 2, 16, generator=g).to(device)
    key_cache = torch.zeros(num_blocks, 4, 2, 16, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 5, 9][:num_tokens], device=device)
    return key, value, key_cache, value_cache, slots


def scales(device):
    return ONE.to(device), ONE.to(device)


# --------------------------------------------------------------------------------------------
# 4. Safety flags: True or False, nothing that merely reads as false
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [None, 0, 0.0, "", 1, "yes"])
def test_check_ids_must_be_a_bool_in_every_decode_front_end(device, value):
    p = problem(device)
    tables = with_bad_block(p)
    q, k, v, _, sl, scale, _ = p.decode_args()
    out = torch.zeros_like(q)
    calls = {
        "shared check": lambda: args.block_tables_and_lens(tables, sl, num_seqs=3, block_size=4, num_blocks=k.size(0),
                                                           check_ids=value),
        "decode": lambda: paged_attention_decode(out, q, k, v, tables, sl, scale, check_ids=value),
        "decode, bounded": lambda: paged_attention_decode(out, q, k, v, tables, sl, scale, check_ids=value,
                                                          max_seq_len=9),
        "plan": lambda: DecodePlan(q, k, v, tables, sl, scale, out=out, check_ids=value),
        "prefill": lambda: paged_attention_prefill(out, q, k, v, tables, sl, torch.arange(4, device=device,
                                                   dtype=torch.int32), scale, max_query_len=1, check_ids=value),
        "v0 check": lambda: _call_v0(p, tables, value),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="check_ids must be True or False"):
            call()
        assert not out.any(), name
    with pytest.raises(ValueError, match="outside the cache"):           # True still checks
        paged_attention_decode(out, q, k, v, tables, sl, scale, check_ids=True)
    paged_attention_decode(out, q, k, v, p.block_tables, sl, scale, check_ids=False, max_seq_len=9)
    assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))


def _v0_call(p, tables):
    """``check_v0_attention``'s positional arguments for the problem, over ``tables``."""
    q, k, v, _, sl, scale, _ = p.decode_args()
    key_v0, value_v0 = ref.flash_to_v0(k, v)
    one = torch.ones(1, device=q.device)
    return (torch.zeros_like(q), q, key_v0, value_v0, k.size(2), tables, sl, k.size(1), 9, None, "auto", one, one,
            0), dict(scale=scale)


def _call_v0(p, tables, check_ids):
    positional, keywords = _v0_call(p, tables)
    return args.check_v0_attention(*positional, **keywords, check_ids=check_ids)


@pytest.mark.parametrize("value", [None, 0])
def test_check_slots_must_be_a_bool(device, value):
    key, value_, key_cache, value_cache, slots = write_args(device)
    with pytest.raises(TypeError, match="check_slots must be True or False"):
        triton_cache.reshape_and_cache_flash(key, value_, key_cache, value_cache, slots, "auto", *scales(device),
                                             check_slots=value)
    assert not key_cache.any() and not value_cache.any()


# --------------------------------------------------------------------------------------------
# 6. Plans: exotic tensors and absurd counts are refused before the launch
# --------------------------------------------------------------------------------------------

def test_a_decode_plan_refuses_meta_and_sparse_tensors(device):
    p = problem(device)
    q, k, v, bt, sl, scale, _ = p.decode_args()
    out = torch.zeros_like(q)
    plan = DecodePlan(q, k, v, bt, sl, scale, out=out, max_seq_len=9)
    refused = {
        "meta query": ((out, q.to("meta"), k, v, bt, sl), ValueError),
        "meta cache": ((out, q, k.to("meta"), v, bt, sl), ValueError),
        "meta out": ((out.to("meta"), q, k, v, bt, sl), ValueError),
        "sparse query": ((out, q.to_sparse(), k, v, bt, sl), TypeError),
        "sparse tables": ((out, q, k, v, bt.to_sparse(), sl), TypeError),
    }
    for name, (call, error) in refused.items():
        with pytest.raises(error):
            plan.run(*call)
        assert not out.any(), name
    for make in (lambda t: t.to("meta"), lambda t: t.to_sparse()):
        with pytest.raises((TypeError, ValueError)):
            DecodePlan(make(q), k, v, bt, sl, scale, out=out)
        with pytest.raises((TypeError, ValueError)):       # the unchecked path finds its plan by shapes
            paged_attention_decode(out, make(q), k, v, bt, sl, scale, check_ids=False, max_seq_len=9)
        with pytest.raises((TypeError, ValueError)):
            ref.ref_decode_attention(make(q), k, v, bt, sl, scale)
    assert not out.any()
    plan.run(out, q, k, v, bt, sl)
    assert_close_to_oracle(out, ref.ref_decode_attention(*p.decode_args()))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_seq_len=10**30), ValueError, "max_seq_len must be <="),
    (dict(max_seq_len=2**31), ValueError, "max_seq_len must be <="),
    (dict(max_seq_len=10**30, check_ids=False), ValueError, "max_seq_len must be <="),
    (dict(launch=(2**40, 4, 2)), ValueError, "TILE_N"),
    (dict(launch=(16, 3, 2)), ValueError, "num_warps"),
    (dict(launch=(16, 1, 10**6)), ValueError, "num_stages"),
    (dict(launch=(16, 1)), TypeError, "launch"),
])
def test_a_decode_plan_refuses_absurd_counts(device, kwargs, error, match):
    p = problem(device)
    q, k, v, bt, sl, scale, _ = p.decode_args()
    out = torch.zeros_like(q)
    with pytest.raises(error, match=match):
        DecodePlan(q, k, v, bt, sl, scale, out=out, **kwargs)
    with pytest.raises(error, match=match):
        paged_attention_decode(out, q, k, v, bt, sl, scale, **kwargs)
    assert not out.any()


def test_a_cache_write_plan_refuses_meta_and_sparse_tensors(device):
    key, value, key_cache, value_cache, slots = write_args(device)
    plan = CacheWritePlan(key, value, key_cache, value_cache, slots, "auto", *scales(device))
    for bad in ((key.to("meta"), value, key_cache, value_cache, slots),
                (key, value, key_cache.to("meta"), value_cache, slots),
                (key, value, key_cache, value_cache, slots.to_sparse())):
        with pytest.raises((TypeError, ValueError)):
            plan.run(*bad)
    assert not key_cache.any() and not value_cache.any()
    plan.run(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, 16)[slots], key)


# --------------------------------------------------------------------------------------------
# 7. Written tensors must not share memory
# --------------------------------------------------------------------------------------------

def _writers(device):
    """Every flash-layout cache write: reference, Triton checked, Triton unchecked (a kept plan)."""
    s = scales(device)
    return {
        "reference": lambda k, v, kc, vc, sl: ref.reshape_and_cache_flash(k, v, kc, vc, sl, "auto", *s),
        "triton": lambda k, v, kc, vc, sl: triton_cache.reshape_and_cache_flash(k, v, kc, vc, sl, "auto", *s),
        "triton unchecked": lambda k, v, kc, vc, sl: triton_cache.reshape_and_cache_flash(
            k, v, kc, vc, sl, "auto", *s, check_slots=False),
    }


def test_caches_that_share_memory_are_refused_by_every_cache_write(device):
    key, value, key_cache, value_cache, slots = write_args(device)
    for name, write in _writers(device).items():
        write(key, value, key_cache, value_cache, slots)           # a plan for these shapes is kept
        key_cache.zero_(), value_cache.zero_()
        buffer = torch.zeros(6 * 4 * 2 * 16 + 64, device=device)
        overlapping = buffer.as_strided((6, 4, 2, 16), (64, 32, 16, 1))     # a block is 128 elements
        other = torch.zeros(512, device=device).as_strided((6, 4, 2, 16), (64, 32, 16, 1))
        shifted = buffer.as_strided((6, 4, 2, 16), (128, 32, 16, 1), 64)    # half a block from the key's
        refused = {
            "one tensor as both caches": (key, value, key_cache, key_cache, slots),
            "overlapping blocks": (key, value, overlapping, other, slots),
            "caches half a block apart": (key, value, buffer[:768].view(6, 4, 2, 16), shifted, slots),
            "a key read from the cache written": (key_cache[0, :3], value, key_cache, value_cache, slots),
        }
        for case, call in refused.items():
            with pytest.raises(ValueError, match="share memory|must not share memory"):
                write(*call)
            assert not key_cache.any() and not value_cache.any() and not buffer.any(), (name, case)
        # One allocation cut block by block into a key half and a value half shares no element.
        kv = torch.zeros(6, 2, 4, 2, 16, device=device)
        write(key, value, kv[:, 0], kv[:, 1], slots)
        write(key, value, key_cache, value_cache, slots)
        assert torch.equal(kv[:, 0], key_cache) and torch.equal(kv[:, 1], value_cache), name
        assert key_cache.any()
        key_cache.zero_(), value_cache.zero_()


def test_a_cache_write_plan_checks_where_its_caches_are_on_every_run(device):
    key, value, key_cache, value_cache, slots = write_args(device)
    plan = CacheWritePlan(key, value, key_cache, value_cache, slots, "auto", *scales(device))
    with pytest.raises(ValueError, match="same memory"):
        plan.run(key, value, key_cache, key_cache, slots)
    assert not key_cache.any()
    kv = torch.zeros(6, 2, 4, 2, 16, device=device)
    plan_kv = CacheWritePlan(key, value, kv[:, 0], kv[:, 1], slots, "auto", *scales(device))
    for _ in range(2):                       # the second time, from the gaps it found apart
        plan_kv.run(key, value, kv[:, 0], kv[:, 1], slots)
        with pytest.raises(ValueError, match="same memory"):
            plan_kv.run(key, value, kv[:, 0], kv[:, 0], slots)
    assert torch.equal(kv[:, 0].reshape(-1, 2, 16)[slots], key)


def test_v0_cache_writes_and_block_copies_refuse_shared_memory(device):
    key, value, _, _, slots = write_args(device)
    s = scales(device)
    buffer = torch.zeros(6 * 2 * 16 * 4 * 2, device=device)
    key_v0 = buffer[:768].view(6, 2, 4, 4, 4)                # [blocks, heads, head_size / x, block, x]
    value_v0 = buffer[384:1152].view(6, 2, 16, 4)            # starts in the middle of the key cache
    with pytest.raises(ValueError, match="overlap in memory"):
        ref.reshape_and_cache(key, value, key_v0, value_v0, slots, "auto", *s)
    assert not buffer.any()
    ref.reshape_and_cache(key, value, key_v0, buffer[768:1536].view(6, 2, 16, 4), slots, "auto", *s)
    assert buffer.any()
    caches = [torch.randn(6, 4, 2, 16, device=device) for _ in range(2)]
    kept = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 2], [2, 3]])
    with pytest.raises(ValueError, match="same memory"):
        ref.copy_blocks([caches[0]], [caches[0]], mapping)
    with pytest.raises(ValueError, match="same memory"):
        ref.copy_blocks(caches, [caches[1], caches[0]], mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, kept))
    ref.copy_blocks([caches[0]], [caches[1]], mapping)
    assert torch.equal(caches[0][3], kept[0][2]) and torch.equal(caches[0][2], kept[0][1])


def test_an_output_whose_elements_overlap_is_refused(device):
    p = problem(device)
    q, k, v, bt, sl, scale, _ = p.decode_args()
    buffer = torch.zeros(q.numel(), device=device)
    overlapping = buffer.as_strided(tuple(q.shape), (16, 16, 1))        # every sequence's heads collide
    with pytest.raises(ValueError, match="must not share memory"):
        paged_attention_decode(overlapping, q, k, v, bt, sl, scale)
    assert not buffer.any()


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(6, 4, 2, 16),                                   # NHD
    lambda: torch.zeros(6, 2, 4, 16).permute(0, 2, 1, 3),               # HND
    lambda: torch.zeros(6, 2, 4, 2, 16)[:, 1],                          # half of a fused K/V block
    lambda: torch.zeros(6, 4, 2, 32)[..., ::2],                         # every other element
    lambda: torch.zeros(12, 4, 2, 16)[::2],                             # every other block
    lambda: torch.zeros(0, 4, 2, 16),                                   # empty
    lambda: torch.zeros(6, 1, 1, 16).expand(6, 1, 1, 16),               # size-1 dimensions
])
def test_views_that_do_not_overlap_pass_the_overlap_check(make):
    t = make()
    args.no_broadcast_dims("cache", t)
    assert args._dims_apart(t.shape, t.stride())
    offsets = sum(torch.arange(n).view([-1 if d == i else 1 for d in range(t.dim())]) * st
                  for i, (n, st) in enumerate(zip(t.shape, t.stride())))
    assert torch.as_tensor(offsets).flatten().unique().numel() == t.numel()     # truly apart


@pytest.mark.parametrize("shape, strides", [
    ((6, 4, 2, 16), (64, 32, 16, 1)), ((4, 4), (1, 2)), ((3, 5), (4, 1)), ((2, 3), (2, 1)),
])
def test_views_that_overlap_fail_the_overlap_check(shape, strides):
    t = torch.zeros(2000).as_strided(shape, strides)
    offsets = sum(torch.arange(n).view([-1 if d == i else 1 for d in range(t.dim())]) * st
                  for i, (n, st) in enumerate(zip(shape, strides)))
    assert offsets.flatten().unique().numel() < t.numel()                    # truly overlapping
    with pytest.raises(ValueError, match="must not share memory"):
        args.no_broadcast_dims("cache", t)
