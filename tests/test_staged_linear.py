"""The small-batch projections with their weights staged in shared memory
(kernels/triton/staged_linear.py, a Gluon kernel): which shapes it takes and its front-end's
refusals on any machine; on a GPU, each of the model's projections against fused_linear's kernel
(the same bits where no norm is in front, else within the float64 reference's error bound) and the
model's layer operations taking it. Where its copies fall around the PDL wait is checked without a
GPU in tests/test_pdl.py (the kernel compiled for sm_90)."""
from __future__ import annotations

import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels.triton import fused_linear as fl
from paged_attention.kernels.triton import staged_linear as sl
from paged_attention.kernels.triton.staged_linear import StagedConfig, split_k, staged_linear, supported
from tests.test_fused_linear import _check

DEV = runtime.DEVICE
EPS = 1e-5


def test_split_k_cuts_k_into_two_powers_of_two():
    assert split_k(576) == (512, 64)         # SmolLM2's hidden size
    assert split_k(1536) == (1024, 512)      # its intermediate size
    assert split_k(512) == (512, 0) and split_k(64) == (64, 0)
    assert split_k(960) is None              # 512 + 448
    assert split_k(600) is None and split_k(32) is None and split_k(0) is None


@pytest.fixture
def h100(monkeypatch):
    """``supported``'s view of an H100 (compute capability 9.0, 227 KB of shared memory a block),
    on any machine: compiled kernels, not the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sl, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(sl, "_shared_memory_limit", lambda index: 232448)
    return torch.device("cuda", 0)


def test_supported_shapes_fit_the_shared_memory(h100, monkeypatch):
    bf16 = torch.bfloat16
    assert supported(576, 1536, False, bf16, h100) == StagedConfig(32, 1024, 512)    # down: 144 KB
    assert supported(1536, 576, True, bf16, h100) == StagedConfig(32, 512, 64)       # gate/up: 90 KB
    assert supported(960, 576, False, torch.float16, h100) == StagedConfig(32, 512, 64)
    # (2 * 32 + 16) x 2048 x 2 bytes = 320 KB does not fit; with 16 columns 192 KB does
    assert supported(4096, 2048, True, bf16, h100) == StagedConfig(16, 2048, 0)
    assert supported(4096, 8192, True, bf16, h100) is None                             # not even 16
    assert supported(576, 960, False, bf16, h100) is None                              # K = 512 + 448
    assert supported(576, 576, False, torch.float32, h100) is None                     # 16-bit only
    assert supported(576, 576, False, bf16, torch.device("cpu")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert supported(576, 576, False, bf16, h100) is None                              # the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(sl, "_capability", lambda index: (7, 5))
    assert supported(576, 576, False, bf16, h100) is None                              # no cp.async


def _tensors(M=4, N=64, K=128, dtype=torch.float16, silu=False, device=DEV):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn((2 if silu else 1) * N, K, generator=g) / K ** 0.5).to(device, dtype)
    return x, w


def test_the_front_end_refuses_bad_input_before_launching():
    x, w = _tensors()
    nw = torch.ones(128, dtype=torch.float16, device=DEV)
    sums = torch.ones(4, 2, device=DEV)
    add = torch.zeros(4, 64, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="act"):
        staged_linear(x, w, act="gelu")
    with pytest.raises(ValueError, match="eps"):
        staged_linear(x, w, norm_weight=nw, sum_sq=sums, eps=float("nan"))
    with pytest.raises(ValueError, match="weight must be"):
        staged_linear(x, w[:, :64])
    with pytest.raises(ValueError, match="weight must be"):
        staged_linear(x, w[:63], act="silu_and_mul")
    with pytest.raises(ValueError, match="both norm_weight and sum_sq"):
        staged_linear(x, w, norm_weight=nw)
    with pytest.raises(ValueError, match="sum_sq must be"):
        staged_linear(x, w, norm_weight=nw, sum_sq=torch.ones(3, 2, device=DEV))
    with pytest.raises(TypeError):
        staged_linear(x, w, norm_weight=nw, sum_sq=sums.double())
    with pytest.raises(TypeError, match="x's dtype"):
        staged_linear(x, w.float())
    with pytest.raises(ValueError, match="contiguous"):
        staged_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError):
        staged_linear(x, w, add=add[:, :32])
    with pytest.raises(TypeError):
        staged_linear(x.tolist(), w)
    if not runtime.HAS_CUDA:
        with pytest.raises(ValueError, match="does not take"):      # a CPU: no Gluon kernel runs here
            staged_linear(x, w, add=add)


# ---- On a GPU: the same bits as fused_linear -----------------------------------------------

# SmolLM2-135M's four projections: (N, K, SwiGLU, residual add); the norm comes from sums of squares.
PROJECTIONS = {"qkv": (960, 576, False, False), "o_proj": (576, 576, False, True),
               "gate_up": (1536, 576, True, False), "down": (576, 1536, False, True)}


def _pieces(x: torch.Tensor, n: int) -> torch.Tensor:
    """Rows' sums of squares in ``n`` pieces (as a linear_add before would give them)."""
    return (x.float() ** 2).reshape(x.size(0), n, -1).sum(-1)


