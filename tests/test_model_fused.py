"""The model's layer operations chosen once (model/layer_ops.py): the fused Triton set against the
plain torch set, operation by operation, and the rotary embedding fused with the cache write
(kernels/triton/layer_ops.rotary_and_cache_) against the rotation followed by the reference cache
write. Interpreted on a CPU (tiny shapes, fp32 and fp16), compiled on a GPU."""
from __future__ import annotations

import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels import reference
from paged_attention.kernels.triton.layer_ops import rotary_and_cache_
from paged_attention.model import LlamaConfig, LlamaForCausalLM, random_weights
from paged_attention.model.attention import PagedAttention
from paged_attention.model.layer_ops import FusedLayerOps, RotaryEmbedding, TorchLayerOps
from tests.conftest import dtype_params

DEV = runtime.DEVICE
HEADS, KV_HEADS, DIM = 4, 2, 16
CONFIG = LlamaConfig.tiny()


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


def _caches(dtype: torch.dtype, layout: str, num_blocks: int = 6, block_size: int = 4):
    """Key and value caches [num_blocks, block_size, kv_heads, D] filled with a marker value, in NHD
    memory or HND memory (the same logical shape, other strides)."""
    shape = (num_blocks, block_size, KV_HEADS, DIM)
    if layout == "HND":
        make = lambda: torch.full((num_blocks, KV_HEADS, block_size, DIM), 7.0, dtype=dtype, device=DEV).transpose(1, 2)  # noqa: E731
    else:
        make = lambda: torch.full(shape, 7.0, dtype=dtype, device=DEV)  # noqa: E731
    return make(), make()


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rotary_and_cache_equals_rotary_then_write(dtype, layout):
    g = torch.Generator().manual_seed(0)
    tokens = 5
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(DEV, dtype)
    positions = torch.tensor([0, 3, 9, 17, 30], device=DEV)
    slots = torch.tensor([5, -1, 0, 23, 12], device=DEV)                # token 1 is padding: no write
    rope = RotaryEmbedding(DIM, 64, 10000.0, DEV)
    # Unfused: rotate queries and keys, then the reference cache write.
    want_kc, want_vc = _caches(dtype, layout)
    qk = rope(positions, qkv[:, :(HEADS + KV_HEADS) * DIM].reshape(tokens, HEADS + KV_HEADS, DIM).clone())
    v = qkv[:, (HEADS + KV_HEADS) * DIM:].reshape(tokens, KV_HEADS, DIM)
    one = torch.ones(1, device=DEV)
    reference.reshape_and_cache_flash(qk[:, HEADS:].contiguous(), v.contiguous(), want_kc, want_vc, slots, "auto",
                                      one, one)
    # Fused.
    kc, vc = _caches(dtype, layout)
    v_before = qkv[:, (HEADS + KV_HEADS) * DIM:].clone()
    q = rotary_and_cache_(qkv, rope.cos_sin, positions, slots, kc, vc, HEADS, KV_HEADS)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (tokens, HEADS, DIM)   # rotated in place
    torch.testing.assert_close(q, qk[:, :HEADS], **_tol(dtype))
    torch.testing.assert_close(kc, want_kc, **_tol(dtype))
    assert torch.equal(vc, want_vc)                                     # values are copied exactly
    assert torch.equal(qkv[:, (HEADS + KV_HEADS) * DIM:], v_before)
    # The padding token's slot is untouched in both (every other slot too).
    untouched = torch.ones(6 * 4, dtype=torch.bool)
    untouched[[5, 0, 23, 12]] = False
    assert (kc.reshape(24, -1)[untouched.to(DEV)] == 7).all() and (vc.reshape(24, -1)[untouched.to(DEV)] == 7).all()


def test_rotary_and_cache_refuses_bad_shapes_before_writing():
    rope = RotaryEmbedding(DIM, 64, 10000.0, DEV)
    kc, vc = _caches(torch.float32, "NHD")
    qkv = torch.zeros(3, (HEADS + 2 * KV_HEADS) * DIM, device=DEV)
    pos, slots = torch.zeros(3, dtype=torch.long, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV)
    bad = [
        (qkv[:, :-DIM], pos, slots, kc, vc),                            # a head missing
        (qkv.t().contiguous().t(), pos, slots, kc, vc),                 # rows not contiguous
        (qkv, pos[:2], slots, kc, vc),                                  # a position missing
        (qkv, pos, slots, kc.half(), vc),                               # cache dtype differs
        (qkv, pos, slots, kc[:, :, :1], vc[:, :, :1]),                  # wrong number of KV heads
    ]
    for args in bad:
        with pytest.raises(ValueError):
            rotary_and_cache_(args[0], rope.cos_sin, args[1], args[2], args[3], args[4], HEADS, KV_HEADS)
    assert (kc == 7).all() and (vc == 7).all()


