"""paged_attention.viz.v2: the helpers agree with the v2 buffers and kernels, the drawings draw what they hold."""
import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from paged_attention import runtime  # noqa: E402
from paged_attention.utils import cdiv  # noqa: E402
from paged_attention.v2 import (  # noqa: E402
    FastBlockTables, SlotProgram, StagedWriteTensor, UvaBackedTensor, apply_writes, fast_slot_programs, gather_kinds,
    make_block_tables, vllm_slot_programs,
)
from paged_attention.viz import (  # noqa: E402
    StagedWrite, UvaSnapshot, draw_gather, draw_slot_mapping_grid, draw_staged_writes,
    draw_uva_counters, draw_v2_step_times, seq_color, snapshot_uva, staged_writes,
)

DEV = runtime.DEVICE


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def texts(ax: Axes, gid: str | None = None) -> list[str]:
    return [t.get_text() for t in ax.texts if gid is None or t.get_gid() == gid]


def patches(ax: Axes, gid: str) -> list:
    return [p for p in ax.patches if p.get_gid() == gid]


def color(patch) -> str:
    return to_hex(patch.get_facecolor(), keep_alpha=False)


# --- staged writes ---------------------------------------------------------------------------------

def staged_tensor():
    t = StagedWriteTensor((4, 8), torch.int32, DEV)
    t.stage_write(1, 0, [9])
    t.stage_write(2, 0, [4, 8])
    t.apply_write()
    return t


def test_staged_writes_reads_the_lists_without_applying():
    t = staged_tensor()
    assert staged_writes(t) == []
    t.stage_write(0, 0, [3, 7, 10])
    t.stage_write(2, 2, [11])
    t.stage_write(3, 1, [])                           # empty: stages nothing
    t.stage_write_elem(3, 5)
    writes = staged_writes(t)
    assert writes == [StagedWrite(0, 0, (3, 7, 10)), StagedWrite(2, 2, (11,)), StagedWrite(3, 0, (5,))]
    assert t.num_staged_writes == 3                   # still staged
    assert staged_writes(t) == writes                 # reading twice gives the same
    with pytest.raises(TypeError):
        staged_writes(t.gpu)


def test_apply_writes_is_what_the_kernel_does():
    t = staged_tensor()
    before = t.gpu.cpu().numpy().copy()
    for row, start, ids in [(0, 0, [3, 7, 10]), (2, 2, [11, 12]), (3, 5, [1, 2, 3]), (1, 1, [6])]:
        t.stage_write(row, start, ids)
    writes = staged_writes(t)
    model = apply_writes(before, writes)
    t.apply_write()
    assert np.array_equal(model, t.gpu.cpu().numpy())
    assert model[2].tolist() == [4, 8, 11, 12, 0, 0, 0, 0] and model[1].tolist() == [9, 6, 0, 0, 0, 0, 0, 0]
    assert before[0].tolist() == [0] * 8                   # the input is not modified
    assert np.array_equal(apply_writes(before, []), before)


def test_apply_writes_refuses_what_the_kernel_cannot_do():
    table = np.zeros((2, 4), dtype=np.int32)
    with pytest.raises(ValueError, match="overlap"):
        apply_writes(table, [(0, 0, [1, 2]), (0, 1, [3])])
    apply_writes(table, [(0, 0, [1, 2]), (0, 2, [3]), (1, 1, [5])])     # touching is fine
    with pytest.raises(ValueError):
        apply_writes(table, [(0, 3, [1, 2])])                           # past the row's end
    with pytest.raises(IndexError):
        apply_writes(table, [(2, 0, [1])])
    with pytest.raises(TypeError):
        apply_writes(table, [(0, 0)])
    with pytest.raises(TypeError):
        apply_writes(table, [(0, 0, ["a"])])
    with pytest.raises(ValueError):
        apply_writes(np.zeros(4), [])                                   # not 2-D


