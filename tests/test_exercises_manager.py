"""The checkers of 02_block_manager accept the right answers and reject wrong ones."""
import pytest

import paged_attention.exercises.manager as ex
from paged_attention.legacy.interfaces import AllocStatus


def test_admission(capsys):
    # 8 blocks free of 64, 3 kept back: 7 blocks fit the free ones but not with the watermark;
    # 63 blocks would leave even an empty GPU 1 < 3.
    assert ex.admission("LATER", "NEVER")
    assert "correct" in capsys.readouterr().out
    assert ex.admission(AllocStatus.LATER, "never")
    assert not ex.admission("OK", "NEVER")                  # forgets the watermark
    assert "not yet" in capsys.readouterr().out
    assert not ex.admission("LATER", "LATER")               # NEVER looks at the total, not the free blocks
    assert ex.admission("OK", "NEVER", num_used=40)         # with 24 free the short prompt gets in
    with pytest.raises(TypeError):
        ex.admission("MAYBE", "NEVER")
    with pytest.raises(TypeError):
        ex.admission(1, "NEVER")


def test_parallel_sampling():
    assert ex.parallel_sampling(7, 3)                       # 3 shared full blocks + 4 partial ones
    assert not ex.parallel_sampling(8, 4)                   # the last writer keeps the original
    assert not ex.parallel_sampling(4, 0)                   # as if the samples wrote in place
    assert ex.parallel_sampling(7, 0, prompt_len=12)        # a full last block: fresh blocks, no copies
    with pytest.raises(TypeError):
        ex.parallel_sampling("7", 3)


def test_swap_footprint():
    assert ex.swap_footprint(16, 16)                        # 4 samples × 4 blocks: sharing is lost
    assert not ex.swap_footprint(7, 7)                      # as if shared blocks moved once
    assert not ex.swap_footprint(16, 7)
    assert ex.swap_footprint(4, 4, n=1)                     # one sample: nothing to lose
    with pytest.raises(TypeError):
        ex.swap_footprint(16.0, 16)


def test_watermark_swaps():
    assert ex.watermark_swaps(4, 2)
    assert not ex.watermark_swaps(2, 4)                      # the other way round
    assert not ex.watermark_swaps(3, 3)                      # section 3's own watermark, twice
    assert ex.watermark_swaps(4, 1, watermark=0.5)
    with pytest.raises(TypeError):
        ex.watermark_swaps("4", 2)
