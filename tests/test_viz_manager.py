"""paged_attention.viz.manager: the pool drawings show exactly what the scheduler recorded."""
import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager  # noqa: E402
from paged_attention.legacy.records import RECOMPUTED, SWAPPED_IN, SWAPPED_OUT, WAITED  # noqa: E402
from paged_attention.legacy.sharing_sim import SharingSavings  # noqa: E402
from paged_attention.legacy.workload import Request, SimulatedEngine, synthetic_workload  # noqa: E402
from paged_attention.viz import (  # noqa: E402
    draw_pool_over_time, draw_pools_over_time, draw_sharing_savings, event_steps, owner_runs, request_color,
)
from paged_attention.viz.manager import CROSS_HATCH, REQUEST_COLORS  # noqa: E402
from paged_attention.viz.legacy import SHARED_HATCH  # noqa: E402


def demo_history():
    requests = synthetic_workload(10, seed=4, n=(1, 1, 2, 3), arrival_every=1.5, mean_prompt_len=16,
                                  mean_output_len=16, max_len=48)
    sched = SimulatedEngine(SelfAttnBlockSpaceManager(4, 32, 16, watermark=0.1), requests)
    sched.run()
    return sched.history


def texts(ax):
    return [t.get_text() for t in ax.texts]


def test_owner_runs_rebuild_every_snapshot():
    history = demo_history()
    for device in ("GPU", "CPU"):
        runs = owner_runs(history, device)
        assert runs == sorted(runs, key=lambda r: (r.block_id, r.start))
        rebuilt = {}
        for run in runs:
            assert run.start < run.end
            for step in range(run.start, run.end):
                assert (step, run.block_id) not in rebuilt          # runs of one block never overlap
                rebuilt[step, run.block_id] = run.owner
        snapshots = {(r.step, b): o for r in history
                     for b, o in (r.gpu_owners if device == "GPU" else r.cpu_owners).items()}
        assert rebuilt == snapshots
        # Adjacent runs of one block differ in owner, or have a gap: otherwise they would be one run.
        for a, b in zip(runs, runs[1:]):
            if a.block_id == b.block_id and a.end == b.start:
                assert a.owner != b.owner


def test_event_steps_lists_each_mark_once():
    history = demo_history()
    marks = event_steps(history)
    for kind in (SWAPPED_OUT, SWAPPED_IN, RECOMPUTED):
        expected = sorted({r.step for r in history for e in r.events if e.kind == kind})
        assert marks[kind] == expected and expected
    watermark = sorted({r.step for r in history for e in r.events if e.kind == WAITED and e.on_watermark})
    anyway = sorted({r.step for r in history for e in r.events if e.kind == WAITED})
    assert marks[WAITED] == watermark and 0 < len(watermark) < len(anyway)   # not every wait is the watermark's


def test_draw_pools_over_time():
    history = demo_history()
    gpu_ax, cpu_ax = draw_pools_over_time(history, 32, 16)
    assert isinstance(gpu_ax, Axes) and isinstance(cpu_ax, Axes) and gpu_ax.figure is cpu_ax.figure
    marks = event_steps(history)
    for ax in (gpu_ax, cpu_ax):
        dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
        assert len(dashed) == len(marks[SWAPPED_OUT]) + len(marks[SWAPPED_IN])
        assert sorted(line.get_xdata()[0] + 0.5 for line in dashed) == sorted(marks[SWAPPED_OUT] + marks[SWAPPED_IN])
    # One bar collection per run; hatched where shared, coloured by the request that holds it.
    assert len(gpu_ax.collections) == len(owner_runs(history, "GPU"))
    assert len(cpu_ax.collections) == len(owner_runs(history, "CPU"))
    runs = owner_runs(history, "GPU")
    hatches = [c.get_hatch() for c in gpu_ax.collections]
    assert hatches == [SHARED_HATCH if r.owner.shared else None for r in runs]
    legend = [t.get_text() for t in gpu_ax.get_legend().get_texts()]
    assert legend[:10] == [f"r{i}" for i in range(10)]                  # arrival order
    assert "waited: watermark" in legend and cpu_ax.get_legend() is None
    markers = [line for line in gpu_ax.lines if line.get_marker() in ("v", "X")]
    assert [len(m.get_xdata()) for m in markers] == [len(marks[WAITED]), len(marks[RECOMPUTED])]
    assert gpu_ax.get_ylim()[1] == pytest.approx(31.5) and cpu_ax.get_ylim()[1] == pytest.approx(15.5)


def test_draw_pool_shows_requests_sharing_a_prefix_cross_hatched():
    system = tuple(range(900, 908))
    requests = [Request("a", 0, system + (1, 2), (6,)), Request("b", 1, system + (3,), (4,))]
    sched = SimulatedEngine(SelfAttnBlockSpaceManager(4, 12, 4, watermark=0.0, enable_caching=True), requests)
    sched.run()
    ax = draw_pool_over_time(sched.history, 12, "GPU")
    crossed = [c for c in ax.collections if c.get_hatch() == CROSS_HATCH]
    runs = [r for r in owner_runs(sched.history) if r.owner.request_ids == ("a", "b")]
    assert len(crossed) == len(runs) == 2                               # the two system-prompt blocks
    assert ax.get_title(loc="left") == "GPU pool: 12 blocks"


def test_drawing_is_deterministic_and_uses_given_axes():
    history = demo_history()
    _, axes = plt.subplots(2, 1)
    assert tuple(draw_pools_over_time(history, 32, 16, axes=axes)) == tuple(axes)
    again = draw_pools_over_time(demo_history(), 32, 16)
    assert [c.get_facecolor().tolist() for c in axes[0].collections] == \
        [c.get_facecolor().tolist() for c in again[0].collections]
    assert request_color(0) == REQUEST_COLORS[0] and request_color(12) == request_color(0)


