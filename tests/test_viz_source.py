"""The notebooks' source listings and the online-softmax model they walk through."""
import math

import pytest
import torch

from paged_attention.kernels.layout import online_softmax_steps, v2_merge_weights
from paged_attention.v2 import block_table
from paged_attention.viz import source_excerpt


def test_excerpt_of_a_triton_kernel_is_its_own_source():
    whole = source_excerpt(block_table._compute_slot_mappings_kernel)
    assert whole.lines[0].startswith("@triton.jit")
    assert whole.path == "paged_attention/v2/block_table.py"
    cut = source_excerpt(block_table._compute_slot_mappings_kernel, start="block_indices =", until="tl.store(slot")
    assert cut.lines[0].startswith("block_indices = positions // page_size")    # dedented
    assert cut.first > whole.first and cut.last < whole.last
    file_lines = open(block_table.__file__).read().splitlines()
    assert file_lines[cut.first - 1].strip() == cut.lines[0].strip()            # numbers are the file's
    assert not any("tl.store(slot" in line for line in cut.lines)               # `until` is left out
    assert str(cut).splitlines()[1].startswith(f"{cut.first} | ")


def test_excerpt_of_a_cuda_file():
    cut = source_excerpt("kernels/cuda/csrc/attention.cuh", "// v2's reduction", "// ---- Host side")
    assert cut.lines[0].startswith("// v2's reduction") and cut.lines[-1] == "}"


@pytest.mark.parametrize("args, error", [
    (("kernels/cuda/csrc/attention.cuh", "no such marker"), ValueError),
    (("kernels/cuda/csrc/attention.cuh", "// v2's reduction", "no such end"), ValueError),
    (("../../etc/passwd",), ValueError),
    ((42,), TypeError),
    (("kernels/cuda/csrc/attention.cuh", ""), TypeError),
])
def test_bad_requests_are_refused(args, error):
    with pytest.raises(error):
        source_excerpt(*args)


def test_online_softmax_equals_softmax_at_every_step():
    torch.manual_seed(0)
    scores = (torch.randn(11, dtype=torch.float64) * 3).tolist()
    values = torch.randn(11, 4, dtype=torch.float64)
    steps = online_softmax_steps(scores, values.tolist(), tile=4)
    assert [len(s.tokens) for s in steps] == [4, 4, 3]
    for s in steps:       # after each tile: attention over the tokens seen so far
        seen = torch.tensor(scores[:s.tokens.stop], dtype=torch.float64)
        assert s.m == max(scores[:s.tokens.stop])
        want = torch.softmax(seen, 0) @ values[:s.tokens.stop]
        assert torch.allclose(torch.tensor(s.output, dtype=torch.float64), want)
        assert math.isclose(s.l, torch.exp(seen - s.m).sum().item())
    # The tiles' (m, l) merge as v2's partitions do.
    parts = [online_softmax_steps(scores[lo:lo + 4], values[lo:lo + 4].tolist(), tile=4)[-1] for lo in (0, 4, 8)]
    w = v2_merge_weights([p.m for p in parts], [p.l for p in parts])
    merged = sum(wi * torch.tensor(p.output, dtype=torch.float64) for wi, p in zip(w, parts)) / sum(w)
    assert torch.allclose(merged, torch.tensor(steps[-1].output, dtype=torch.float64))


def test_online_softmax_needs_the_rescale():
    # A later tile with a larger maximum: the earlier sums must shrink by alpha < 1.
    steps = online_softmax_steps([0.0, 5.0], [[1.0], [2.0]], tile=1)
    assert steps[0].alpha == 0.0 and steps[1].alpha == pytest.approx(math.exp(-5.0))


@pytest.mark.parametrize("scores, values, tile", [([], [], 2), ([1.0], [[1.0], [2.0]], 1), ([1.0], [[1.0]], 0),
                                                   ([1.0, 2.0], [[1.0], [1.0, 2.0]], 1)])
def test_online_softmax_bad_input(scores, values, tile):
    with pytest.raises(ValueError):
        online_softmax_steps(scores, values, tile)
