"""The norm-and-projection kernel (kernels/triton/fused_linear.py) against a float64 reference of
the same arithmetic, the layer operations built on it (model/layer_ops.py) against the torch set,
and the whole model with them against the model without. Interpreted on a CPU (tiny shapes, fp32
and fp16), compiled on a GPU (bf16 too)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels.triton import fused_linear
from paged_attention.kernels.triton.fused_linear import FusedLinearConfig, linear, linear_add, norm_linear
from paged_attention.model import LlamaConfig, LlamaForCausalLM, random_weights
from paged_attention.model.attention import PagedAttention
from paged_attention.model.layer_ops import FusedLayerOps, ResidualStream, RotaryEmbedding, TorchLayerOps
from tests.conftest import dtype_params

DEV = runtime.DEVICE
EPS = 1e-5
CONFIG = LlamaConfig.tiny()


def _inputs(M: int, N: int, K: int, dtype: torch.dtype, silu: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    residual = torch.randn(M, K, generator=g).to(DEV, dtype)
    norm_weight = (1 + 0.2 * torch.randn(K, generator=g)).to(DEV, dtype)
    weight = (torch.randn(2 * N if silu else N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    return x, residual, norm_weight, weight


def _reference(x, norm_weight, weight, residual, silu):
    """The arithmetic of the unfused path in float64, rounding to the dtype where it does: the
    stream, the normalised value, its product with the norm weight (the GEMM's input ``a``), and
    with SwiGLU the projection's outputs and silu. Returns ``(out, stream, a)``, ``out`` in float64
    before its last rounding."""
    dt = x.dtype
    h = x if residual is None else (x.double() + residual.double()).to(dt)     # exact, then one rounding
    hd = h.double()
    y = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS)).to(dt)
    a = (y.double() * norm_weight.double()).to(dt)
    out = a.double() @ weight.double().T
    if silu:
        gate, up = out.to(dt).double().chunk(2, dim=-1)
        act = (gate * torch.sigmoid(gate)).to(dt).double()
        out = act * up
    return out, h, a


def _check(out, stream, x, norm_weight, weight, residual, silu):
    """AssertionError unless ``out`` and ``stream`` are what the fused kernel must give.

    The stream is exact: one rounding of an exact sum, as torch's add. The output may differ from
    the float64 reference only by what float32 and the dtype's roundings allow. With ``u`` the
    dtype's unit roundoff (half its machine epsilon) and ``S = |a| @ |W|^T`` (per output), the
    kernel's ``a`` may sit one rounding away from the reference's (its norm is taken in float32, so
    a value near a rounding boundary can fall on the other side, twice: ``y`` and ``y * w``), which
    moves the dot product by at most ``4u * S``; the float32 accumulation of K products adds at most
    ``K * 2^-24 * S``; the final rounding ``u * |out|``. With SwiGLU the bound of each projection's
    output (plus its rounding) goes through silu (slope below 1.1) and the product, then two more
    roundings (silu's and the product's).
    """
    want, want_stream, a = _reference(x, norm_weight, weight, residual, silu)
    assert stream.dtype == x.dtype and torch.equal(stream, want_stream), "the residual stream is wrong"
    u = torch.finfo(x.dtype).eps / 2
    K = x.size(1)
    proj = a.double() @ weight.double().T
    S = a.double().abs() @ weight.double().abs().T
    err = S * (4 * u + K * 2.0 ** -24) + u * proj.abs()
    if silu:
        gate, up = proj.to(x.dtype).double().chunk(2, dim=-1)
        e_gate, e_up = err.chunk(2, dim=-1)
        e_gate, e_up = e_gate + u * gate.abs(), e_up + u * up.abs()     # the roundings to the dtype
        act = (gate * torch.sigmoid(gate)).double()
        e_act = 1.1 * e_gate + u * act.abs() + 1e-300
        err = (act.abs() + e_act) * e_up + up.abs() * e_act + u * (act * up).abs()
    bound = err + u * want.abs() + 1e-300
    assert out.shape == want.shape and out.dtype == x.dtype
    excess = (out.double() - want).abs() / bound
    assert excess.max() <= 1, f"the output is off by {excess.max():.3g}x the error bound"


# --------------------------------------------------------------------------------------------
# The kernel against the float64 reference
# --------------------------------------------------------------------------------------------

# (N, K): multiples of the tiles, and not (K=72 ends in a part-filled chunk of 64, N=40 a
# part-filled column tile).
SHAPES = [(32, 64), (40, 72)]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu_and_mul"])
def test_norm_linear_equals_reference(dtype, M, N, K, silu):
    x, residual, norm_weight, weight = _inputs(M, N, K, dtype, silu, seed=M)
    before = residual.clone()
    act = "silu_and_mul" if silu else None
    out, stream = norm_linear(x, norm_weight, weight, EPS, residual, act=act)
    _check(out, stream, x, norm_weight, weight, residual, silu)
    assert torch.equal(residual, before)                    # only read: the sum is a new tensor
    # Without a residual (a model's first layer): the norm of x, and x itself is the stream.
    out, stream = norm_linear(x, norm_weight, weight, EPS, act=act)
    assert stream is x
    _check(out, stream, x, norm_weight, weight, None, silu)


@pytest.mark.parametrize("dtype", dtype_params())
def test_tiles_of_every_size_give_the_same_answer(dtype):
    """Several row tiles, several column tiles, K in several chunks or one, on the tensor cores or
    the CUDA cores: the stream is written once by the first column tile, whatever the tiling."""
    x, residual, norm_weight, weight = _inputs(37, 48, 80, dtype, silu=True)
    configs = [FusedLinearConfig(16, 16, 16), FusedLinearConfig(32, 64, 128), FusedLinearConfig(64, 32, 32),
               # The CUDA-core product: one row, several; K in one chunk, in several.
               FusedLinearConfig(1, 16, 128, 4, 1), FusedLinearConfig(4, 8, 32), FusedLinearConfig(8, 1, 16),
               # Two first chunks (K = 80 as 64 + 16; 32 + 16 and a loop for the rest; 32 + 32, masked),
               # on the tensor cores and the CUDA cores.
               FusedLinearConfig(16, 16, 64, 4, 1, 16), FusedLinearConfig(16, 32, 32, 4, 2, 16),
               FusedLinearConfig(32, 16, 32, 4, 1, 32), FusedLinearConfig(4, 8, 64, 4, 1, 16),
               FusedLinearConfig(1, 16, 32, 4, 1, 16)]
    for config in configs:
        out, stream = norm_linear(x, norm_weight, weight, EPS, residual, act="silu_and_mul", config=config)
        _check(out, stream, x, norm_weight, weight, residual, True)


@pytest.mark.parametrize("dtype", dtype_params())
def test_plain_linear_equals_float64(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 72, generator=g).to(DEV, dtype)
    w = (torch.randn(40, 72, generator=g) / 8).to(DEV, dtype)
    want = x.double() @ w.double().T
    u = torch.finfo(dtype).eps / 2
    bound = (x.double().abs() @ w.double().abs().T) * 72 * 2.0 ** -24 + u * want.abs()
    assert ((linear(x, w).double() - want).abs() <= bound).all()


def test_strides_are_honoured():
    """Views (a column slice, a transposed weight, every other row of a residual) give what the
    kernel must give on contiguous tensors, on the tensor cores and on the CUDA cores (one row
    and several, K in one chunk and in several). In the interpreter they give exactly what the
    contiguous copies give; compiled, a transposed weight gets other loads and another order of
    the float32 sums, so there the check is the float64 bound (and the stream, exact)."""
    x, residual, norm_weight, weight = _inputs(6, 24, 40, torch.float32, silu=True)
    wide = torch.randn(6, 50, device=DEV)
    wide[:, 5:45] = x
    tall = torch.randn(12, 40, device=DEV)
    tall[::2] = residual
    views = dict(x=wide[:, 5:45], residual=tall[::2], weight=weight.t().contiguous().t(),
                 norm_weight=torch.stack([norm_weight, norm_weight], 1)[:, 0])
    assert not any(v.is_contiguous() for v in views.values())
    for config in (None, FusedLinearConfig(1, 8, 64, 4, 1), FusedLinearConfig(2, 4, 16, 4, 1),
                   FusedLinearConfig(1, 8, 32, 4, 1, 16)):
        got = norm_linear(views["x"], views["norm_weight"], views["weight"], EPS, views["residual"],
                          act="silu_and_mul", config=config)
        _check(*got, x, norm_weight, weight, residual, True)
        if runtime.TRITON_INTERPRET:
            want = norm_linear(x, norm_weight, weight, EPS, residual, act="silu_and_mul", config=config)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------------------------
# The residual add behind a projection, and the norm from its sums of squares
# --------------------------------------------------------------------------------------------

def _check_linear_add(out, sum_sq, x, weight, residual, config):
    """The stream ``residual + F.linear(x, weight)``: within the float32 accumulation and the two
    roundings of the float64 value (the projection's, the sum's) ; and the pieces: one per column
    tile, adding up to each row's sum of squares of what was stored."""
    u = torch.finfo(x.dtype).eps / 2
    proj = x.double() @ weight.double().T
    bound = (x.double().abs() @ weight.double().abs().T) * (x.size(1) * 2.0 ** -24 + u) \
        + u * (proj + residual.double()).abs() + 2 * u * proj.abs() + 1e-300
    assert out.dtype == x.dtype and ((out.double() - proj - residual.double()).abs() <= bound).all()
    tiles = -(-weight.size(0) // (config or fused_linear.default_config(*out.shape, x.size(1))).BLOCK_N)
    assert sum_sq.shape == (out.size(0), tiles) and sum_sq.dtype == torch.float32
    squares = out.double().pow(2).sum(1)
    assert ((sum_sq.double().sum(1) - squares).abs() <= 1e-5 * squares + 1e-30).all()


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("M", [1, 3, 17])
def test_linear_add_and_the_norm_from_its_sums(dtype, M):
    """``linear_add`` against float64, on the CUDA cores and the tensor cores, one column tile or
    many; then ``norm_linear(sum_sq=...)`` of its stream gives what the two-pass norm gives."""
    x, _, _, weight = _inputs(M, 40, 72, dtype, seed=M)
    residual = torch.randn(M, 40, generator=torch.Generator().manual_seed(9)).to(DEV, dtype)
    norm_weight, gate_up = _inputs(M, 24, 40, dtype, silu=True, seed=M + 1)[2:]
    before = residual.clone()
    for config in (None, FusedLinearConfig(1, 8, 64, 4, 1), FusedLinearConfig(4, 16, 32), FusedLinearConfig(16, 16, 16),
                   FusedLinearConfig(16, 64, 128), FusedLinearConfig(16, 16, 64, 4, 1, 16),
                   FusedLinearConfig(2, 8, 32, 4, 2, 16)):
        out, sum_sq = linear_add(x, weight, residual, config=config)
        _check_linear_add(out, sum_sq, x, weight, residual, config)
        assert torch.equal(residual, before)                    # only read
        norm_config = None if config is None or not config.BLOCK_K2 else config._replace(BLOCK_K=32)
        got, stream = norm_linear(out, norm_weight, gate_up, EPS, act="silu_and_mul", sum_sq=sum_sq,
                                  config=norm_config)
        assert stream is out
        _check(got, stream, out, norm_weight, gate_up, None, True)
    # Views: every other row of the residual, a column slice of x, the pieces as a column slice.
    tall = torch.zeros(2 * M, 40, dtype=dtype, device=DEV)
    tall[::2] = residual
    wide = torch.zeros(M, 80, dtype=dtype, device=DEV)
    wide[:, 3:75] = x
    out, sum_sq = linear_add(wide[:, 3:75], weight, tall[::2])
    _check_linear_add(out, sum_sq, x, weight, residual, None)
    pieces = torch.zeros(M, sum_sq.size(1) + 3, device=DEV)
    pieces[:, 1:-2] = sum_sq
    got, _ = norm_linear(out, norm_weight, gate_up, EPS, act="silu_and_mul", sum_sq=pieces[:, 1:-2])
    _check(got, out, out, norm_weight, gate_up, None, True)


def test_linear_add_check_fails_on_planted_bugs():
    """The residual not added, the pieces of another row, a piece dropped: each caught."""
    x, _, _, weight = _inputs(5, 40, 72, torch.float32, seed=2)
    residual = torch.randn(5, 40, generator=torch.Generator().manual_seed(4)).to(DEV)
    out, sum_sq = linear_add(x, weight, residual)
    _check_linear_add(out, sum_sq, x, weight, residual, None)
    plain = linear(x, weight)
    for bad in ((plain, (plain.double() ** 2).sum(1, keepdim=True).float().expand_as(sum_sq) / sum_sq.size(1)),
                (out, sum_sq.roll(1, dims=0)), (out, torch.cat([sum_sq[:, 1:], sum_sq[:, :1] * 0], 1))):
        with pytest.raises(AssertionError):
            _check_linear_add(*bad, x, weight, residual, None)
    # A norm fed the wrong pieces is off too.
    norm_weight, gate_up = _inputs(5, 24, 40, torch.float32, silu=True, seed=3)[2:]
    got, _ = norm_linear(out, norm_weight, gate_up, EPS, act="silu_and_mul", sum_sq=sum_sq.roll(1, dims=0))
    with pytest.raises(AssertionError):
        _check(got, out, out, norm_weight, gate_up, None, True)


def test_linear_add_and_sum_sq_refuse_bad_input():
    x, residual, norm_weight, weight = _inputs(4, 16, 32, torch.float32)
    add = torch.randn(4, 16, device=DEV)
    for error, call in [
        (TypeError, lambda: linear_add(x, weight, add.half())),
        (ValueError, lambda: linear_add(x, weight, add[:, :-1])),
        (ValueError, lambda: linear_add(x, weight, add[0])),
        (TypeError, lambda: linear_add(x, weight, add.tolist())),
    ]:
        with pytest.raises(error):
            call()
    sums = torch.ones(4, 2, device=DEV)
    for error, kw in [
        (TypeError, dict(sum_sq=sums.double())),
        (ValueError, dict(sum_sq=sums[:-1])),
        (ValueError, dict(sum_sq=sums[:, :0])),
        (ValueError, dict(sum_sq=sums[0])),
        (ValueError, dict(sum_sq=sums, residual=residual)),              # x is the whole stream then
    ]:
        with pytest.raises(error):
            norm_linear(x, norm_weight, weight, EPS, **kw)


# --------------------------------------------------------------------------------------------
# The check can fail: planted bugs
# --------------------------------------------------------------------------------------------

def _planted(bug, x, residual, norm_weight, weight):
    """What a kernel with ``bug`` would return (the real kernel, run in a wrong configuration)."""
    silu = "silu_and_mul"
    N = weight.size(0) // 2
    if bug == "norm skipped":
        stream = (x + residual)
        return linear(stream, weight, act=silu), stream
    if bug == "residual not added":
        out, _ = norm_linear(x, norm_weight, weight, EPS, act=silu)
        return out, x + residual
    if bug == "stream not written":
        out, _ = norm_linear(x, norm_weight, weight, EPS, residual, act=silu)
        return out, residual.clone()
    if bug == "stream rows shifted":
        out, stream = norm_linear(x, norm_weight, weight, EPS, residual, act=silu)
        return out, stream.roll(1, dims=0)
    if bug == "gate and up swapped":
        swapped = torch.cat([weight[N:], weight[:N]])
        return norm_linear(x, norm_weight, swapped, EPS, residual, act=silu)
    if bug == "tf32 inputs":
        # float32 inputs cut to TF32's 10-bit mantissa, what tl.dot does by default on a GPU.
        def tf32(t):
            return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)
        out, stream = norm_linear(tf32(x), tf32(norm_weight), tf32(weight), EPS, tf32(residual), act=silu)
        return out, (x + residual)
    raise AssertionError(bug)


@pytest.mark.parametrize("bug", ["norm skipped", "residual not added", "stream not written",
                                 "stream rows shifted",
                                 "gate and up swapped", "tf32 inputs"])
def test_check_fails_on_a_planted_bug(bug):
    x, residual, norm_weight, weight = _inputs(17, 40, 72, torch.float32, silu=True, seed=5)
    out, stream = _planted(bug, x, residual, norm_weight, weight)
    with pytest.raises(AssertionError):
        _check(out, stream, x, norm_weight, weight, residual, True)
    # The same check passes the real kernel on the same inputs.
    _check(*norm_linear(x, norm_weight, weight, EPS, residual, act="silu_and_mul"),
           x, norm_weight, weight, residual, True)


# --------------------------------------------------------------------------------------------
# Bad input: a typed error before any launch
# --------------------------------------------------------------------------------------------

def test_bad_input_is_refused_before_launch():
    x, residual, norm_weight, weight = _inputs(4, 16, 32, torch.float32)
    before = residual.clone()
    bad = [
        (TypeError, dict(weight=weight.half())),                          # dtypes differ
        (TypeError, dict(residual=residual.half())),
        (TypeError, dict(norm_weight=norm_weight.double())),
        (TypeError, dict(x=x.long(), weight=weight.long(), residual=residual.long(),
                         norm_weight=norm_weight.long())),                # not a float type
        (TypeError, dict(x=x.tolist())),                                  # not a tensor
        (ValueError, dict(weight=weight[:, :-1])),                        # K differs
        (ValueError, dict(residual=residual[:-1])),                       # rows differ
        (ValueError, dict(norm_weight=norm_weight[:-1])),
        (ValueError, dict(x=x[0])),                                       # not 2-D
        (ValueError, dict(weight=weight[:-1], act="silu_and_mul")),       # odd gate/up rows
        (ValueError, dict(act="gelu")),
        (ValueError, dict(eps=-1.0)),
        (TypeError, dict(config=(16, 16, 16))),
        (ValueError, dict(config=FusedLinearConfig(16, 8, 16))),          # below tl.dot's tile
        (ValueError, dict(config=FusedLinearConfig(3, 16, 16))),          # not a power of two
        (ValueError, dict(config=FusedLinearConfig(1, 4, 8))),            # a K chunk below 16
        (ValueError, dict(config=FusedLinearConfig(1, 4, 16, 3))),        # 3 warps
        (ValueError, dict(config=FusedLinearConfig(16, 48, 16))),         # not a power of two
        (ValueError, dict(config=FusedLinearConfig(16, 16, 16, 4, 1, 8))),   # a second chunk below 16
        (ValueError, dict(config=FusedLinearConfig(16, 16, 16, 4, 1, 48))),  # not a power of two
        (ValueError, dict(config=FusedLinearConfig(16, 16, 16, 4, 1, True))),
    ]
    for error, change in bad:
        kw = dict(x=x, norm_weight=norm_weight, weight=weight, eps=EPS, residual=residual)
        kw.update(change)
        with pytest.raises(error):
            norm_linear(**kw)
        assert torch.equal(residual, before), change
    with pytest.raises(TypeError):
        linear(x, weight.half())


# --------------------------------------------------------------------------------------------
# The layer operations and the model
# --------------------------------------------------------------------------------------------

def _ops():
    rope = RotaryEmbedding(CONFIG.head_dim, 64, CONFIG.rope_theta, DEV)
    attn = PagedAttention("reference", CONFIG.num_attention_heads, CONFIG.num_key_value_heads, CONFIG.head_dim, DEV)
    return TorchLayerOps(CONFIG, rope, attn), FusedLayerOps(CONFIG, rope, attn)


def test_projections_given_weights_to_prefetch_compute_the_same():
    """``prefetch=`` is a hint: the fused ops (the prefetch compiled in where kernels launch with
    PDL, left out elsewhere: Triton's interpreter has no prefetch) give bit for bit what they give
    without it, and the torch ops take it and ignore it. On a GPU with PDL the prefetching launch is
    another compiled kernel (its own launcher)."""
    from paged_attention.kernels.triton import pdl
    torch_ops, fused_ops = _ops()
    fused_ops.small_batch, fused_ops.prefetch_rows = 64, (1, 64)
    dtype = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    x, residual, norm_weight, w = _inputs(16, 48, CONFIG.hidden_size, dtype)
    later = torch.randn(3 * CONFIG.hidden_size, CONFIG.hidden_size).to(DEV, dtype)
    stream = ResidualStream(x, residual)
    want, got = fused_ops.norm_linear(stream, norm_weight, w), fused_ops.norm_linear(stream, norm_weight, w,
                                                                                     prefetch=later)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(torch_ops.norm_linear(stream, norm_weight, w, prefetch=later)[0], want[0], **tol)
    down = torch.randn(CONFIG.hidden_size, 48).to(DEV, dtype)
    want, got = fused_ops.linear_add(want[0], down, x), fused_ops.linear_add(want[0], down, x, prefetch=later)
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.sum_sq, want.sum_sq)
    numels = {key[-2] for key in fused_ops._linear_launchers}
    assert numels == ({0, later.numel()} if pdl.enabled(DEV) else {0})