def test_pool_drawings_reject_bad_input():
    history = demo_history()
    with pytest.raises(TypeError, match="StepRecord"):
        owner_runs(history[0])
    with pytest.raises(TypeError, match="StepRecord"):
        owner_runs([1, 2])
    with pytest.raises(ValueError, match="empty"):
        event_steps([])
    with pytest.raises(ValueError, match="consecutive"):
        owner_runs(history[::2])
    with pytest.raises(ValueError, match="device"):
        owner_runs(history, "TPU")
    with pytest.raises(ValueError, match="num_blocks is 8"):
        draw_pool_over_time(history, 8)
    with pytest.raises(ValueError, match="two Axes"):
        draw_pools_over_time(history, 32, 16, axes=[plt.gca()])
    with pytest.raises(ValueError, match="colour"):
        draw_pool_over_time(history, 32, colors={"r0": "red"})


def test_draw_sharing_savings():
    parallel = [SharingSavings("parallel", n, 100 - 3 * n + 3, 100, 10, 10) for n in (1, 2, 4)]
    beam = [SharingSavings("beam", n, 100 - 20 * (n - 1), 100, 10, 10) for n in (1, 2, 4)]
    ax = draw_sharing_savings({"parallel": parallel, "beam": beam})
    labels = texts(ax)
    assert labels == [f"{100 * p.saving:.1f}%" for p in parallel + beam]
    assert [tuple(line.get_ydata()) for line in ax.lines] == [tuple(100 * p.saving for p in pts)
                                                              for pts in (parallel, beam)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "paper, parallel sampling: 6.1–9.8%" in legend and "paper, beam search: 37.6–55.2%" in legend
    bare = draw_sharing_savings({"parallel": parallel}, paper=None)
    assert not any(t.get_text().startswith("paper") for t in bare.get_legend().get_texts())
    with pytest.raises(ValueError, match="mode"):
        draw_sharing_savings({"greedy": parallel})
    with pytest.raises(TypeError, match="mode 'beam'"):
        draw_sharing_savings({"beam": parallel})
    with pytest.raises(ValueError):
        draw_sharing_savings({})


def test_the_legend_lists_only_what_the_drawing_has():
    requests = [Request("a", 0, (1, 2, 3), (3, 3)), Request("b", 0, (4, 5), (2,))]
    sched = SimulatedEngine(SelfAttnBlockSpaceManager(4, 8, 0, watermark=0.0), requests)
    sched.run()
    legend = [t.get_text() for t in draw_pool_over_time(sched.history, 8).get_legend().get_texts()]
    assert legend == ["a", "b", "shared by samples"]          # no swaps, waits or prefix sharing here
    titled = draw_pool_over_time(sched.history, 8, title="mine")
    assert titled.get_title() == "mine" and titled.get_title(loc="left") == ""


def test_highlight_greys_out_every_other_request_and_mark_step_shades_one_column():
    from matplotlib.colors import to_rgba

    from paged_attention.viz.manager import FADED_COLOR

    history = demo_history()
    gpu_ax, _ = draw_pools_over_time(history, 32, 16, highlight="r7", mark_step=5)
    runs = owner_runs(history, "GPU")
    for run, bars in zip(runs, gpu_ax.collections):
        want = request_color(7) if run.owner.request_ids[0] == "r7" else FADED_COLOR
        assert bars.get_facecolor()[0].tolist() == pytest.approx(list(to_rgba(want, 0.9)))
    assert any(r.owner.request_ids[0] == "r7" for r in runs)
    shaded = [p for p in gpu_ax.patches if p.get_x() == pytest.approx(4.5) and p.get_width() == pytest.approx(1.0)]
    assert len(shaded) == 1
    plt.close("all")
    before = len(plt.get_fignums())
    for bad in ({"highlight": "r99"}, {"mark_step": len(history)}, {"mark_step": 1.5}):
        with pytest.raises(ValueError):
            draw_pools_over_time(history, 32, 16, **bad)
    assert len(plt.get_fignums()) == before          # refused before any figure was made


def test_long_bars_name_their_holder_and_crop_stops_at_the_highest_block():
    history = demo_history()
    ax = draw_pool_over_time(history, 32, "GPU")
    from paged_attention.viz.manager import LABEL_MIN_STEPS
    long_runs = [r for r in owner_runs(history, "GPU") if r.end - r.start >= LABEL_MIN_STEPS]
    labels = [t for t in ax.texts if t.get_gid() == "holder"]
    assert sorted(t.get_text() for t in labels) == sorted("+".join(r.owner.request_ids) for r in long_runs)
    assert all(t.get_position()[1] == r.block_id for t, r in zip(
        sorted(labels, key=lambda t: (t.get_position()[1], t.get_position()[0])), long_runs))
    plt.close(ax.figure)
    # Highlighting names only the followed request.
    ax = draw_pool_over_time(history, 32, "GPU", highlight="r7")
    assert {t.get_text() for t in ax.texts if t.get_gid() == "holder"} == {"r7"}
    plt.close(ax.figure)
    # A pool of 96 blocks that the run used up to block 31: the axis stops there, and says so.
    ax = draw_pool_over_time(history, 96, "GPU", crop=True)
    highest = max(r.block_id for r in owner_runs(history, "GPU"))
    assert ax.get_ylim()[1] == pytest.approx(highest + 0.5)
    assert f"blocks {highest + 1} to 95 stayed free (not drawn)" in texts(ax)
    plt.close(ax.figure)