def test_draw_staged_writes_colours_each_write_as_its_program():
    t = staged_tensor()
    before = t.gpu.cpu().numpy().copy()
    writes = [(0, 0, [3, 7, 10]), (2, 2, [11]), (3, 0, [5, 6, 12, 13, 14])]
    ax = draw_staged_writes(writes, before)
    assert isinstance(ax, Axes)
    written = patches(ax, "written")
    assert len(written) == 3 + 1 + 5
    # In row-major order: write 0's three cells, then write 1's one (row 2), then write 2's five.
    assert [color(p) for p in written] == [seq_color(0).lower()] * 3 + [seq_color(1).lower()] + \
        [seq_color(2).lower()] * 5
    assert sorted(texts(ax, "written")) == sorted(["3", "7", "10", "11", "5", "6", "12", "13", "14"])
    # Non-zero cells no write touched: 9 in row 1, 4 and 8 in row 2, in both tables.
    assert sorted(texts(ax, "kept")) == ["4", "8", "9"] and sorted(texts(ax, "before")) == ["4", "8", "9"]
    assert len(texts(ax, "write_entry")) == 3
    assert any("grid (3,)" in s for s in texts(ax))
    # Given the kernel's result, the drawing shows it (the same here).
    for w in writes:
        t.stage_write(*w)
    t.apply_write()
    ax2 = draw_staged_writes(writes, before, t.gpu)
    assert texts(ax2, "written") == texts(ax, "written")
    with pytest.raises(ValueError):
        draw_staged_writes(writes, before, np.zeros((3, 8), dtype=np.int32))


# --- UVA counts ----------------------------------------------------------------------------------------

def test_snapshot_uva_follows_the_pool():
    counts = UvaBackedTensor((2, 3), torch.int32)
    s0 = snapshot_uva(counts, "made")
    assert isinstance(s0, UvaSnapshot)
    assert s0.gpu_buffer == 1 and s0.next_buffer == 0 and s0.gpu_rows == 2    # the cursor moves first
    counts.np[0, 1] = 5
    counts.np[1, 2] = 7
    s1 = snapshot_uva(counts, "edited")
    assert s1.host == ((0, 5, 0), (0, 0, 7)) and s1.gpu_view == ((0, 0, 0), (0, 0, 0))
    assert s1.unpublished() == [(0, 1), (1, 2)]
    counts.copy_to_uva()
    s2 = snapshot_uva(counts, "copied")
    assert s2.gpu_buffer == 0 and s2.next_buffer == 1 and s2.unpublished() == []
    assert s2.buffers[0] == s2.host and s2.buffers[1] == ((0, 0, 0), (0, 0, 0))
    counts.np[0, 0] = 1
    counts.copy_to_uva(1)                       # only the first row: .gpu has 1 row
    s3 = snapshot_uva(counts, "one row")
    assert s3.gpu_buffer == 1 and s3.gpu_rows == 1 and s3.gpu_view == ((1, 5, 0),)
    assert s3.unpublished() == [(1, 0), (1, 1), (1, 2)]     # row 1 is not in .gpu at all
    # Snapshots are copies: later edits do not change them.
    counts.np[:] = 9
    assert s1.host == ((0, 5, 0), (0, 0, 7))
    with pytest.raises(TypeError):
        snapshot_uva(counts.np, "x")


def test_snapshot_uva_of_block_tables_counts():
    bt = FastBlockTables([4, 8], 3, 8, 16, DEV)
    bt.append_block_ids(1, ([1, 2], [3]), overwrite=True)
    before = snapshot_uva(bt.num_blocks, "staged")
    assert before.unpublished() == [(0, 1), (1, 1)]
    bt.apply_staged_writes()
    after = snapshot_uva(bt.num_blocks, "applied")
    assert after.unpublished() == [] and after.gpu_buffer != before.gpu_buffer
    assert after.gpu_view == ((0, 2, 0), (0, 1, 0))


