"""paged_attention.viz.v1: the pure helpers agree with the v1 BlockTable, the drawings draw what it holds."""
import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from paged_attention import runtime  # noqa: E402
from paged_attention.v1 import BlockTable  # noqa: E402
from paged_attention.viz import (  # noqa: E402
    RowsSnapshot, cell_kinds, draw_dcp_ownership, draw_kernel_blocks, draw_row_history, draw_slot_mapping_arrows,
    draw_slot_mapping_times, request_kinds, seq_color, snapshot_rows,
)
from paged_attention.viz.v1 import request_colors  # noqa: E402

DEV = runtime.DEVICE


def texts(ax: Axes, gid: str | None = None) -> list[str]:
    return [t.get_text() for t in ax.texts if gid is None or t.get_gid() == gid]


def patches(ax: Axes, gid: str) -> list:
    return [p for p in ax.patches if p.get_gid() == gid]


def arrows(ax: Axes) -> list:
    return [t for t in ax.texts if getattr(t, "arrow_patch", None) is not None]


def table(block_size=4, rows=4, cols=6, **kw):
    return BlockTable(block_size, rows, cols, 64, False, DEV, kw.pop("kernel_block_size", block_size),
                      kw.pop("interleave", 1), **kw)


def history():
    """Notebook 03's section 1: add, append, clear, move, add over stale columns, swap."""
    t = table()
    snaps = []
    t.add_row([3, 7], 0)
    t.add_row([2, 5, 9], 1)
    t.add_row([1, 4, 6, 8], 2)
    snaps.append(snapshot_rows(t, "arrive", ["A", "B", "C"], num_reqs=3))
    t.clear_row(1)
    snaps.append(snapshot_rows(t, "B leaves", ["A", None, "C"]))
    t.move_row(2, 1)
    snaps.append(snapshot_rows(t, "condense", ["A", "C", None], num_reqs=2))
    t.add_row([11], 2)
    snaps.append(snapshot_rows(t, "D arrives", ["A", "C", "D"], num_reqs=3))
    t.swap_row(0, 1)
    snaps.append(snapshot_rows(t, "swap", ["C", "A", "D"], num_reqs=3))
    return t, snaps


# --- rows over time ---------------------------------------------------------------------------------

def test_snapshot_copies_the_table_now():
    t = table()
    t.add_row([3, 7], 0)
    snap = snapshot_rows(t, "one", ["A"], num_reqs=1)
    t.append_row([9], 0)
    t.add_row([5], 1)
    assert snap.table[0] == (3, 7, 0, 0, 0, 0) and snap.table[1] == (0,) * 6
    assert snap.counts == (2, 0, 0, 0)
    assert snap.requests == ("A", None, None, None) and snap.num_reqs == 1
    assert isinstance(snap, RowsSnapshot)


def test_cell_kinds_follow_counts_and_requests():
    _, snaps = history()
    condensed, added, swapped = snaps[2], snaps[3], snaps[4]
    # move_row(2, 1): row 2 keeps C's ids and count, but nobody sits there.
    assert cell_kinds(condensed)[1] == ["counted"] * 4 + ["empty"] * 2
    assert cell_kinds(condensed)[2] == ["left_over"] * 4 + ["empty"] * 2
    # add_row([11], 2): one counted column, C's 4, 6, 8 stale after it.
    assert added.table[2] == (11, 4, 6, 8, 0, 0) and added.counts[2] == 1
    assert cell_kinds(added)[2] == ["counted", "stale", "stale", "stale", "empty", "empty"]
    # clear_row(1) zeroed B's columns: empty, not stale.
    assert cell_kinds(snaps[1])[1] == ["empty"] * 6
    # swap_row moves stale columns with the row.
    assert cell_kinds(swapped)[0] == ["counted"] * 4 + ["empty"] * 2
    assert cell_kinds(swapped)[1] == ["counted"] * 2 + ["empty"] * 4
    assert request_colors(snaps) == {"A": seq_color(0), "B": seq_color(1), "C": seq_color(2), "D": seq_color(3)}


