"""Drawing the KV-cache waste of each allocation scheme: our version of the paper's Figure 2."""
from __future__ import annotations

from numbers import Real
from typing import Any

from paged_attention.memory_sim import CATEGORIES, LABELS, MemoryBreakdown
from paged_attention.viz.style import CATEGORY_COLORS, CATEGORY_NAMES, PAPER_COLOR, new_axes


def draw_waste_breakdown(results: dict[str, MemoryBreakdown], ax: Any = None,
                         paper: dict[str, float] | None = None) -> Any:
    """One stacked bar per scheme: token states, reserved, internal and external fragmentation.

    ``results`` maps a scheme name to its :class:`MemoryBreakdown` (``compare_schemes`` returns
    one). The simulated useful share is written on each bar. If ``paper`` maps scheme names to
    the paper's useful percentages (e.g. ``memory_sim.PAPER_USEFUL``), each is marked on its
    bar with a black tick and written next to ours, so the two can be compared at a glance.
    """
    if not isinstance(results, dict) or not results:
        raise ValueError("results must be a non-empty dict of scheme name -> MemoryBreakdown")
    for name, breakdown in results.items():
        if not isinstance(breakdown, MemoryBreakdown):
            raise TypeError(f"results[{name!r}] must be a MemoryBreakdown, "
                            f"got {type(breakdown).__name__}")
    paper = dict(paper or {})
    for name, value in paper.items():
        if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 100:
            raise ValueError(f"paper[{name!r}] must be a percentage in [0, 100], got {value!r}")

    names = list(results)
    paper_in_legend = False
    ax = new_axes(ax, figsize=(8.0, 1.2 + 0.55 * len(names)))

    for row, name in enumerate(names):
        left = 0.0
        for category in CATEGORIES:
            width = 100 * getattr(results[name], category)
            ax.barh(row, width, left=left, height=0.6, color=CATEGORY_COLORS[category],
                    edgecolor="white", linewidth=0.5,
                    label=CATEGORY_NAMES[category] if row == 0 else None)
            left += width

        # Our useful share, inside the blue segment when there is room for it.
        useful = 100 * results[name].useful
        if useful >= 12:
            ax.text(useful / 2, row, f"{useful:.1f}%", ha="center", va="center",
                    color="white", fontsize=9, fontweight="bold")
        else:
            ax.text(useful + 1, row, f"{useful:.1f}%", ha="left", va="center", fontsize=9)

        if name in paper:
            ax.plot([paper[name]] * 2, [row - 0.38, row + 0.38], color=PAPER_COLOR, lw=2.2,
                    solid_capstyle="butt", label=None if paper_in_legend else "paper (Fig. 2)")
            paper_in_legend = True
            ax.text(102, row, f"paper: {paper[name]:.1f}%", ha="left", va="center", fontsize=8,
                    color=PAPER_COLOR)

    ax.set_yticks(range(len(names)), [LABELS.get(name, name) for name in names])
    ax.invert_yaxis()  # first scheme on top
    ax.set_xlim(0, 118 if paper else 100)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of KV-cache memory in use (%)")
    ax.set_title("Where the KV-cache memory goes (simulation; useful share written on the bar)",
                 fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("paper"))  # paper last
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper center", bbox_to_anchor=(0.5, -0.22 - 0.2 / len(names)), ncol=3,
              fontsize=8, frameon=False)
    return ax
