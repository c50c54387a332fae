"""Tests for paged_attention.memory_sim: the trace, the serving loop, and hand-checked answers."""
import math

import numpy as np
import pytest

from paged_attention.memory_sim import (
    CATEGORIES, LABELS, PAPER_USEFUL, SCHEMES, MemoryBreakdown, Request, compare_schemes,
    simulate, synthetic_trace,
)


def shares(b: MemoryBreakdown) -> tuple[float, float, float, float]:
    return (b.token_states, b.reserved, b.internal_fragmentation, b.external_fragmentation)


def assert_shares(b: MemoryBreakdown, expected: tuple[int, int, int, int]) -> None:
    """``expected`` are slot-steps per category, summed by hand; compare as fractions."""
    total = sum(expected)
    assert shares(b) == pytest.approx(tuple(e / total for e in expected))


# --- the trace ---------------------------------------------------------------------------------

def test_trace_is_deterministic_for_a_seed():
    assert synthetic_trace(300, seed=7) == synthetic_trace(300, seed=7)
    assert synthetic_trace(300, seed=7) != synthetic_trace(300, seed=8)


@pytest.mark.parametrize("max_model_len", [64, 2048])
def test_trace_lengths_are_in_range(max_model_len):
    trace = synthetic_trace(2000, max_model_len=max_model_len, seed=1)
    assert len(trace) == 2000
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace)
    assert all(r.total_len <= max_model_len for r in trace)
    assert all(isinstance(r.prompt_len, int) and isinstance(r.output_len, int) for r in trace)


def test_trace_means_are_roughly_right():
    trace = synthetic_trace(5000, mean_input=161, mean_output=338, seed=0)
    assert np.mean([r.prompt_len for r in trace]) == pytest.approx(161, rel=0.10)
    assert np.mean([r.output_len for r in trace]) == pytest.approx(338, rel=0.10)
    # Skewed: the median is well below the mean.
    assert np.median([r.output_len for r in trace]) < 0.9 * 338


def test_request_validates_and_adds_up():
    assert Request(5, 3).total_len == 8
    with pytest.raises(ValueError, match="prompt_len"):
        Request(0, 3)
    with pytest.raises(ValueError, match="output_len"):
        Request(5, -1)
    with pytest.raises(TypeError, match="prompt_len"):
        Request(2.5, 3)


# --- the simulation on a real-sized trace ------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    return compare_schemes(synthetic_trace(400, seed=0))


def test_compare_schemes_runs_every_scheme(results):
    assert tuple(results) == SCHEMES
    assert set(LABELS) == set(SCHEMES) == set(PAPER_USEFUL)
    assert all(results[s].scheme == s for s in SCHEMES)


def test_fractions_sum_to_one_and_are_non_negative(results):
    for b in results.values():
        assert math.isclose(sum(shares(b)), 1.0)
        assert all(x >= 0 for x in shares(b))
        assert list(b.fractions()) == list(CATEGORIES)
        assert b.useful == b.token_states


def test_paging_wastes_least(results):
    useful = {s: results[s].useful for s in SCHEMES}
    assert useful["paged"] > 0.9
    assert all(useful[s] < useful["paged"] for s in ("max", "pow2", "oracle"))
    assert useful["max"] < useful["pow2"] < useful["oracle"]
    assert useful["max"] < 0.5
    # Less waste, bigger batches.
    assert results["paged"].mean_running > results["oracle"].mean_running > results["max"].mean_running


def test_paged_has_no_external_fragmentation_and_little_internal(results):
    paged = results["paged"]
    assert paged.external_fragmentation == 0
    assert paged.reserved == 0
    # At most block_size - 1 unfilled slots per running request, on average over steps.
    internal_per_request = paged.internal_fragmentation * paged.mean_slots / paged.mean_running
    assert 0 < internal_per_request < 16


def test_exact_reservation_has_no_internal_fragmentation(results):
    assert results["oracle"].internal_fragmentation == 0
    assert results["max"].internal_fragmentation > results["pow2"].internal_fragmentation > 0