@pytest.mark.parametrize("dtype", dtype_params())
def test_fused_norm_linear_ops_equal_torch_ones(dtype):
    """Both operations, on tiny-model shapes, on both sides of ``small_batch``, with and without a
    residual, through the fixed-stride launch and (views) the checked front-end."""
    torch_ops, fused_ops = _ops()
    fused_ops.small_batch = 8
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    hidden, inter = CONFIG.hidden_size, CONFIG.intermediate_size
    qkv_rows = (CONFIG.num_attention_heads + 2 * CONFIG.num_key_value_heads) * CONFIG.head_dim
    for M in (1, 5, 8, 11):                                              # 11 > small_batch: unfused
        x, residual, norm_weight, qkv = _inputs(M, qkv_rows, hidden, dtype, seed=M)
        gate_up = _inputs(M, inter, hidden, dtype, silu=True, seed=M + 1)[3]
        x_view = torch.zeros(M, 2 * hidden, dtype=dtype, device=DEV)[:, ::2]
        x_view.copy_(x)
        for x_in, r in ((x, residual), (x, None), (x_view, residual)):
            for op, w in (("norm_linear", qkv), ("norm_linear_silu_mul", gate_up)):
                # The residual passed in is consumed (above small_batch, add_norm stores the sum in it).
                want, want_stream = getattr(torch_ops, op)(ResidualStream(x_in, None if r is None else r.clone()),
                                                           norm_weight, w)
                got, stream = getattr(fused_ops, op)(ResidualStream(x_in, None if r is None else r.clone()),
                                                     norm_weight, w)
                torch.testing.assert_close(got, want, **tol)
                assert torch.equal(stream, want_stream)
                if r is None:
                    assert stream is x_in
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError):
            fused_ops.small_batch = bad
    assert fused_ops.small_batch == 8