def test_draw_row_history_draws_every_cell_by_kind():
    _, snaps = history()
    ax = draw_row_history(snaps, per_line=2)
    assert isinstance(ax, Axes)
    for kind in ("counted", "left_over", "stale", "empty"):
        expected = sum(row.count(kind) for s in snaps for row in cell_kinds(s))
        assert len(patches(ax, kind)) == expected, kind
    # Block ids are written in counted, left-over and stale cells, never in empty ones.
    assert sorted(texts(ax, "stale")) == sorted(["4", "6", "8"] * 2)       # D's row, before and after the swap
    assert len(texts(ax, "counted")) == len(patches(ax, "counted"))
    assert texts(ax, "empty") == []
    # Counted cells take their request's colour: A's first (row 0 of panel 1), D's last (row 2 of panel 5).
    counted = patches(ax, "counted")
    assert to_hex(counted[0].get_facecolor(), keep_alpha=False) == seq_color(0).lower()
    assert to_hex(counted[-1].get_facecolor(), keep_alpha=False) == seq_color(3).lower()
    labels = texts(ax)
    assert "row 2: D" in labels and "row 1: —" in labels and "n=1" in labels
    assert labels.count("commit 3") == 3 and labels.count("commit 2") == 1
    assert "1. arrive" in labels and "5. swap" in labels


def test_draw_row_history_outlines_exactly_the_changed_cells():
    _, snaps = history()
    ax = draw_row_history(snaps)
    changed = 0
    for before, after in zip(snaps, snaps[1:]):
        kb, ka = cell_kinds(before), cell_kinds(after)
        changed += sum(kb[r][c] != ka[r][c] or before.table[r][c] != after.table[r][c]
                       for r in range(4) for c in range(6))
    assert changed > 0
    assert len(patches(ax, "changed")) == changed
    assert len(patches(draw_row_history(snaps[:1]), "changed")) == 0


def test_row_history_rejects_bad_input():
    t, snaps = history()
    with pytest.raises(ValueError):
        draw_row_history([])
    with pytest.raises(TypeError):
        draw_row_history([snaps[0], "step"])
    with pytest.raises(ValueError, match="same shape"):
        draw_row_history([snaps[0], snapshot_rows(table(cols=5), "x")])
    with pytest.raises(TypeError, match="BlockTable"):
        snapshot_rows(t.get_numpy_array(), "x")
    with pytest.raises(ValueError, match="rows"):
        snapshot_rows(t, "x", ["A"] * 5)
    with pytest.raises(TypeError):
        snapshot_rows(t, "x", "ABC")
    with pytest.raises(ValueError, match="num_reqs"):
        snapshot_rows(t, "x", num_reqs=5)
    with pytest.raises(ValueError, match="per_line"):
        draw_row_history(snaps, per_line=0)


# --- the slot mapping as arrows ---------------------------------------------------------------------

def test_request_kinds():
    assert request_kinds([0, 0, 0, 1, 2, 2], [9, 10, 11, 10, 0, 1]) == {0: "prefill", 1: "decode", 2: "prefill"}
    assert request_kinds([3], [0]) == {3: "prefill"}            # a one-token prompt is not a decode
    assert list(request_kinds([2, 0], [5, 7])) == [2, 0]       # batch order
    with pytest.raises(ValueError):
        request_kinds([0, 1], [0])


def mixed_batch():
    t = table()
    t.add_row([1, 4, 6, 8], 0)
    t.add_row([3, 7, 10], 1)
    t.add_row([11, 4, 6, 8], 2)
    t.add_row([11], 2)                       # stale columns in row 2
    reqs = np.array([0, 0, 0, 0, 0, 1, 2, 2, 2])
    positions = np.array([9, 10, 11, 12, 13, 10, 0, 1, 2])
    t.compute_slot_mapping(reqs, positions)
    return t, reqs, positions, t.slot_mapping.np[:9].copy()