def _both(M, N, K, silu, add, dtype, seed=0):
    """``(staged, fused_linear)`` outputs and sums for one projection (with a norm from sums of
    squares in K / 64 pieces, or the residual add), and the inputs ``(x, norm_weight, weight)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn((2 if silu else 1) * N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    config = fl.default_config(M, N, K, silu)
    act = "silu_and_mul" if silu else None
    if add:
        r = torch.randn(M, N, generator=g).to(DEV, dtype)
        ref, ref_sums = fl.linear_add(x, w, r, config=config)
        out, sums = staged_linear(x, w, add=r, pdl=True)
        return out, sums, ref, ref_sums, (x, None, w)
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(DEV, dtype)
    pieces = _pieces(x, K // 64)
    ref = fl.norm_linear(x, nw, w, EPS, act=act, config=config, sum_sq=pieces)[0]
    out, sums = staged_linear(x, w, norm_weight=nw, sum_sq=pieces, eps=EPS, act=act, pdl=True)
    return out, sums, ref, None, (x, nw, w)


def _agree(out, ref, inputs, silu):
    """Without a norm, fused_linear's bits. With one, its factor ``1 / rms`` is a float32 sum of the
    pieces, which the two kernels may add in other orders (their own layouts): a last-bit
    difference there moves an output by at most a rounding. So: within the float64 reference's
    error bound (``test_fused_linear._check``), and equal to fused_linear's almost everywhere (98.6 % and
    more of the elements on an H100, float16 with SwiGLU the fewest)."""
    x, norm_weight, weight = inputs
    if norm_weight is None:
        assert torch.equal(out, ref)
        return
    _check(out, x, x, norm_weight, weight, None, silu)
    assert (out == ref).double().mean() >= 0.95


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [9, 16, 33, 64])
@pytest.mark.parametrize("name", list(PROJECTIONS))
def test_staged_projections_give_fused_linears_bits(name, M, dtype):
    N, K, silu, add = PROJECTIONS[name]
    out, sums, ref, ref_sums, inputs = _both(M, N, K, silu, add, dtype)
    _agree(out, ref, inputs, silu)
    if add:
        # The pieces are over 32 columns each (fused_linear's may be over 16): their sums agree.
        assert sums.shape == (M, N // 32)
        torch.testing.assert_close(sums.sum(1), ref_sums.sum(1), rtol=1e-5, atol=0)
        torch.testing.assert_close(sums, _pieces(out, N // 32), rtol=1e-5, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("N, K, silu, add", [(200, 512, False, True), (200, 512, True, False), (72, 640, False, True)])
def test_ragged_columns_and_a_k_of_one_part(N, K, silu, add):
    """N not a multiple of the 32-column tile (the last tile masked), K a power of two (no second
    buffer) or 512 + 128."""
    out, sums, ref, ref_sums, inputs = _both(37, N, K, silu, add, torch.bfloat16, seed=1)
    _agree(out, ref, inputs, silu)
    if add:
        torch.testing.assert_close(sums.sum(1), ref_sums.sum(1), rtol=1e-5, atol=0)


def test_launch_tensors_put_a_placeholder_where_an_input_is_absent():
    """The kernel's seven tensor arguments in its order (the front-end and the model's pinned
    launcher both take them from here): the output, the sums with the residual add only, the grid
    of column and row tiles, and where an input is absent a tensor that kernel does not read."""
    config = StagedConfig(32, 512, 64)
    x, w = torch.zeros(40, 576), torch.zeros(960, 576)
    nw, pieces = torch.ones(576), torch.ones(40, 18)
    out, sums, grid, t = sl.launch_tensors(x, w, nw, pieces, None, 960, config)
    assert out.shape == (40, 960) and sums is None and grid == (30, -(-40 // sl.BLOCK_M))
    assert [a is b for a, b in zip(t, (x, w, nw, pieces, x, out, out))] == [True] * 7
    w, add = torch.zeros(576, 576), torch.zeros(40, 576)
    out, sums, grid, t = sl.launch_tensors(x, w, None, None, add, 576, config)
    assert sums.shape == (40, 18) and sums.dtype == torch.float32 and grid[0] == 18
    assert [a is b for a, b in zip(t, (x, w, x, out, add, out, sums))] == [True] * 7


@pytest.mark.cuda
def test_no_rows_launch_nothing():
    x, w = _tensors(M=0, N=64, K=128, dtype=torch.bfloat16)
    out, sums = staged_linear(x, w, add=torch.empty(0, 64, dtype=torch.bfloat16, device=DEV))
    assert out.shape == (0, 64) and sums.shape == (0, 2)


@pytest.mark.cuda
def test_the_models_layer_ops_take_the_staged_kernel_with_the_same_bits():
    """``FusedLayerOps._fused`` at 9 to 64 rows launches ``staged_linear``'s kernel (through its
    pinned launcher) and agrees with fused_linear's, for each of the model's projections."""
    from paged_attention.kernels.triton import pdl
    from paged_attention.model import LlamaConfig
    from paged_attention.model.attention import PagedAttention
    from paged_attention.model.layer_ops import FusedLayerOps, RotaryEmbedding
    if not pdl.enabled(DEV):
        pytest.skip("the staged projections are taken with PDL only (compute capability 9.0)")
    config = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=EPS)
    rotary = RotaryEmbedding(64, 64, 10000.0, DEV)
    ops = FusedLayerOps(config, rotary, PagedAttention("triton", 9, 3, 64, DEV))
    launched = []
    kernel = sl._staged_linear_kernel
    for M in (9, 40, 64):
        for name, (N, K, silu, add) in PROJECTIONS.items():
            g = torch.Generator().manual_seed(M)
            x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
            w = (torch.randn((2 if silu else 1) * N, K, generator=g) / K ** 0.5).to(DEV, torch.bfloat16)
            nw = (1 + 0.2 * torch.randn(K, generator=g)).to(DEV, torch.bfloat16)
            kw = dict(add=torch.randn(M, N, generator=g).to(DEV, torch.bfloat16)) if add else \
                dict(norm_weight=nw, sum_sq=_pieces(x, 18))
            results = []
            for rows in (ops.staged_rows, 10 ** 9):
                ops.staged_rows = rows
                before = len(ops._linear_launchers)
                results.append(ops._fused(x, w, silu=silu, **kw))
                launched += [k for k in list(ops._linear_launchers)[before:] if k[0] == "staged"]
            ops.staged_rows = 9
            (out, stream, sums), (ref, ref_stream, ref_sums) = results
            _agree(out, ref, (x, None if add else nw, w), silu)
            assert stream is x and ref_stream is x
            if add:
                torch.testing.assert_close(sums.sum(1), ref_sums.sum(1), rtol=1e-5, atol=0)
    assert len(launched) == len(PROJECTIONS)       # one staged launcher a kind of projection
    assert all(ops._linear_launchers[k][1].kernel is kernel for k in launched)
