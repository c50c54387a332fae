"""Tests for paged_attention.viz: every drawing draws, deterministically, and rejects bad input."""
import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from paged_attention.memory_sim import PAPER_USEFUL, compare_schemes, synthetic_trace  # noqa: E402
from paged_attention.utils import slot_mapping  # noqa: E402
from paged_attention.viz import draw_block_table, draw_slot_mapping, draw_waste_breakdown  # noqa: E402

# A fragmented example: sequence 0 lives in blocks 3 then 0, sequence 1 in block 1.
TABLE = [[3, 0], [1]]
LENS = [6, 2]


def texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


class FakeTensor:
    """Stands in for a torch tensor: only ``tolist`` is used."""

    def __init__(self, rows):
        self.rows = rows

    def tolist(self):
        return self.rows


# --- slot_mapping --------------------------------------------------------------------------------

def test_slot_mapping_on_a_fragmented_table():
    assert slot_mapping(TABLE, LENS, 4) == [12, 13, 14, 15, 0, 1, 4, 5]


def test_slot_mapping_ignores_unneeded_entries_and_rows():
    # Padding after the needed blocks and a third row without a length are ignored.
    assert slot_mapping([[3, 0, -1, 99], [1, -1], [7]], [6, 2], 4) == [12, 13, 14, 15, 0, 1, 4, 5]
    assert slot_mapping([[5]], [0], 16) == []
    assert slot_mapping(np.array([[2, 1]]), np.array([3]), 2) == [4, 5, 2]
    assert slot_mapping(FakeTensor([[2, 1]]), FakeTensor([3]), 2) == [4, 5, 2]


@pytest.mark.parametrize("block_size", [0, -4, 2.5, True, "4"])
def test_slot_mapping_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping(TABLE, LENS, block_size)


def test_slot_mapping_rejects_bad_tables_and_lengths():
    with pytest.raises(ValueError, match="seq_lens"):
        slot_mapping(TABLE, [6, -1], 4)
    with pytest.raises(ValueError, match=r"block_table\[1\]"):
        slot_mapping(TABLE, [6, 5], 4)  # 5 tokens need 2 blocks, row 1 has one
    with pytest.raises(ValueError, match="block_table has 2 rows"):
        slot_mapping(TABLE, [6, 2, 1], 4)
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\]"):
        slot_mapping([[3, -1]], [6], 4)
    with pytest.raises(TypeError, match="block_table"):
        slot_mapping(7, LENS, 4)


# --- draw_block_table ----------------------------------------------------------------------------

def test_draw_block_table_draws_blocks_and_arrows():
    ax = draw_block_table(TABLE, LENS, 4, num_blocks=6)
    assert isinstance(ax, Axes)
    # 3 logical + 6 physical block outlines, plus the shaded fills.
    assert len(ax.patches) >= 9
    labels = texts(ax)
    assert {f"block {i}" for i in range(6)} <= set(labels)
    assert "seq 0: 6 tokens" in labels and "seq 1: 2 tokens" in labels
    arrows = [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
    assert len(arrows) == 3  # one per logical block in use


def test_draw_block_table_accepts_arrays_tensors_and_an_axes():
    _, given = plt.subplots()
    ax = draw_block_table(FakeTensor(TABLE), np.array(LENS), 4, ax=given, title="mine")
    assert ax is given
    assert ax.get_title() == "mine"
    ax2 = draw_block_table(np.array([[3, 0], [1, 2]]), [6, 2], 4)
    assert "block 3" in texts(ax2)


def test_draw_block_table_is_deterministic():
    a = draw_block_table(TABLE, LENS, 4)
    b = draw_block_table(TABLE, LENS, 4)
    assert texts(a) == texts(b)
    assert [p.get_xy() for p in a.patches] == [p.get_xy() for p in b.patches]
    assert not any("0x" in t for t in texts(a))


def test_draw_block_table_rejects_a_pool_too_small():
    with pytest.raises(ValueError, match="num_blocks"):
        draw_block_table(TABLE, LENS, 4, num_blocks=3)
    with pytest.raises(ValueError, match="block_size"):
        draw_block_table(TABLE, LENS, 0)


# --- draw_slot_mapping ---------------------------------------------------------------------------

def test_draw_slot_mapping_labels_every_token_with_its_slot():
    ax = draw_slot_mapping(TABLE, LENS, 4)
    assert isinstance(ax, Axes)
    assert len(ax.patches) == sum(LENS)
    labels = texts(ax)
    for slot in slot_mapping(TABLE, LENS, 4):
        assert str(slot) in labels
    assert {"block 3", "block 0", "block 1"} <= set(labels)
    assert "t // B" in ax.get_title()


def test_draw_slot_mapping_subset_and_truncation():
    ax = draw_slot_mapping(TABLE, LENS, 4, seqs=[0], max_tokens=5)
    assert len(ax.patches) == 5
    assert "… (1 more)" in texts(ax)
    assert "seq 1" not in texts(ax)


def test_draw_slot_mapping_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seqs"):
        draw_slot_mapping(TABLE, LENS, 4, seqs=[2])
    with pytest.raises(ValueError, match="max_tokens"):
        draw_slot_mapping(TABLE, LENS, 4, max_tokens=0)
    with pytest.raises(ValueError, match="seq_lens"):
        draw_slot_mapping(TABLE, [6, -2], 4)


# --- draw_waste_breakdown ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    return compare_schemes(synthetic_trace(100, seed=0))


def test_draw_waste_breakdown(results):
    ax = draw_waste_breakdown(results)
    assert isinstance(ax, Axes)
    assert len(ax.patches) == 4 * len(results)  # four stacked segments per scheme
    labels = texts(ax)
    for b in results.values():
        assert f"{100 * b.useful:.1f}%" in labels
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "vLLM (paged, 16)"


def test_draw_waste_breakdown_marks_the_paper(results):
    ax = draw_waste_breakdown(results, paper=PAPER_USEFUL)
    assert "paper: 96.3%" in texts(ax) and "paper: 20.4%" in texts(ax)
    assert len(ax.lines) == len(PAPER_USEFUL)
    assert "paper (Fig. 2)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_draw_waste_breakdown_rejects_bad_input(results):
    with pytest.raises(ValueError, match="results"):
        draw_waste_breakdown({})
    with pytest.raises(TypeError, match="results"):
        draw_waste_breakdown({"max": 0.2})
    with pytest.raises(ValueError, match="paper"):
        draw_waste_breakdown(results, paper={"max": 150})
