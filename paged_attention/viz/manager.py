"""Drawing the legacy block manager at work: its GPU and CPU pools over time, and what sharing saves.

* ``draw_pools_over_time``: one row per block id, one column per step of an ``FcfsScheduler``
  run, coloured by the request that holds the block; hatched where several sequences hold it;
  vertical lines where a group was swapped out or in, and marks where admission waited on the
  watermark or a group was preempted by recomputation. Its pure helpers, ``owner_runs`` and
  ``event_steps``, say what is drawn and can be checked against the run.
* ``draw_sharing_savings``: the memory sharing saved against n (``sharing_sim``), next to the
  ranges the PagedAttention paper measured.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from paged_attention.legacy.records import RECOMPUTED, SWAPPED_IN, SWAPPED_OUT, WAITED, BlockOwner, StepRecord
from paged_attention.legacy.sharing_sim import MODES, PAPER_SAVINGS, SharingSavings
from paged_attention.utils import check_int, is_int
from paged_attention.viz.legacy import SHARED_HATCH
from paged_attention.viz.style import EDGE_COLOR, PAPER_COLOR, SEQ_COLORS, new_axes

# Twelve request colours: the sequence colours first, so that request 0 looks like sequence 0.
REQUEST_COLORS: tuple[str, ...] = SEQ_COLORS + ("#E45756", "#9D755D", "#EECA3B", "#8CD17D", "#D37295", "#79706E")
CROSS_HATCH = "xxxx"          # a block held by several requests (a shared prefix)
FADED_COLOR = "#DDDDDD"       # the requests not highlighted
MARK_COLOR = "#F2CF5B"        # the step a stepper shows
SWAP_OUT_COLOR = "#C0392B"
SWAP_IN_COLOR = "#1E8449"
MODE_LABELS = {"parallel": "parallel sampling", "beam": "beam search"}
ROW_INCHES = 0.13           # the height of one block's row
LABEL_MIN_STEPS = 4         # a bar this many steps long or longer is labelled with its holder


def _ink(color: str) -> str:
    """Black or white, whichever reads better on ``color``."""
    from matplotlib.colors import to_rgb
    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def request_color(index: int) -> str:
    """The colour of the ``index``-th request (in arrival order), cycling after twelve."""
    return REQUEST_COLORS[index % len(REQUEST_COLORS)]


# --------------------------------------------------------------------------------------------
# 1. What is drawn
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnerRun:
    """One block held by the same owner over consecutive steps ``[start, end)``."""

    block_id: int
    start: int
    end: int
    owner: BlockOwner


def _checked_history(history: Any) -> list[StepRecord]:
    if isinstance(history, StepRecord) or not isinstance(history, Sequence) or isinstance(history, str):
        raise TypeError(f"history must be a list of StepRecords (FcfsScheduler.history), got {type(history).__name__}")
    if not history:
        raise ValueError("history is empty: run the scheduler first")
    for k, record in enumerate(history):
        if not isinstance(record, StepRecord):
            raise TypeError(f"history[{k}] is a {type(record).__name__}, not a StepRecord")
    steps = [record.step for record in history]
    if steps != list(range(steps[0], steps[0] + len(steps))):
        raise ValueError(f"history must hold consecutive steps, got {steps[:8]}...")
    if not all(record.owners_recorded for record in history):
        raise ValueError("these records hold no block owners: make the scheduler with record_block_owners=True "
                         "(LLM(record_block_owners=True))")
    return list(history)


def _device(device: str) -> str:
    if device not in ("GPU", "CPU"):
        raise ValueError(f"device must be 'GPU' or 'CPU', got {device!r}")
    return device


def owner_runs(history: Sequence[StepRecord], device: str = "GPU") -> list[OwnerRun]:
    """The bars of the pool drawing: for each block, the stretches of steps with one owner
    (same requests, same number of holders), sorted by block id then start step."""
    history = _checked_history(history)
    device = _device(device)
    open_runs: dict[int, OwnerRun] = {}
    runs: list[OwnerRun] = []
    for record in history:
        owners = record.gpu_owners if device == "GPU" else record.cpu_owners
        for block_id, run in list(open_runs.items()):
            if owners.get(block_id) != run.owner:
                runs.append(OwnerRun(block_id, run.start, record.step, run.owner))
                del open_runs[block_id]
        for block_id, owner in owners.items():
            if block_id not in open_runs:
                open_runs[block_id] = OwnerRun(block_id, record.step, record.step + 1, owner)
    last = history[-1].step + 1
    runs.extend(OwnerRun(r.block_id, r.start, last, r.owner) for r in open_runs.values())
    return sorted(runs, key=lambda r: (r.block_id, r.start))


def event_steps(history: Sequence[StepRecord]) -> dict[str, list[int]]:
    """The steps at which groups were swapped out, swapped in, preempted by recomputation, or
    admission waited on the watermark alone (``WAITED`` with ``on_watermark``), each once."""
    history = _checked_history(history)
    marks: dict[str, list[int]] = {SWAPPED_OUT: [], SWAPPED_IN: [], RECOMPUTED: [], WAITED: []}
    for record in history:
        for event in record.events:
            if event.kind in marks and (event.kind != WAITED or event.on_watermark):
                if record.step not in marks[event.kind]:
                    marks[event.kind].append(record.step)
    return marks


def _request_order(history: list[StepRecord]) -> list[str]:
    """Every request that holds a block at some point, in arrival order: the running list is
    kept in arrival order, and a request runs before it can hold a block anywhere."""
    order: dict[str, None] = {}
    for record in history:
        order.update(dict.fromkeys(record.running + record.swapped))
        for owners in (record.gpu_owners, record.cpu_owners):
            for owner in owners.values():
                order.update(dict.fromkeys(owner.request_ids))
    return list(order)


# --------------------------------------------------------------------------------------------
# 2. The pools over time
# --------------------------------------------------------------------------------------------

def _legend_handles(history: list[StepRecord], requests: list[str], colors: Mapping[str, str]) -> list[Any]:
    """One entry per request, then one per kind of hatching and mark the drawing has."""
    handles: list[Any] = [Patch(facecolor=colors[rid], label=rid) for rid in requests]
    owners = [o for r in history for pool in (r.gpu_owners, r.cpu_owners) for o in pool.values()]
    if any(o.shared and len(o.request_ids) == 1 for o in owners):
        handles.append(Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch=SHARED_HATCH, label="shared by samples"))
    if any(len(o.request_ids) > 1 for o in owners):
        handles.append(Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch=CROSS_HATCH, label="shared by requests"))
    marks = event_steps(history)
    for kind, handle in ((SWAPPED_OUT, Line2D([], [], color=SWAP_OUT_COLOR, ls="--", label="swap out")),
                         (SWAPPED_IN, Line2D([], [], color=SWAP_IN_COLOR, ls="--", label="swap in")),
                         (WAITED, Line2D([], [], color=PAPER_COLOR, ls="none", marker="v", label="waited: watermark")),
                         (RECOMPUTED, Line2D([], [], color=SWAP_OUT_COLOR, ls="none", marker="X", label="recomputed"))):
        if marks[kind]:
            handles.append(handle)
    return handles


def draw_pool_over_time(history: Sequence[StepRecord], num_blocks: int, device: str = "GPU", ax: Any = None,
                        colors: Mapping[str, str] | None = None, legend: bool = True, title: str | None = None,
                        highlight: str | None = None, crop: bool = False) -> Any:
    """One pool (``"GPU"`` or ``"CPU"``) of ``num_blocks`` blocks over the steps of ``history``.

    A cell (step, block) is coloured by the request holding the block after that step was
    scheduled, and left white when the block is free. Hatching ``////``: several samples of one
    request hold it; ``xxxx``: several requests do (a shared prefix). Red and green dashed
    lines: a group swapped out / in. On the GPU, ``▼`` marks a step where admission waited only
    for the watermark, ``✕`` a preemption by recomputation. ``title`` replaces the small
    "GPU pool: N blocks" label. ``highlight``: a request id; every other request is drawn grey,
    so that one request can be followed through admission, swaps and preemption. Every bar at
    least ``LABEL_MIN_STEPS`` steps long is labelled with its holder. ``crop``: draw block ids only
    up to the highest one ever held (a large pool that a small run barely touched), and say so.
    """
    history = _checked_history(history)
    device = _device(device)
    num_blocks = check_int("num_blocks", num_blocks, 0)
    runs = owner_runs(history, device)
    too_high = [r.block_id for r in runs if r.block_id >= num_blocks]
    if too_high:
        raise ValueError(f"block {too_high[0]} is held in the {device} pool, but num_blocks is {num_blocks}")
    requests = _request_order(history)
    colors = dict(colors) if colors is not None else {rid: request_color(i) for i, rid in enumerate(requests)}
    missing = [rid for rid in requests if rid not in colors]
    if missing:
        raise ValueError(f"colors has no colour for request {missing[0]!r}")
    colors = _highlighted(colors, requests, highlight)

    first, last = history[0].step, history[-1].step
    shown = num_blocks
    if crop:
        shown = max([r.block_id + 1 for r in runs] + [1])
    ax = new_axes(ax, figsize=(min(15.0, 3.0 + 0.16 * len(history)), 0.9 + ROW_INCHES * max(shown, 8)))
    for run in runs:
        owner = run.owner
        hatch = CROSS_HATCH if len(owner.request_ids) > 1 else SHARED_HATCH if owner.shared else None
        face = colors[owner.request_ids[0]]
        ax.broken_barh([(run.start - 0.5, run.end - run.start)], (run.block_id - 0.45, 0.9),
                       facecolors=face, edgecolor="white" if hatch is None else EDGE_COLOR,
                       linewidth=0.0 if hatch is None else 0.3, hatch=hatch, alpha=0.9)
        # Name the holder on every bar long enough to carry it, so that no colour must be matched
        # with the legend (a greyed-out request is not named).
        if run.end - run.start >= LABEL_MIN_STEPS and face != FADED_COLOR:
            ax.text((run.start + run.end - 1) / 2, run.block_id, "+".join(owner.request_ids), ha="center",
                    va="center", fontsize=6, color=_ink(face), gid="holder", zorder=2,
                    bbox=dict(boxstyle="square,pad=0.05", facecolor=face, edgecolor="none") if hatch else None)

    marks = event_steps(history)
    for kind, color in ((SWAPPED_OUT, SWAP_OUT_COLOR), (SWAPPED_IN, SWAP_IN_COLOR)):
        for step in marks[kind]:
            ax.axvline(step - 0.5, color=color, lw=1.1, ls="--", alpha=0.9, zorder=3)
    top = num_blocks - 0.5
    if device == "GPU":
        top = (shown - 0.5) if crop else top
        if marks[WAITED]:
            ax.plot(marks[WAITED], [top + 0.9] * len(marks[WAITED]), ls="none", marker="v", ms=5,
                    color=PAPER_COLOR, clip_on=False, zorder=4)
        if marks[RECOMPUTED]:
            ax.plot(marks[RECOMPUTED], [top + 0.9] * len(marks[RECOMPUTED]), ls="none", marker="X", ms=6,
                    color=SWAP_OUT_COLOR, clip_on=False, zorder=4)

    ax.set_xlim(first - 0.5, last + 0.5)
    ax.set_ylim(-0.5, max(shown - 0.5, 0.5) if crop else max(top, 0.5))
    if crop and shown < num_blocks:
        ax.text(1.0, 1.0, f"blocks {shown} to {num_blocks - 1} stayed free (not drawn)", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=7, color=EDGE_COLOR)
    ax.set_ylabel(f"{device} block id")
    ax.set_xlabel("step")
    if title is None:
        ax.set_title(f"{device} pool: {num_blocks} blocks", fontsize=9, loc="left")
    else:
        ax.set_title(title, fontsize=10, pad=14)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if legend:
        ax.legend(handles=_legend_handles(history, requests, colors), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=7, frameon=False, ncol=1 + len(requests) // 12)
    return ax


def _highlighted(colors: Mapping[str, str], requests: list[str], highlight: str | None) -> dict[str, str]:
    """``colors`` with every request but ``highlight`` greyed out (unchanged when it is None)."""
    if highlight is None:
        return dict(colors)
    if highlight not in requests:
        raise ValueError(f"highlight must be one of the requests drawn ({', '.join(requests)}), got {highlight!r}")
    return {rid: (color if rid == highlight else FADED_COLOR) for rid, color in colors.items()}


def draw_pools_over_time(history: Sequence[StepRecord], num_gpu_blocks: int, num_cpu_blocks: int,
                         axes: Sequence[Any] | None = None, title: str | None = None,
                         highlight: str | None = None, mark_step: int | None = None) -> tuple[Any, Any]:
    """The GPU pool above the CPU pool, on one time axis (see ``draw_pool_over_time``;
    ``highlight`` greys out every request but one; ``mark_step`` shades one step's column).

    ``axes``: two Axes to draw on (GPU, CPU), or None for a new figure. Returns them.
    """
    history = _checked_history(history)
    if mark_step is not None:
        steps = range(history[0].step, history[-1].step + 1)
        if not is_int(mark_step) or mark_step not in steps:
            raise ValueError(f"mark_step must be one of the steps drawn ({steps.start} to {steps.stop - 1}), "
                             f"got {mark_step!r}")
    requests = _request_order(history)
    colors = _highlighted({rid: request_color(i) for i, rid in enumerate(requests)}, requests, highlight)
    if axes is None:
        import matplotlib.pyplot as plt

        height = ROW_INCHES * (max(num_gpu_blocks, 8) + max(num_cpu_blocks, 4))
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(15.0, 4.0 + 0.14 * len(history)), 1.6 + height),
                                 gridspec_kw={"height_ratios": [max(num_gpu_blocks, 8), max(num_cpu_blocks, 4)]})
    elif len(axes) != 2:
        raise ValueError(f"axes must be two Axes (GPU, CPU), got {len(axes)}")
    gpu_ax, cpu_ax = axes
    draw_pool_over_time(history, num_gpu_blocks, "GPU", ax=gpu_ax, colors=colors, legend=True)
    draw_pool_over_time(history, num_cpu_blocks, "CPU", ax=cpu_ax, colors=colors, legend=False)
    gpu_ax.set_xlabel("")
    if mark_step is not None:
        for ax in axes:
            ax.axvspan(mark_step - 0.5, mark_step + 0.5, color=MARK_COLOR, alpha=0.45, zorder=4)
    for ax in axes:
        ax.set_title("", loc="left")        # the block ids' labels say which pool
    gpu_ax.set_title(title if title is not None else
                     f"Who holds which block, step by step (GPU: {num_gpu_blocks} blocks, CPU: {num_cpu_blocks})",
                     fontsize=10, pad=14)
    return gpu_ax, cpu_ax


# --------------------------------------------------------------------------------------------
# 3. What sharing saves
# --------------------------------------------------------------------------------------------

def draw_sharing_savings(results: Mapping[str, Sequence[SharingSavings]], ax: Any = None,
                         paper: Mapping[str, tuple[float, float]] | None = PAPER_SAVINGS) -> Any:
    """Memory saved by sharing (%) against n, one line per mode (``"parallel"``, ``"beam"``).

    ``results`` maps a mode to ``sharing_sim.sharing_savings(...)``'s list. Each point is
    labelled with its value. ``paper`` (mode -> (low, high) percent; None to leave out) is drawn
    as a band in the mode's colour: the range of the paper's Figure 15, on real traces.
    """
    if not isinstance(results, Mapping) or not results:
        raise ValueError("results must be a non-empty dict of mode -> list of SharingSavings")
    for mode, points in results.items():
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
        if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or not points:
            raise ValueError(f"results[{mode!r}] must be a non-empty list of SharingSavings")
        for p in points:
            if not isinstance(p, SharingSavings) or p.mode != mode:
                raise TypeError(f"results[{mode!r}] must hold SharingSavings of mode {mode!r}, got {p!r}")
    paper = dict(paper or {})

    ax = new_axes(ax, figsize=(7.0, 3.8))
    all_n = sorted({p.n for points in results.values() for p in points})
    for i, (mode, points) in enumerate(results.items()):
        color = SEQ_COLORS[i % len(SEQ_COLORS)]
        points = sorted(points, key=lambda p: p.n)
        xs, ys = [p.n for p in points], [100 * p.saving for p in points]
        ax.plot(xs, ys, marker="o", ms=5, lw=1.8, color=color, label=f"{MODE_LABELS[mode]} (simulation)")
        below = i % 2 == 0              # alternate label sides, so that equal values stay readable
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, -12 if below else 6),
                        ha="center", fontsize=7.5, color=color)
        if mode in paper:
            low, high = paper[mode]
            ax.axhspan(low, high, color=color, alpha=0.12, lw=0,
                       label=f"paper, {MODE_LABELS[mode]}: {low:g}–{high:g}%")
    ax.set_xticks(all_n)
    ax.set_xlabel("n (samples, or beam width)")
    ax.set_ylabel("memory saved by sharing (%)")
    highest = max([100 * p.saving for points in results.values() for p in points]
                  + [high for mode, (_, high) in paper.items() if mode in results])
    ax.set_ylim(min(-6.0, ax.get_ylim()[0]), highest + 8)
    ax.grid(True, axis="y", alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=7.5, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Blocks saved by sharing, memory × time (bands: the paper's Fig. 15, real traces)",
                 fontsize=10)
    return ax
