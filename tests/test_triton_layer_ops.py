"""The model's fused Triton kernels (kernels/triton/layer_ops.py) against the torch lines they
replace, and the fused forward against the unfused one. Interpreted on a CPU, compiled on a GPU."""
from __future__ import annotations

import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels.triton.layer_ops import add_rms_norm, rotary_, silu_and_mul
from paged_attention.model import LlamaConfig, LlamaForCausalLM, random_weights
from paged_attention.model.llama import RotaryEmbedding, rms_norm
from tests.conftest import dtype_params

DEV = runtime.DEVICE


def _tol(dtype: torch.dtype) -> dict:
    # fp32: only the order of the mean's sum differs; half types: one rounding step of the output.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_torch(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 72, generator=g).to(DEV, dtype)          # 72: not a power of two (masked columns)
    r = torch.randn(5, 72, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(72, generator=g)).to(DEV, dtype)
    r_before = r.clone()
    out = add_rms_norm(x, w, 1e-5, r if with_residual else None)
    h = x + r_before if with_residual else x
    torch.testing.assert_close(out, rms_norm(h, w, 1e-5), **_tol(dtype))
    if with_residual:
        assert torch.equal(r, h)                 # the sum went into the residual, rounded as torch rounds it
    else:
        assert torch.equal(r, r_before)


@pytest.mark.parametrize("dtype", dtype_params())
def test_rotary_in_place_on_a_strided_view_equals_torch(dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 3, 1, 16
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim, generator=g).to(DEV, dtype)
    positions = torch.tensor([0, 1, 7, 30, 2, 63], device=DEV)
    rope = RotaryEmbedding(dim, 64, 10000.0, DEV)
    qk = qkv[:, :(heads + kv_heads) * dim].view(6, heads + kv_heads, dim)
    want = rope(positions, qk.clone())
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    rotary_(qk, rope.cos_sin, positions)
    torch.testing.assert_close(qk, want, **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)    # the value columns untouched


@pytest.mark.parametrize("dtype", dtype_params())
def test_silu_and_mul_equals_torch(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 2 * 1200, generator=g).to(DEV, dtype)     # 1200: two column blocks, the second masked
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(x)
    assert got.shape == (4, 1200)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # Gate and up are not interchangeable: swapping the halves must change the result.
    assert not torch.allclose(silu_and_mul(torch.cat([up, gate], dim=-1)), want, **_tol(dtype))


def test_bad_shapes_are_refused():
    x = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError):
        add_rms_norm(x.t(), torch.ones(4, device=DEV), 1e-5)
    with pytest.raises(ValueError):
        add_rms_norm(x, torch.ones(8, device=DEV), 1e-5, torch.zeros(4, 9, device=DEV))
    with pytest.raises(ValueError):
        silu_and_mul(torch.zeros(4, 7, device=DEV))             # odd width: no gate/up halves
    with pytest.raises(ValueError):
        silu_and_mul(torch.zeros(8, 4, device=DEV).t())         # not contiguous
    rope = RotaryEmbedding(12, 8, 10000.0, DEV)
    with pytest.raises(ValueError, match="power of two"):
        rotary_(torch.zeros(2, 1, 12, device=DEV), rope.cos_sin, torch.zeros(2, dtype=torch.long, device=DEV))


def test_fused_forward_equals_unfused():
    """The tiny model, one prefill and one decode step, with the fused kernels forced on (the
    interpreter runs them on a CPU) against the plain torch path."""
    from tests.test_model import Pager

    config = LlamaConfig.tiny()
    weights = random_weights(config, seed=3)
    outs = []
    for fused in (False, True):
        model = LlamaForCausalLM(config, weights, attention="triton", device=DEV)
        model.fused = fused
        pager = Pager(model, 16, 8, seed=0)
        first = pager.step([("a", list(range(11))), ("b", list(range(20, 33)))])
        second = pager.step([("a", [5]), ("b", [6])])
        outs.append((first, second))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=1e-4, rtol=1e-4)
