"""Drawing vLLM's V1 KV-cache core: the block pool and its free queue, block tables per group,
and the scheduler's token budget step by step. Drawing only: the numbers come from the caller.

* ``pool_row``: one block pool's state as plain data (who holds each block, which are cached,
  the free queue in eviction order), read from a ``BlockPool`` (ours or vLLM's) and the block
  ids of the requests.
* ``draw_free_queues``: several ``pool_row`` states, one row each, the free queue drawn front
  (evicted first) to back, cached blocks filled, never-cached ones hollow, the blocks in use
  at the right, coloured by request.
* ``draw_group_tables``: block tables of several requests in several KV-cache groups; null
  blocks (a sliding window's dropped prefix) grey and hatched.
* ``draw_token_budget``: tokens scheduled per request in each step against the budget, with
  the steps where a request was preempted marked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from matplotlib.patches import Patch, Rectangle

from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, seq_color

NULL_COLOR = "#D9D9D9"
NULL_HATCH = "////"


@dataclass(frozen=True)
class PoolRow:
    """A pool's state: ``free`` in eviction order as ``(block_id, cached)``, and ``used`` as
    ``(block_id, holders)`` (the request names holding it)."""

    free: tuple[tuple[int, bool], ...]
    used: tuple[tuple[int, tuple[str, ...]], ...]


def pool_row(pool: Any, tables: Mapping[str, Sequence[Sequence[int]]]) -> PoolRow:
    """Read ``pool`` (a ``BlockPool``) and ``tables`` (request -> block ids per group)."""
    free = tuple((b.block_id, b.block_hash is not None)
                 for b in pool.free_block_queue.get_all_free_blocks())
    holders: dict[int, list[str]] = {}
    for name, groups in tables.items():
        for group in groups:
            for block_id in group:
                if block_id != pool.null_block.block_id:
                    holders.setdefault(block_id, []).append(name)
    used = tuple((i, tuple(dict.fromkeys(holders[i]))) for i in sorted(holders))
    return PoolRow(free, used)


def _box(ax: Any, x: float, y: float, label: str, face: str, filled: bool = True,
         hatch: str | None = None) -> None:
    ax.add_patch(Rectangle((x, y), 0.9, 0.8, facecolor=face if filled else "white",
                           edgecolor=face if not filled else EDGE_COLOR, linewidth=1.5,
                           hatch=hatch))
    ax.text(x + 0.45, y + 0.4, label, ha="center", va="center", fontsize=8)


def draw_free_queues(rows: Sequence[PoolRow], labels: Sequence[str],
                     request_names: Sequence[str], ax: Any = None) -> Any:
    """One row per state: the free queue, front at the left (evicted first), then the blocks
    in use. Cached free blocks are filled grey, never-cached ones hollow."""
    if len(rows) != len(labels) or not rows:
        raise ValueError("one label per row, and at least one row")
    colors = {name: seq_color(i) for i, name in enumerate(request_names)}
    width = max(len(r.free) + len(r.used) for r in rows) + 2
    ax = new_axes(ax, (min(0.55 * width + 2, 14), 0.75 * len(rows) + 1))
    for k, (row, label) in enumerate(zip(rows, labels)):
        y = len(rows) - 1 - k
        for x, (block_id, cached) in enumerate(row.free):
            _box(ax, x, y, str(block_id), MUTED_COLOR, filled=cached)
        x0 = len(row.free) + 1
        for x, (block_id, holders) in enumerate(row.used):
            _box(ax, x0 + x, y, str(block_id), colors.get(holders[0], EDGE_COLOR),
                 hatch="xx" if len(holders) > 1 else None)
        ax.text(-0.3, y + 0.4, label, ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-0.3, len(rows) + 0.2)
    ax.set_axis_off()
    handles = [Patch(facecolor=MUTED_COLOR, edgecolor=EDGE_COLOR, label="free, cached (hit-able)"),
               Patch(facecolor="white", edgecolor=MUTED_COLOR, label="free, never cached"),
               Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch="xx", label="shared")]
    handles += [Patch(facecolor=c, edgecolor=EDGE_COLOR, label=f"held by {n}")
                for n, c in colors.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.set_title("free queue (front = evicted first)  |  blocks in use", fontsize=10, loc="left")
    return ax


def draw_group_tables(tables: Mapping[str, Sequence[Sequence[int]]], group_names: Sequence[str],
                      null_block_id: int = 0, ax: Any = None) -> Any:
    """Each request's block table in each group, side by side; null blocks grey, hatched."""
    names = list(tables)
    if not names or any(len(tables[n]) != len(group_names) for n in names):
        raise ValueError("every request needs one block list per group")
    widths = [max(len(tables[n][g]) for n in names) for g in range(len(group_names))]
    ax = new_axes(ax, (0.6 * (sum(widths) + 2 * len(widths)) + 2, 0.8 * len(names) + 1.2))
    x0 = 0.0
    for g, (gname, w) in enumerate(zip(group_names, widths)):
        ax.text(x0 + w / 2, len(names) + 0.1, gname, ha="center", fontsize=10)
        for k, name in enumerate(names):
            y = len(names) - 1 - k
            for i, block_id in enumerate(tables[name][g]):
                if block_id == null_block_id:
                    _box(ax, x0 + i, y, str(block_id), NULL_COLOR, hatch=NULL_HATCH)
                else:
                    _box(ax, x0 + i, y, str(block_id), seq_color(k))
            if g == 0:
                ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
        x0 += w + 1.5
    ax.set_xlim(-0.5, x0)
    ax.set_ylim(-0.3, len(names) + 0.6)
    ax.set_axis_off()
    return ax


def draw_token_budget(steps: Sequence[Mapping[str, int]], budget: int,
                      preempted: Sequence[Sequence[str]], request_names: Sequence[str],
                      ax: Any = None) -> Any:
    """A stacked bar per step: the tokens each request got, the budget as a line; ✕ over a
    step where a request was preempted (its colour)."""
    if len(steps) != len(preempted):
        raise ValueError("one preempted list per step")
    colors = {name: seq_color(i) for i, name in enumerate(request_names)}
    ax = new_axes(ax, (max(6.0, 0.5 * len(steps) + 2), 3.5))
    for s, scheduled in enumerate(steps):
        bottom = 0
        for name, n in scheduled.items():
            ax.bar(s, n, bottom=bottom, color=colors[name], edgecolor=EDGE_COLOR, width=0.8)
            if n > 1:
                ax.text(s, bottom + n / 2, str(n), ha="center", va="center", fontsize=7)
            bottom += n
        for j, name in enumerate(preempted[s]):
            ax.plot(s, budget + 0.6 + 0.6 * j, marker="x", color=colors[name], markersize=9,
                    markeredgewidth=2.5)
    ax.axhline(budget, color=EDGE_COLOR, linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens scheduled")
    ax.set_xticks(range(len(steps)))
    ax.set_ylim(0, budget + 2.5)
    handles = [Patch(facecolor=c, edgecolor=EDGE_COLOR, label=n) for n, c in colors.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.set_title(f"token budget {budget} per step (dashed); ✕ = preempted", fontsize=10,
                 loc="left")
    return ax