def _copy(stream: ResidualStream) -> ResidualStream:
    """A stream of copies (an operation may consume the one it is given)."""
    return ResidualStream(*(None if t is None else t.clone() for t in stream))


@pytest.mark.parametrize("dtype", dtype_params())
def test_fused_linear_add_op_and_the_norm_after_it(dtype):
    """``linear_add`` (o_proj and down_proj): at most ``small_batch`` rows the fused kernel adds
    the residual and hands the next norm its sums of squares; above, ``F.linear`` with the add
    left to the norm (seen by counting the fused calls). Either way the stream, and the
    projection normalised from it, are the torch set's, views included."""
    torch_ops, fused_ops = _ops()
    fused_ops.small_batch = 4
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    calls = []
    fused = fused_ops._fused
    fused_ops._fused = lambda *a, **k: calls.append((a[0].size(0), "add" in k)) or fused(*a, **k)
    hidden, inter = CONFIG.hidden_size, CONFIG.intermediate_size
    for M in (1, 3, 4, 6):
        x, _, _, w = _inputs(M, hidden, inter, dtype, seed=M)
        residual, norm_weight, qkv = _inputs(M, 32, hidden, dtype, seed=M + 5)[1:]
        for x_in in (x, torch.zeros(M, 2 * x.size(1), dtype=dtype, device=DEV)[:, ::2].copy_(x)):
            # The residual is consumed (above small_batch the norm kernel stores the sum in it): a copy each.
            got, want = fused_ops.linear_add(x_in, w, residual.clone()), torch_ops.linear_add(x_in, w, residual.clone())
            assert (got.sum_sq is not None) == (M <= 4) and want.sum_sq is None
            if M <= 4:                       # the add done, and the pieces sum to the row's squares
                assert got.residual is None and got.sum_sq.dtype == torch.float32
                torch.testing.assert_close(got.hidden, want.hidden + want.residual, **tol)
                torch.testing.assert_close(got.sum_sq.sum(1), got.hidden.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
            out_got, stream_got = fused_ops.norm_linear(_copy(got), norm_weight, qkv)
            out_want, stream_want = torch_ops.norm_linear(_copy(want), norm_weight, qkv)
            torch.testing.assert_close(stream_got, stream_want, **tol)
            torch.testing.assert_close(out_got, out_want, **tol)
            torch.testing.assert_close(fused_ops.norm(got, norm_weight), torch_ops.norm(want, norm_weight), **tol)
    # Each fused linear_add then its norm_linear; M = 6 (over small_batch) takes cuBLAS.
    assert calls == [(M, add) for M in (1, 1, 3, 3, 4, 4) for add in (True, False)]


def test_fused_ops_take_the_configured_tiles(monkeypatch):
    """``linear_config`` reaches the launch: a config or a function of the shape."""
    torch_ops, fused_ops = _ops()
    x, residual, norm_weight, w = _inputs(3, 32, CONFIG.hidden_size, torch.float32)
    seen = []

    def choose(M, N, K, silu):
        seen.append((M, N, K, silu))
        return FusedLinearConfig(16, 16, 32)
    fused_ops.linear_config = choose
    got = fused_ops.norm_linear_silu_mul(ResidualStream(x, residual), norm_weight, w)
    assert seen == [(3, 16, CONFIG.hidden_size, True)]
    want = torch_ops.norm_linear_silu_mul(ResidualStream(x, residual), norm_weight, w)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    fused_ops.linear_config = FusedLinearConfig(16, 16, 16)
    assert fused_ops._linear_launchers and all(k[-1] != fused_ops.linear_config for k in fused_ops._linear_launchers)
    fused_ops.norm_linear(ResidualStream(x, residual), norm_weight, w)
    assert any(k[-1] == FusedLinearConfig(16, 16, 16) for k in fused_ops._linear_launchers)


@pytest.mark.parametrize("dtype", dtype_params())
def test_model_fused_equals_unfused(dtype):
    """The tiny random model, fused and not, on a prefill of two requests, a longer prompt (steps
    with prompt tokens take the norm kernel then F.linear, whatever their size) and decode steps
    (fused: under ``small_batch`` rows): the same logits."""
    from tests.test_model import Pager
    weights = random_weights(CONFIG, seed=4)
    models = [LlamaForCausalLM(CONFIG, weights, attention="reference", dtype=dtype, device=DEV, fused=f)
              for f in (False, True)]
    assert isinstance(models[1].ops, FusedLayerOps)
    models[1].ops.small_batch = 16
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist() for n in (9, 5, 20)]
    steps = [[("a", prompts[0]), ("b", prompts[1])], [("c", prompts[2])],
             [("a", [3]), ("b", [7]), ("c", [11])], [("a", [1]), ("c", [2])]]
    tol = dict(atol=1e-4, rtol=0) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    pagers = [Pager(m, 16, 8, seed=1) for m in models]
    for work in steps:
        want, got = (p.step(work) for p in pagers)
        torch.testing.assert_close(got, want, **tol)
    # Every kind of fused launch ran: the first layer's norm from a pass over the embeddings, the
    # later norms from a linear_add's sums of squares, linear_add itself; (has_norm, has_residual,
    # sums of squares in, residual added) of each:
    kinds = {(k[0], k[1], k[3] > 0, k[4]) for k in models[1].ops._linear_launchers}
    assert kinds == {(True, False, False, False), (True, False, True, False), (False, False, False, True)}