def test_arrows_go_from_each_token_to_its_slot():
    t, reqs, positions, slots = mixed_batch()
    assert slots.tolist() == [25, 26, 27, 32, 33, 42, 44, 45, 46]
    ax = draw_slot_mapping_arrows(reqs, positions, slots, t.block_size, requests=["C", "A", "D"])
    token_at = {round(x.get_position()[0], 6): int(x.get_text()) for x in ax.texts if x.get_gid() == "position"}
    slot_at = {round(x.get_position()[0], 6): int(x.get_text()) for x in ax.texts if x.get_gid() == "slot"}
    drawn = arrows(ax)                        # one per token, in batch order
    assert len(drawn) == len(slots)
    for arrow, p, s in zip(drawn, positions.tolist(), slots.tolist()):
        assert token_at[round(arrow.xyann[0], 6)] == p     # leaves the token's cell ...
        assert slot_at[round(arrow.xy[0], 6)] == s         # ... and reaches its slot's cell
    # Only the blocks written to are drawn, each with all its slots; the written ones are coloured.
    assert sorted(slot_at.values()) == [s for b in (6, 8, 10, 11) for s in range(4 * b, 4 * b + 4)]
    assert len(patches(ax, "written_slot")) == 9 and len(patches(ax, "slot")) == 16 - 9
    labels = texts(ax)
    assert "C (row 0)\nprefill, 5 tokens" in labels and "A (row 1)\ndecode, 1 token" in labels
    assert "block 11" in labels and "block 9" not in labels


def test_arrows_skip_tokens_of_other_ranks():
    t = table(block_size=4, rows=1, cols=3, dcp_world_size=2, dcp_rank=1)
    t.add_row([10, 11, 12], 0)
    positions = np.arange(8)
    t.compute_slot_mapping(np.zeros(8, dtype=np.int64), positions)
    slots = t.slot_mapping.np[:8]
    assert slots.tolist() == [-1, 40, -1, 41, -1, 42, -1, 43]
    ax = draw_slot_mapping_arrows(np.zeros(8, dtype=np.int64), positions, slots, 4)
    assert len(arrows(ax)) == 4
    assert len(patches(ax, "pad_token")) == 4 and len(patches(ax, "token")) == 4
    assert texts(ax).count("-1") == 4


def test_arrows_reject_bad_input():
    with pytest.raises(ValueError, match="same length"):
        draw_slot_mapping_arrows([0, 0], [0, 1], [4], 4)
    with pytest.raises(ValueError, match=">= 0"):
        draw_slot_mapping_arrows([0], [0], [-2], 4)
    with pytest.raises(ValueError, match="block_size"):
        draw_slot_mapping_arrows([0], [0], [4], 0)
    with pytest.raises(TypeError):
        draw_slot_mapping_arrows([0.5], [0], [4], 4)
    with pytest.raises(ValueError, match="no tokens"):
        draw_slot_mapping_arrows([], [], [], 4)