@pytest.mark.parametrize("dtype", dtype_params())
def test_fused_layer_ops_equal_torch_ones(dtype):
    """Each operation of the fused set against the torch set, on the same inputs (a planted swap of
    gate and up is told apart)."""
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(CONFIG.head_dim, 64, CONFIG.rope_theta, DEV)
    attn = PagedAttention("reference", CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim, DEV)
    ops = TorchLayerOps(CONFIG, rope, attn), FusedLayerOps(CONFIG, rope, attn)
    x = torch.randn(5, CONFIG.hidden_size, generator=g).to(DEV, dtype)
    r = torch.randn(5, CONFIG.hidden_size, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(CONFIG.hidden_size, generator=g)).to(DEV, dtype)
    (n0, r0), (n1, r1) = ops[0].add_norm(x, r.clone(), w), ops[1].add_norm(x, r.clone(), w)
    torch.testing.assert_close(n1, n0, **_tol(dtype))
    assert torch.equal(r1, r0)                                          # the residual stream, exactly
    (n0, r0), (n1, r1) = ops[0].add_norm(x, None, w), ops[1].add_norm(x, None, w)
    torch.testing.assert_close(n1, n0, **_tol(dtype))
    assert r0 is x and r1 is x
    gate_up = torch.randn(5, 2 * CONFIG.intermediate_size, generator=g).to(DEV, dtype)
    torch.testing.assert_close(ops[1].silu_and_mul(gate_up), ops[0].silu_and_mul(gate_up), **_tol(dtype))
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)
    assert not torch.allclose(ops[1].silu_and_mul(swapped), ops[0].silu_and_mul(gate_up), **_tol(dtype))
    # The rotary embedding with the cache write, through each set's own path.
    positions = torch.tensor([1, 2, 40, 7, 0], device=DEV)
    slots = torch.tensor([3, 9, -1, 0, 17], device=DEV)
    width = (CONFIG.num_attention_heads + 2 * CONFIG.num_key_value_heads) * CONFIG.head_dim
    qkv = torch.randn(5, width, generator=g).to(DEV, dtype)
    results = []
    for op in ops:
        kv = tuple(torch.zeros(5, 4, CONFIG.num_key_value_heads, CONFIG.head_dim, dtype=dtype, device=DEV)
                   for _ in range(2))
        q = op.rope_and_cache(qkv.clone(), op.rope_inputs(positions), kv, slots)
        results.append((q, *kv))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **_tol(dtype))


def test_layer_ops_are_chosen_once_and_follow_the_settings():
    weights = random_weights(CONFIG, seed=2)
    cpu = LlamaForCausalLM(CONFIG, weights, attention="reference")
    assert isinstance(cpu.ops, TorchLayerOps) and not cpu.fused
    forced = LlamaForCausalLM(CONFIG, weights, attention="reference", fused=True)
    assert isinstance(forced.ops, FusedLayerOps) and forced.fused
    forced.fused = False
    assert isinstance(forced.ops, TorchLayerOps)
    with pytest.raises(TypeError):
        LlamaForCausalLM(CONFIG, weights, fused="yes")
    with pytest.raises(ValueError, match="power of two"):
        LlamaForCausalLM(LlamaConfig.tiny(head_dim=12, hidden_size=48), random_weights(
            LlamaConfig.tiny(head_dim=12, hidden_size=48)), fused=True)


@pytest.mark.parametrize("dtype", dtype_params())
def test_decode_steps_rotate_and_write_inside_the_attention_kernel(dtype):
    """With Triton's attention, the fused ops hand a decode step's rotary embedding and cache write
    to the decode kernel (no rotary launch: counted), a prefill's to the rotary kernel; the torch
    ops rotate, write, then call the same decode kernel. Same logits at every step."""
    from tests.test_model import Pager
    if dtype == torch.bfloat16 and DEV.type != "cuda":
        pytest.skip("the interpreter has no bfloat16")
    weights = random_weights(CONFIG, seed=7)
    models = [LlamaForCausalLM(CONFIG, weights, attention="triton", dtype=dtype, device=DEV, fused=f)
              for f in (False, True)]
    assert models[1].attn.fuses_rope and isinstance(models[1].ops, FusedLayerOps)
    ops, calls = models[1].ops, []
    rope_and_cache = ops.rope_and_cache
    ops.rope_and_cache = lambda qkv, *a: calls.append(qkv.size(0)) or rope_and_cache(qkv, *a)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (9, 5)]
    steps = [[("a", prompts[0]), ("b", prompts[1])], [("a", [3]), ("b", [7])], [("a", [1]), ("b", [2])], [("b", [4])]]
    pagers = [Pager(m, 16, 4, seed=2) for m in models]
    for work in steps:
        want, got = (p.step(work) for p in pagers)
        torch.testing.assert_close(got, want, **(dict(atol=1e-4, rtol=0) if dtype == torch.float32 else
                                                 dict(atol=5e-2, rtol=2e-2)))
    assert calls == [14] * CONFIG.num_hidden_layers          # the prefill's 14 tokens, once a layer
    # The caches hold the same keys and values either way.
    for (k0, v0), (k1, v1) in zip(pagers[0].kv_caches, pagers[1].kv_caches):
        torch.testing.assert_close(k1, k0, **_tol(dtype))
        torch.testing.assert_close(v1, v0, **_tol(dtype))
