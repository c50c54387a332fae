"""The look shared by every drawing: one small palette and a helper that makes an Axes.

Colours are chosen once here so that "token states" or "sequence 1" has the same colour in
every notebook.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

# The four kinds of KV-cache memory (keys match ``memory_sim.CATEGORIES``).
CATEGORY_COLORS: dict[str, str] = {
    "token_states": "#4C78A8",            # blue: useful
    "reserved": "#EECA3B",                # yellow: held for tokens still to come
    "internal_fragmentation": "#E45756",  # red: never used
    "external_fragmentation": "#9D755D",  # brown: stranded between allocations
}
CATEGORY_NAMES: dict[str, str] = {
    "token_states": "token states",
    "reserved": "reserved",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation",
}

# One colour per sequence, reused in order when there are more sequences than colours.
SEQ_COLORS: tuple[str, ...] = ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#72B7B2", "#FF9DA6")
# One colour per kernel implementation in timing plots; other names take SEQ_COLORS in order.
IMPL_COLORS: dict[str, str] = {
    "CUDA v1": "#E45756",            # red
    "CUDA v2": "#F58518",            # orange
    "Triton": "#4C78A8",             # blue
    "SDPA (contiguous)": "#54A24B",  # green: no paging at all, the yardstick
}
# The lanes of one thread group in the kernel drawings (apart from the first four SEQ_COLORS,
# which colour the warps next to them).
LANE_COLORS: tuple[str, ...] = ("#72B7B2", "#FF9DA6", "#EECA3B", "#9D755D")
EDGE_COLOR = "#444444"   # box outlines
MUTED_COLOR = "#999999"  # free blocks, secondary labels
PAPER_COLOR = "#222222"  # the paper's numbers, drawn over our own


def seq_color(index: int) -> str:
    """The colour of sequence ``index``."""
    return SEQ_COLORS[index % len(SEQ_COLORS)]


def impl_color(name: str, index: int) -> str:
    """The colour of kernel implementation ``name``, the ``index``-th line of its plot."""
    return IMPL_COLORS.get(name, seq_color(index))


def new_axes(ax: Any, figsize: tuple[float, float]) -> Any:
    """Return ``ax``, or the Axes of a new figure of ``figsize`` inches when ``ax`` is None.

    pyplot is imported here rather than at module level, so that importing ``viz`` never picks
    a matplotlib backend behind the caller's back.
    """
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize)
    return ax


def snapshot_list(snapshots: Any, kind: type, made_by: str) -> list:
    """``snapshots`` (one, or a non-empty list) as a list of ``kind``, else a clear error
    naming the function that makes them (``made_by``)."""
    if isinstance(snapshots, kind):
        snapshots = [snapshots]
    if not isinstance(snapshots, (list, tuple)) or not snapshots:
        raise ValueError(f"snapshots must be a non-empty list of {kind.__name__}s ({made_by})")
    for k, s in enumerate(snapshots):
        if not isinstance(s, kind):
            raise TypeError(f"snapshots[{k}] is a {type(s).__name__}, not a {kind.__name__}")
    return list(snapshots)


def times_series(times_us: Any, num_points: int, what: str, allow_gaps: bool = False) -> dict[str, list[float]]:
    """Check a benchmark's ``{implementation: [time per point]}`` and return it as floats.

    There must be at least one point, and every list must have one time per point (``what``
    names the points in the error), each a positive finite number; with ``allow_gaps``, ``None``
    or NaN may stand for a point an implementation cannot run, and becomes NaN (a gap in the line).
    """
    if num_points < 1:
        raise ValueError(f"a plot of times needs at least one of the {what}, got none")
    if not isinstance(times_us, dict) or not times_us:
        raise ValueError("times_us must be a non-empty dict of implementation name -> times")
    series = {}
    for name, times in times_us.items():
        times = list(times)
        if len(times) != num_points:
            raise ValueError(f"times_us[{name!r}] has {len(times)} times for {num_points} {what}")
        for t in times:
            if allow_gaps and (t is None or (isinstance(t, float) and math.isnan(t))):
                continue
            if isinstance(t, bool) or not isinstance(t, Real) or not t > 0 or math.isinf(t):
                gaps = " (or None)" if allow_gaps else ""
                raise ValueError(f"times_us[{name!r}] must hold positive times{gaps}, got {t!r}")
        series[name] = [math.nan if t is None else float(t) for t in times]
    return series


def plot_times(ax: Any, xs: list[int], series: dict[str, list[float]], xlabel: str, ylabel: str,
               title: str, log_y: bool = True) -> Any:
    """Times against a size, one line per implementation, on log-log axes (sizes in powers of
    two, labelled as they are): the picture every benchmark in the notebooks draws. ``log_y=False``
    keeps the y axis linear (for rates)."""
    for i, (name, times) in enumerate(series.items()):
        ax.plot(xs, times, marker="o", ms=4, lw=1.6, color=impl_color(name, i), label=name)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    return ax