def test_only_decode_steps_take_the_fused_projections():
    """A step with prompt tokens takes cuBLAS's projections even when it is small, so that a
    prompt's numbers do not depend on the size of the step it ran in."""
    _, fused_ops = _ops()
    fused_ops.small_batch = 8
    assert fused_ops.takes_fused(8, True) and not fused_ops.takes_fused(9, True)
    assert not fused_ops.takes_fused(1, False) and not fused_ops.takes_fused(8, False)
    x, w = torch.randn(3, CONFIG.hidden_size, device=DEV), torch.randn(CONFIG.hidden_size, CONFIG.hidden_size, device=DEV)
    before = dict(fused_ops._linear_launchers)
    fused_ops.linear_add(x, w, torch.zeros_like(x), decode=False)
    assert fused_ops._linear_launchers == before                       # no fused launch made
    fused_ops.linear_add(x, w, torch.zeros_like(x), decode=True)
    assert len(fused_ops._linear_launchers) == len(before) + 1


@pytest.mark.cuda
def test_fused_linear_on_smollm2_shapes_in_bf16():
    """On the GPU: SmolLM2-135M's two fused projections (QKV 960 x 576, gate-up 2 x 1536 x 576) in
    bf16, at the batch sizes of decode, against the float64 reference."""
    for M in (1, 2, 3, 8, 16, 64):
        for N, silu in ((960, False), (1536, True)):
            x, residual, norm_weight, weight = _inputs(M, N, 576, torch.bfloat16, silu, seed=M)
            out, stream = norm_linear(x, norm_weight, weight, EPS, residual,
                                      act="silu_and_mul" if silu else None)
            _check(out, stream, x, norm_weight, weight, residual, silu)


