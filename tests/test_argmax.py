"""Greedy sampling's argmax kernel (kernels/triton/argmax.py) against torch's ``argmax(dim=-1)``:
ties, NaN, infinities, rows longer than one part, strided views, typed errors (the model's
greedy tokens through it: tests/test_lm_head.py, with the head kernel's). Interpreted on a CPU
(fp32, fp16), compiled on a GPU (bf16 too)."""
from __future__ import annotations

import pytest
import torch

from paged_attention import runtime
from paged_attention.kernels.triton import argmax as argmax_mod
from paged_attention.kernels.triton.argmax import argmax
from tests.conftest import dtype_params

DEV = runtime.DEVICE


def _same(x: torch.Tensor) -> None:
    got, want = argmax(x), x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", dtype_params())
def test_argmax_equals_torch_on_random_rows(dtype):
    g = torch.Generator().manual_seed(0)
    for M, V in ((1, 1), (3, 100), (5, 1000), (2, 4097)):
        _same(torch.randn(M, V, generator=g).to(DEV, dtype))


@pytest.mark.parametrize("dtype", dtype_params())
def test_ties_answer_the_first_index(dtype):
    """Values rounded to a few levels: every row has many equal maxima, and the first wins (a
    kernel that kept the last, or any, fails)."""
    g = torch.Generator().manual_seed(1)
    x = torch.round(torch.randn(8, 3000, generator=g) * 1.5).to(DEV, dtype)
    _same(x)
    x = torch.zeros(2, 500, device=DEV, dtype=dtype)
    x[0, [7, 300, 499]] = 1
    x[1, [499, 3]] = 2
    assert argmax(x).tolist() == [7, 3]


def test_nan_and_infinities_as_torch_orders_them():
    """NaN counts above everything (the first NaN's index), an all -inf row answers 0, +inf wins."""
    x = torch.zeros(5, 300, device=DEV)
    x[0, [9, 40]] = float("nan")
    x[0, 5] = float("inf")
    x[1] = -float("inf")
    x[2, [17, 200]] = float("inf")
    x[3, 250] = float("nan")
    x[3, 3] = 1e30
    x[4, 299] = -1.0
    _same(x)
    assert argmax(x).tolist() == [9, 0, 17, 250, 0]


def test_rows_longer_than_a_chunk(monkeypatch):
    """Rows read in several parts: the maximum in a later part wins only when larger, a tie
    across parts keeps the earlier index, a NaN in a later part still wins, and parts of -inf
    before a finite value do not."""
    monkeypatch.setattr(argmax_mod, "CHUNK", 64)
    x = torch.zeros(5, 200, device=DEV)
    x[0, 150] = 3
    x[0, 10] = 2
    x[1, [20, 84, 130]] = 5       # ties across parts
    x[2, 199] = 1                 # the last, partial part
    x[3, [126, 190]] = float("nan")   # two NaN in two parts: the first counts
    x[3, 0] = 9
    x[4, [70, 6]] = -1            # every other value -inf: the first -1
    x[4, [v for v in range(200) if v not in (6, 70)]] = -float("inf")
    assert argmax(x).tolist() == [150, 20, 199, 126, 6]
    g = torch.Generator().manual_seed(2)
    _same(torch.round(torch.randn(3, 1000, generator=g)).to(DEV))


def test_strided_views_are_read_through_their_strides():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(300, 6, generator=g).to(DEV)
    _same(base.t())                          # columns 6 apart
    wide = torch.randn(4, 900, generator=g).to(DEV)
    _same(wide[:, 100:700])                  # a window of each row
    _same(wide[::2])                         # every other row


def test_bad_input_gets_typed_errors():
    assert argmax(torch.zeros(0, 7, device=DEV)).shape == (0,)
    with pytest.raises(TypeError):
        argmax([[1.0, 2.0]])
    with pytest.raises(TypeError):
        argmax(torch.zeros(2, 3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError):
        argmax(torch.zeros(6, device=DEV))
    with pytest.raises(ValueError):
        argmax(torch.zeros(2, 0, device=DEV))


def test_rows_past_the_grid_are_refused_before_the_launch(monkeypatch):
    """More parts than a grid's second dimension holds: a ValueError, no launch (the kernel
    would otherwise be launched with a grid CUDA rejects, or, interpreted, read every part)."""
    monkeypatch.setattr(argmax_mod, "CHUNK", 2)
    monkeypatch.setattr(argmax_mod, "MAX_PARTS", 8)
    assert argmax(torch.arange(16.0, device=DEV)[None]).tolist() == [15]
    with pytest.raises(ValueError, match="columns"):
        argmax(torch.zeros(1, 17, device=DEV))


@pytest.mark.cuda
def test_argmax_on_a_vocabulary_of_smollm2_in_bf16():
    """On the GPU: SmolLM2's vocabulary (49,152) in bf16, as a decode step's logits, with ties."""
    g = torch.Generator().manual_seed(4)
    for M in (1, 16, 64, 256):
        x = (torch.randn(M, 49152, generator=g) * 4).to("cuda", torch.bfloat16)
        _same(x)
        _same(torch.round(x.float()).to(torch.bfloat16))
