"""paged_attention.legacy.sharing_sim: the memory that sharing blocks saves, measured on the block manager."""
import pytest

from paged_attention.legacy.sharing_sim import PAPER_SAVINGS, SharingSavings, sharing_savings

SMALL = dict(num_requests=6, block_size=8, mean_prompt_len=20, mean_output_len=24, max_len=96)


def test_parallel_sampling_saves_nothing_for_one_sample_and_more_as_n_grows():
    results = sharing_savings([1, 2, 4, 6], "parallel", **SMALL)
    assert [r.n for r in results] == [1, 2, 4, 6] and {r.mode for r in results} == {"parallel"}
    one = results[0]
    assert one.saving == 0.0 and one.peak_saving == 0.0
    assert one.shared_block_steps == one.unshared_block_steps > 0
    savings = [r.saving for r in results]
    assert all(s > 0 for s in savings[1:])
    assert savings == sorted(savings)                      # more samples share the same prompt
    assert all(r.shared_block_steps < r.unshared_block_steps and r.peak_shared <= r.peak_unshared
               for r in results[1:])
    # Only the prompt can be shared, so the saving stays below the prompt's share of the memory.
    assert savings[-1] < 0.5


def test_without_sharing_n_samples_cost_n_times_one_when_lengths_agree():
    # With the same prompts and lengths, n independent sequences of one request use n times the
    # blocks of one, step by step: "unshared" is exactly that when every sample has one length.
    beam = sharing_savings([1, 3], "beam", **SMALL)
    assert beam[1].unshared_block_steps == 3 * beam[0].unshared_block_steps
    assert beam[1].peak_unshared == 3 * beam[0].peak_unshared


def test_beam_search_shares_more_than_parallel_sampling():
    beam = sharing_savings([1, 2, 4], "beam", **SMALL)
    parallel = sharing_savings([1, 2, 4], "parallel", **SMALL)
    assert beam[0].saving == 0.0
    assert all(b.saving > p.saving > 0 for b, p in zip(beam[1:], parallel[1:]))


def test_results_are_reproducible_and_depend_on_the_seed():
    assert sharing_savings([2, 4], **SMALL) == sharing_savings([2, 4], **SMALL)
    assert sharing_savings([4], "beam", **SMALL) != sharing_savings([4], "beam", seed=1, **SMALL)
    # Each n runs the same requests, whatever else is in the list.
    assert sharing_savings([4], **SMALL)[0] == sharing_savings([2, 4], **SMALL)[1]


def test_saving_property_and_paper_numbers():
    s = SharingSavings("parallel", 2, 90, 100, 9, 10)
    assert s.saving == pytest.approx(0.1) and s.peak_saving == pytest.approx(0.1)
    assert PAPER_SAVINGS == {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)}


def test_bad_input():
    with pytest.raises(ValueError, match="mode"):
        sharing_savings([2], "greedy")
    with pytest.raises(ValueError, match="n_values"):
        sharing_savings([0, 2])
    with pytest.raises(ValueError, match="n_values"):
        sharing_savings([])
    with pytest.raises(TypeError):
        sharing_savings("24")
    with pytest.raises(TypeError, match="block_size"):
        sharing_savings([2], block_size=8.0)
    with pytest.raises(ValueError, match="mean_output_len"):
        sharing_savings([2], mean_output_len=0)