def test_default_config_covers_small_batches(monkeypatch):
    """The rule: a few rows, one row tile, K in one chunk (one pass), about a hundred programs or
    more on SmolLM2's projections; more rows: tl.dot's tiles. Every default passes the config
    check, and so does every measured entry of TUNED, which default_config then returns."""
    for shape, by_m in fused_linear.TUNED.items():
        for M, cfg in by_m.items():
            assert fused_linear._check_config(cfg) is cfg and fused_linear.default_config(M, *shape) == cfg
    monkeypatch.setattr(fused_linear, "TUNED", {})
    for M in (1, 2, 3, 4, 5, 16, 17, 64, 300):
        for N, K, silu in ((960, 576, False), (1536, 576, True), (576, 576, False), (576, 1536, False)):
            cfg = fused_linear.default_config(M, N, K, silu)
            assert fused_linear._check_config(cfg) is cfg
            if M <= fused_linear.CUDA_CORE_ROWS:
                assert cfg.BLOCK_M >= M and cfg.BLOCK_M < 16 and cfg.BLOCK_K >= K
                assert -(-N // cfg.BLOCK_N) >= 100
            else:
                assert cfg.BLOCK_M >= 16 and cfg.BLOCK_N >= 16


def test_tuned_configs_come_first(monkeypatch):
    """A measured entry serves the token counts up to its own; above the largest, the rule."""
    shape = (960, 576, False)
    one, eight = FusedLinearConfig(1, 2, 1024, 4, 1), FusedLinearConfig(16, 16, 128, 4, 3)
    monkeypatch.setitem(fused_linear.TUNED, shape, {1: one, 8: eight})
    assert fused_linear.default_config(1, *shape) == one
    assert fused_linear.default_config(2, *shape) == eight == fused_linear.default_config(8, *shape)
    assert fused_linear.default_config(9, *shape) == fused_linear.default_config(9, 960, 576, True)   # the rule
    assert fused_linear.default_config(1, 960, 576, True) != one                       # another shape


def test_benchmark_script_runs():
    """benchmarks/bench_fused_linear.py --smoke: tiny shapes in the interpreter, every row printed
    (fused and unfused first checked to agree), the sweep too."""
    import triton
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        # Seen on the GPU machine (Triton 3.6, NumPy 2): its interpreter hands a kernel's int
        # arguments over as one-element arrays, which a loop bound cannot take (int() of such an
        # array is a TypeError in NumPy 2). The compiled kernels run there, and are tested there.
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run a loop over a runtime bound under NumPy 2")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_fused_linear.py"), "--smoke", "--sweep", "--table",
                           "--m", "1,17"], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PAGED_ATTENTION_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    table = [r for r in rows if r and r[0] in ("qkv", "gate_up", "o_proj", "down") and r[1].isdigit()]
    assert [(r[0], r[1]) for r in table] == [(op, m) for op in ("qkv", "gate_up", "o_proj", "down") for m in "1 17".split()]
    assert sum(1 for r in rows if len(r) > 1 and r[1].startswith("M=")) == 8
    # The best tiles as a TUNED table that runs as Python, and the small_batch suggestion.
    out = done.stdout
    snippet = out[out.index("TUNED = {"):out.index("\n}\n") + 2]
    scope = {"FusedLinearConfig": FusedLinearConfig}
    exec(snippet, scope)
    assert len(scope["TUNED"]) == 4 and all(sorted(by_m) == [1, 17] for by_m in scope["TUNED"].values())
    assert all(isinstance(c, FusedLinearConfig) for by_m in scope["TUNED"].values() for c in by_m.values())
    assert out.count("suggested small_batch:") == 2