def test_draw_uva_counters_marks_gpu_and_unpublished_cells():
    counts = UvaBackedTensor((2, 3), torch.int32)
    snaps = [snapshot_uva(counts, "made")]
    counts.np[0, 1] = 5
    snaps.append(snapshot_uva(counts, "edited"))
    counts.copy_to_uva()
    snaps.append(snapshot_uva(counts, "copied"))
    ax = draw_uva_counters(snaps, row_labels=["group 0", "group 1"])
    assert isinstance(ax, Axes)
    assert texts(ax, "gpu_marker") == ["← .gpu"] * 3
    assert len(patches(ax, "unpublished")) == 1
    assert len(patches(ax, "host")) == 3 * 6 - 1
    assert len(patches(ax, "gpu")) == 3 * 6 and len(patches(ax, "old")) == 3 * 6
    assert "1. made" in texts(ax) and "group 1" in texts(ax)
    with pytest.raises(ValueError):
        draw_uva_counters(snaps, row_labels=["only one"])
    with pytest.raises(ValueError):
        draw_uva_counters([])
    with pytest.raises(ValueError):
        draw_uva_counters(snaps + [snapshot_uva(UvaBackedTensor((1, 3), torch.int32), "other")])


# --- the gather --------------------------------------------------------------------------------------------

def gathered_two_steps(impl):
    """Notebook 04's section 4: A, B, C gathered as C, A, B; then E in A's state, B grows, batch B, E, C + padding."""
    bt = make_block_tables([4], 5, 16, 24, DEV, impl=impl)
    for state, ids in ((0, [3, 7, 10, 12]), (1, [5]), (2, [2, 9])):
        bt.append_block_ids(state, (ids,), overwrite=True)
    bt.apply_staged_writes()
    bt.gather_block_tables(i32([2, 0, 1]))
    bt.append_block_ids(0, ([8],), overwrite=True)
    bt.append_block_ids(1, ([6],), overwrite=False)
    bt.apply_staged_writes()
    (rows,) = bt.gather_block_tables(i32([1, 0, 2]), num_reqs_padded=4)
    return bt, rows


@pytest.mark.parametrize("impl", ["vllm", "triton"])
def test_gather_kinds_match_the_kernel(impl):
    bt, rows = gathered_two_steps(impl)
    kinds = gather_kinds(bt.num_blocks.np[0], [1, 0, 2], rows)
    assert rows.tolist() == [[5, 6, 0, 0, 0, 0], [8, 7, 10, 12, 0, 0], [2, 9, 0, 0, 0, 0], [0] * 6]
    assert kinds == [["copied"] * 2 + ["empty"] * 4,
                     ["copied"] + ["stale"] * 3 + ["empty"] * 2,
                     ["copied"] * 2 + ["empty"] * 4,
                     ["padding"] * 6]


