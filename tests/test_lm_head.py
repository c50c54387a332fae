"""The greedy output projection (kernels/triton/lm_head.py) against ``argmax(F.linear(...))`` in
float64: small-integer inputs make every product and sum exact in any order, so the kernel's
logits are the reference's exactly and ties are common (the first index must win). Then NaN,
-inf, strided views, several row and column tiles, typed errors, and the model's greedy tokens
through it. Interpreted on a CPU (fp32, fp16), compiled on a GPU (bf16 too)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_attention import runtime
from paged_attention.kernels.triton import lm_head as lm_head_mod
from paged_attention.kernels.triton.lm_head import HeadConfig, lm_head_argmax
from paged_attention.model import LlamaConfig, LlamaForCausalLM, random_weights
from tests.conftest import dtype_params

DEV = runtime.DEVICE
SMALL = HeadConfig(16, 16, 16, 4, 1)        # several column, row and K tiles on small shapes


def _ints(g: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=g).to(DEV, dtype)


def _want(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden.double(), weight.double()).argmax(dim=-1)


@pytest.mark.parametrize("dtype", dtype_params())
def test_argmax_of_exact_logits_with_ties(dtype):
    g = torch.Generator().manual_seed(0)
    for M, V, K, config in ((1, 1, 1, None), (3, 100, 7, None), (5, 70, 40, SMALL), (40, 33, 20, SMALL),
                            (64, 300, 64, None)):
        hidden, weight = _ints(g, M, K, dtype=dtype), _ints(g, V, K, dtype=dtype)
        got = lm_head_argmax(hidden, weight, config=config)
        assert got.dtype == torch.int64 and got.device == hidden.device
        assert torch.equal(got.cpu(), _want(hidden, weight).cpu()), (M, V, K)
    # Equal rows of the weight: equal logits in every column, and the first column must win.
    weight = torch.ones(50, 8, device=DEV, dtype=dtype)
    weight[[9, 30, 45]] = 2
    assert lm_head_argmax(torch.ones(2, 8, device=DEV, dtype=dtype), weight, config=SMALL).tolist() == [9, 9]


def test_logits_are_compared_as_the_dtype_rounds_them():
    """F.linear returns logits in the input dtype: two products that differ in float32 but round
    to the same fp16 value are a tie, and the first column wins (a kernel comparing its float32
    sums would answer the second)."""
    weight = torch.tensor([[1024.0, 0.0], [1024.0, 0.25], [3.0, 0.0]], device=DEV, dtype=torch.float16)
    hidden = torch.ones(1, 2, device=DEV, dtype=torch.float16)
    assert F.linear(hidden.double(), weight.double()).argmax(dim=-1).item() == 1      # exact: column 1
    assert lm_head_argmax(hidden, weight, config=SMALL).item() == 0                     # fp16: a tie


def test_nan_and_infinite_logits_as_torch_orders_them():
    """A NaN logit wins at its first column (in a later tile too), a row of -inf logits answers
    0, +inf wins; K = 1 so that each logit is exactly hidden * weight."""
    weight = torch.arange(1.0, 41.0, device=DEV)[:, None]       # column c's logit is (c + 1) * h
    hidden = torch.tensor([[1.0], [-float("inf")], [float("inf")], [float("nan")]], device=DEV)
    assert lm_head_argmax(hidden, weight, config=SMALL).tolist() == [39, 0, 0, 0]
    weight[[21, 35]] = float("nan")                            # both in the second tile of 16
    weight[3] = float("inf")
    assert lm_head_argmax(hidden[:1], weight, config=SMALL).tolist() == [21]
    assert lm_head_argmax(hidden[:1], weight[:20], config=SMALL).tolist() == [3]


def test_strided_views_are_read_through_their_strides():
    g = torch.Generator().manual_seed(1)
    base_h = _ints(g, 24, 9, dtype=torch.float32)
    base_w = _ints(g, 30, 60, dtype=torch.float32)
    for hidden, weight in ((base_h[::3], base_w[:, 10:19]),          # every third row, a window of K
                           (base_h.t()[:, :9].t(), base_w.t().contiguous().t()[:, :9]),
                           (base_h[:8], base_w[::2, :9])):           # every other vocabulary row
        assert torch.equal(lm_head_argmax(hidden, weight, config=SMALL).cpu(), _want(hidden, weight).cpu())


def test_bad_input_gets_typed_errors(monkeypatch):
    h, w = torch.zeros(2, 4, device=DEV), torch.zeros(10, 4, device=DEV)
    assert lm_head_argmax(h[:0], w).shape == (0,)
    with pytest.raises(TypeError):
        lm_head_argmax([[1.0]], w)
    with pytest.raises(TypeError):
        lm_head_argmax(h.to(torch.int64), w)
    with pytest.raises(TypeError):
        lm_head_argmax(h, w.half())
    with pytest.raises(ValueError):
        lm_head_argmax(h, torch.zeros(10, 5, device=DEV))              # K differs
    with pytest.raises(ValueError):
        lm_head_argmax(h, torch.zeros(0, 4, device=DEV))               # no vocabulary
    with pytest.raises(ValueError):
        lm_head_argmax(torch.zeros(65, 4, device=DEV), w)              # rows past MAX_ROWS
    with pytest.raises(ValueError):
        lm_head_argmax(h, w, config=HeadConfig(16, 24, 16, 4, 1))      # not a power of two
    with pytest.raises(TypeError):
        lm_head_argmax(h, w, config=(16, 16, 16, 4, 1))
    monkeypatch.setattr(lm_head_mod, "MAX_PARTS", 2)
    assert not lm_head_mod.takes(1, 129) and lm_head_mod.takes(1, 128) and not lm_head_mod.takes(65, 10)
    with pytest.raises(ValueError, match="tiles"):
        lm_head_argmax(h, torch.zeros(129, 4, device=DEV))


def test_models_greedy_tokens_take_the_head_kernel():
    """The fused model's greedy tokens come from the head kernel up to MAX_ROWS rows (a model that
    kept the GEMM and argmax would pass the comparison but not the count), from the GEMM and the
    argmax kernel above; both equal the argmax of the model's logits."""
    config = LlamaConfig.tiny()
    model = LlamaForCausalLM(config, random_weights(config), dtype=torch.float32, device=DEV)
    model.fused = True
    heads, argmaxes = [], []
    head, argmax = model.ops._lm_head.lm_head_argmax, model.ops._argmax
    model.ops._lm_head = type("Head", (), dict(takes=staticmethod(lm_head_mod.takes), lm_head_argmax=staticmethod(
        lambda h, w: heads.append(h.shape) or head(h, w))))
    model.ops._argmax = lambda logits: argmaxes.append(logits.shape) or argmax(logits)
    g = torch.Generator().manual_seed(2)
    for rows in (5, 65):
        hidden = torch.randn(rows, config.hidden_size, generator=g).to(DEV)
        assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(dim=-1))
    assert heads == [(5, config.hidden_size)] and argmaxes == [(65, config.vocab_size)]


@pytest.mark.cuda
def test_smollm2_vocabulary_in_bf16():
    """On the GPU, SmolLM2's output projection in bf16 at a decode step's row counts: each answer
    is a column whose float64 logit is within one bf16 rounding of the row's largest (the kernel's
    bf16 logits may differ from another GEMM's in the last bit, never by more)."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(49152, 576, generator=g) * 0.05).to("cuda", torch.bfloat16)
    for M in (1, 16, 64):
        hidden = torch.randn(M, 576, generator=g).to("cuda", torch.bfloat16)
        got = lm_head_argmax(hidden, weight)
        logits = F.linear(hidden.double(), weight.double())
        top = logits.max(dim=-1).values
        assert torch.all(logits.gather(1, got[:, None])[:, 0] >= top - top.abs() * 2 ** -7)
        assert (got == F.linear(hidden, weight).argmax(dim=-1)).float().mean() >= 0.9