# --- hand-computed answers ---------------------------------------------------------------------

SMALL = dict(capacity_tokens=16, max_model_len=16, block_size=4)


def test_one_request_by_hand():
    # Prompt 5, output 3: the cache holds 5, 6, 7, 8 tokens over 4 steps (26 token-steps).
    trace = [Request(5, 3)]
    # Paged, blocks of 4: 2 blocks (8 slots) throughout; 3, 2, 1, 0 slots unfilled.
    paged = simulate(trace, "paged", **SMALL)
    assert_shares(paged, (26, 0, 6, 0))
    assert (paged.token_states, paged.internal_fragmentation) == (0.8125, 0.1875)
    assert paged.steps == 4 and paged.mean_running == 1 and paged.mean_slots == 8
    # Oracle reserves 8: the slots of tokens still to come are "reserved" (3, 2, 1, 0).
    assert_shares(simulate(trace, "oracle", **SMALL), (26, 6, 0, 0))
    # Max reserves 16: 8 more slots per step that will never be used.
    assert_shares(simulate(trace, "max", **SMALL), (26, 6, 32, 0))
    # Pow2 of 9 tokens reserves 16: 7 never-used slots per step.
    assert_shares(simulate([Request(5, 4)], "pow2", **SMALL), (5 + 6 + 7 + 8 + 9, 10, 35, 0))


THREE = [Request(2, 1), Request(4, 3), Request(10, 1)]


def test_external_fragmentation_by_hand():
    # Oracle, 16 slots. Step 0: A at [0, 3), B at [3, 10); C (11 slots) waits. Step 1: A ends.
    # Steps 2-3: the 3-slot hole at [0, 3) is stranded below B and too small for C.
    # Step 4: B has gone, C goes to address 0.
    b = simulate(THREE, "oracle", **SMALL)
    assert_shares(b, (6 + 8 + 6 + 7 + 10 + 11, 4 + 2 + 1 + 0 + 1 + 0, 0, 3 + 3))
    assert b.steps == 6


def test_paged_growth_by_hand():
    # 4 blocks of 4. A and B get a block each, C needs 3 and waits; B takes a second block in
    # step 1; C is admitted in step 4, when A and B have gone.
    b = simulate(THREE, "paged", **SMALL)
    assert_shares(b, (6 + 8 + 6 + 7 + 10 + 11, 0, 2 + 4 + 2 + 1 + 2 + 1, 0))
    assert b.steps == 6


def test_paged_preemption_by_hand():
    # 2 blocks of 4, two requests of 4 + 2 tokens: both fill their block at once and both need
    # a second one. The newer (B) is preempted, A finishes, then B is recomputed and finishes.
    b = simulate([Request(4, 2), Request(4, 2)], "paged", capacity_tokens=8, max_model_len=8,
                 block_size=4)
    assert_shares(b, (8 + 4 + 5 + 6 + 4 + 5 + 6, 0, 0 + 0 + 3 + 2 + 0 + 3 + 2, 0))
    assert b.steps == 7


def test_empty_trace():
    b = simulate([], "paged")
    assert b.steps == 0 and shares(b) == (0, 0, 0, 0)


# --- bad input ---------------------------------------------------------------------------------

def test_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'max', 'pow2', 'oracle', 'paged'"):
        simulate([Request(5, 3)], "buddy")


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([Request(20, 1)], "oracle", **SMALL)
    with pytest.raises(ValueError, match="capacity_tokens"):
        simulate([Request(5, 3)], "paged", capacity_tokens=8, max_model_len=16)
    with pytest.raises(ValueError, match="block_size"):
        simulate([Request(5, 3)], "paged", block_size=0)
    with pytest.raises(TypeError, match=r"trace\[0\]"):
        simulate([(5, 3)], "paged")
    with pytest.raises(ValueError, match="num_requests"):
        synthetic_trace(-1)
    with pytest.raises(ValueError, match="mean_output"):
        synthetic_trace(10, mean_output=0)