def test_gather_kinds_checks_its_input():
    with pytest.raises(ValueError):
        gather_kinds([1, 2], [0, 1, 0], np.zeros((2, 3), dtype=np.int32))      # more batch rows than the table
    with pytest.raises(IndexError):
        gather_kinds([1, 2], [2], np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(TypeError):
        gather_kinds([1, 2], [0.5], np.zeros((1, 3), dtype=np.int32))


def test_draw_gather_draws_arrows_and_cells_by_kind():
    bt, rows = gathered_two_steps("triton")
    idx = [1, 0, 2]
    ax = draw_gather(bt.block_tables[0].gpu, bt.num_blocks.np[0], idx, rows, requests=["E", "B", "C"])
    assert isinstance(ax, Axes)
    arrows = [t for t in ax.texts if t.get_gid() == "gather_arrow"]
    assert len(arrows) == 3
    assert [to_hex(a.arrow_patch.get_edgecolor(), keep_alpha=False) for a in arrows] == \
        [seq_color(s).lower() for s in idx]
    assert len(patches(ax, "copied")) == 2 + 1 + 2
    assert sorted(texts(ax, "stale")) == ["10", "12", "7"]
    assert len(patches(ax, "padding")) == 6
    # Left: state 0 holds E's 8 and A's stale 7, 10, 12 (left by the shorter overwrite).
    assert len(patches(ax, "held")) == 1 + 2 + 2 and sorted(texts(ax, "held_stale")) == ["10", "12", "7"]
    labels = texts(ax)
    assert "state 0: E" in labels and "batch 1 ← state 0" in labels and "batch 3: padding" in labels
    assert "state 3: —" in labels
    with pytest.raises(ValueError):
        draw_gather(bt.block_tables[0].gpu, [1, 2], idx, rows)                 # counts of 2 of 5 states
    with pytest.raises(ValueError):
        draw_gather(bt.block_tables[0].gpu, bt.num_blocks.np[0], idx, rows[:, :3])


# --- the slot-mapping grid -------------------------------------------------------------------------------

def test_vllm_slot_programs_cover_each_group_once():
    qsl = [0, 3, 3, 5, 9]
    progs = vllm_slot_programs(qsl, 16, 2)
    assert len(progs) == 2 * (4 + 1)
    assert progs[0] == SlotProgram((0, 0), 0, 0, 3, "request")
    assert progs[1] == SlotProgram((0, 1), 0, 3, 3, "request")          # an empty request still has a program
    assert progs[4] == SlotProgram((0, 4), 0, 9, 16, "padding")          # pads from the real token count
    for g in range(2):
        mine = [p for p in progs if p.group == g]
        assert [p.pid for p in mine] == [(g, b) for b in range(5)]
        covered = [t for p in mine for t in range(p.start, p.stop)]
        assert covered == list(range(16))                              # every slot once, in order
    assert vllm_slot_programs([0], 4, 1) == [SlotProgram((0, 0), 0, 0, 4, "padding")]
    for bad in ([1, 3], [0, 3, 2], [0, 17]):
        with pytest.raises(ValueError):
            vllm_slot_programs(bad, 16, 1)
    with pytest.raises(ValueError):
        vllm_slot_programs([0, 1], 16, 0)


def test_fast_slot_programs_tile_the_buffer():
    progs = fast_slot_programs(10, 4)
    assert [(p.pid, p.start, p.stop, p.kind, p.group) for p in progs] == \
        [((0,), 0, 4, "tile", None), ((1,), 4, 8, "tile", None), ((2,), 8, 10, "tile", None)]
    assert len(fast_slot_programs(16384, 128)) == 128
    assert len(fast_slot_programs(16384, 1024)) == 16
    with pytest.raises(ValueError):
        fast_slot_programs(10, 0)


def test_fast_grid_is_the_kernels_grid():
    bt = FastBlockTables([16, 32], 4, 40, 64, DEV)
    assert len(fast_slot_programs(bt.max_num_batched_tokens, bt.slot_block_tokens)) == \
        cdiv(bt.max_num_batched_tokens, bt.slot_block_tokens)


def test_draw_slot_mapping_grid_draws_every_program():
    qsl = [0, 3, 3, 5]
    ax = draw_slot_mapping_grid(qsl, 16, 2, 4, requests=["A", "B", "C"])
    assert isinstance(ax, Axes)
    assert len(patches(ax, "vllm_program")) == 2 * 3                   # the empty request's too
    assert len(patches(ax, "vllm_padding")) == 2
    assert len(patches(ax, "fast_program")) == 4
    assert len(patches(ax, "token")) == 5 and len(patches(ax, "pad_token")) == 11
    tokens = patches(ax, "token")
    assert color(tokens[0]) == seq_color(0).lower() and color(tokens[3]) == seq_color(2).lower()
    assert "8 programs" in " ".join(texts(ax, "vllm_count")) and "4 programs" in " ".join(texts(ax, "fast_count"))
    assert "(1, 3)" in texts(ax)                                       # group 1's padding program
    with pytest.raises(ValueError):
        draw_slot_mapping_grid(qsl, 16, 2, 4, requests=["A"])
    with pytest.raises(ValueError):
        draw_slot_mapping_grid([0, 20], 16, 2, 4)


# --- timings ---------------------------------------------------------------------------------------------

def test_draw_v2_step_times_one_line_per_path():
    sizes = [8, 32, 128]
    times = {"v1: numpy + copies": [30.0, 60.0, 200.0], "v2 vLLM's kernels": [40.0, 42.0, 50.0], "v2 ours": [35.0, 36.0, 38.0]}
    ax = draw_v2_step_times(sizes, times, title="t")
    assert [line.get_label() for line in ax.get_lines()] == list(times)
    assert list(ax.get_lines()[0].get_xdata()) == sizes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log" and ax.get_title() == "t"
    with pytest.raises(ValueError):
        draw_v2_step_times(sizes, {"v1": [1.0, 2.0]})
    with pytest.raises(ValueError):
        draw_v2_step_times(sizes, {"v1": [1.0, 0.0, 2.0]})
    with pytest.raises(ValueError):
        draw_v2_step_times([], {"v1": []})