# --- DCP --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 1), (4, 8), (2, 8)])
def test_dcp_drawing_places_each_token_where_its_rank_stores_it(world, interleave):
    B, n = 8, 64
    ax = draw_dcp_ownership(n, world, interleave, B)
    virtual = B * world
    columns = -(-n // virtual)
    for rank in range(world):
        # This rank's own table over blocks 0, 1, 2, ...: the slot is the local place itself.
        t = table(block_size=B, rows=1, cols=columns, interleave=interleave, dcp_world_size=world, dcp_rank=rank)
        t.add_row(list(range(columns)), 0)
        t.compute_slot_mapping(np.zeros(n, dtype=np.int64), np.arange(n))
        slots = t.slot_mapping.np[:n]
        mine = [p for p in range(n) if slots[p] >= 0]
        assert sorted(int(s) for s in texts(ax, f"rank{rank}")) == mine         # top strip colours
        drawn = {int(x.get_text()): x.get_position() for x in ax.texts if x.get_gid() == f"local{rank}"}
        assert sorted(drawn) == mine
        for p in mine:
            s = int(slots[p])
            assert drawn[p][0] - 0.5 == s % B                 # its place in the rank's block ...
        # ... and the rank's blocks 0, 1, ... one band under the other: top to bottom, left to right
        # is the order of the slots.
        by_place = sorted(mine, key=lambda p: (-drawn[p][1], drawn[p][0]))
        assert by_place == sorted(mine, key=lambda p: int(slots[p]))
        assert len({drawn[p][1] for p in mine}) == len({int(slots[p]) // B for p in mine})
    for j in range(columns):
        assert f"column {j}: positions {j * virtual}–{min((j + 1) * virtual, n) - 1}" in texts(ax)


def test_dcp_drawing_rejects_bad_input():
    with pytest.raises(ValueError, match="divide"):
        draw_dcp_ownership(32, 2, 3, 8)
    with pytest.raises(ValueError):
        draw_dcp_ownership(0, 2, 1, 8)
    draw_dcp_ownership(8, 1, 3, 8)            # no DCP: any interleave is fine


# --- hybrid blocks ----------------------------------------------------------------------------------

def test_kernel_blocks_match_the_table():
    t = table(block_size=32, rows=2, cols=4, kernel_block_size=16)
    t.add_row([5, 9], 1)
    ax = draw_kernel_blocks([5, 9], 32, 16, position=17)
    kernel = [int(s.split()[1]) for s in texts(ax, "kernel_block")]
    assert kernel == t.get_numpy_array()[1, :4].tolist() == [10, 11, 18, 19]
    assert texts(ax, "manager_block") == ["manager block 5", "manager block 9"]
    note = texts(ax, "position")[0]
    t.compute_slot_mapping(np.array([1]), np.array([17]))
    slot = int(t.slot_mapping.np[0])
    assert slot == 177 and f"= {slot} = 5·32 + 17" in note and "kernel block 11" in note
    # The marker sits inside the kernel block holding position 17, at the same x in both rows.
    xs = {line.get_xdata()[0] for line in ax.lines if line.get_gid() == "position"}
    assert len(xs) == 1
    box = patches(ax, "kernel_block")[1]
    assert box.get_x() <= xs.pop() < box.get_x() + box.get_width()
    assert texts(draw_kernel_blocks([3], 16, 16), "kernel_block") == ["kernel 3"]   # bpk 1: unchanged


def test_kernel_blocks_reject_bad_input():
    with pytest.raises(ValueError, match="divide"):
        draw_kernel_blocks([5], 32, 12)
    with pytest.raises(ValueError, match="position"):
        draw_kernel_blocks([5, 9], 32, 16, position=64)
    with pytest.raises(ValueError):
        draw_kernel_blocks([], 32, 16)


# --- timings ----------------------------------------------------------------------------------------

def test_draw_slot_mapping_times():
    times = {"compute_slot_mapping (numpy)": [20.0, 21.0, 30.0], "Python loop": [10.0, 40.0, 160.0]}
    ax = draw_slot_mapping_times([16, 64, 256], times)
    assert [line.get_label() for line in ax.lines] == list(times)
    assert [list(line.get_ydata()) for line in ax.lines] == list(times.values())
    assert list(ax.lines[0].get_xdata()) == [16, 64, 256]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    with pytest.raises(ValueError):
        draw_slot_mapping_times([16, 64], times)
    with pytest.raises(ValueError):
        draw_slot_mapping_times([16, 64, 256], {"x": [1.0, -2.0, 3.0]})
    with pytest.raises(ValueError):
        draw_slot_mapping_times([16, 64, 256], {})
