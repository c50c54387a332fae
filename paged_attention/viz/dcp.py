"""Drawing decode context parallelism run across real ranks (``paged_attention.distributed``).

* ``draw_dcp_shares``: for one sequence, which rank stores which position (top strip), and each
  rank's own blocks with the positions its slot mapping wrote into them.
* ``draw_dcp_merge``: for one sequence and query head, each rank's partial output (attention
  over its share only), its weight in the merge ``exp(lse_r - lse)``, the merged output, the
  single-rank answer, and what a plain average of the partials would give.

Both take what ``run_dcp_rank`` returned on each rank (``RankResult``s, in rank order): the
drawings show what the processes computed, not a formula. The weights come from
``distributed.workload.dcp_merge_weights``.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from matplotlib.patches import Rectangle

from paged_attention.distributed.workload import dcp_merge_weights
from paged_attention.utils import check_int
from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, seq_color


def _check_results(results: Sequence[Any], seq: int) -> int:
    if not isinstance(results, (list, tuple)) or not results:
        raise TypeError("results must be a non-empty list of run_dcp_rank's results, one per rank")
    fields = ("slots", "block_ids", "local_seq_lens", "partial_out", "partial_lse", "out", "lse")
    for r, res in enumerate(results):
        for name in fields:
            if not hasattr(res, name):
                raise TypeError(f"results[{r}] has no {name!r}: pass what run_dcp_rank returned")
    num_seqs = len(results[0].slots)
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < num_seqs:
        raise ValueError(f"seq must be a sequence index in 0..{num_seqs - 1}, got {seq!r}")
    return seq


def _cell(ax: Any, x: float, y: float, color: str, text: str | None, gid: str) -> None:
    """One token slot: a box, filled with ``color``, with ``text`` (a position) in it."""
    ax.add_patch(Rectangle((x, y), 1, _CELL_H, facecolor=color, alpha=0.55, edgecolor=EDGE_COLOR,
                           lw=0.4, gid=gid))
    if text is not None:
        ax.text(x + 0.5, y + _CELL_H / 2, text, ha="center", va="center", fontsize=6, gid=gid)


_CELL_H, _PITCH = 0.8, 1.3


def draw_dcp_shares(results: Sequence[Any], block_size: int, seq: int = 0, ax: Any = None,
                    title: str | None = None) -> Any:
    """Sequence ``seq``'s positions coloured by the rank that stores them (top), and under them
    every rank's blocks (its table row's ids), each slot holding the position written there
    (empty: never written for this sequence)."""
    seq = _check_results(results, seq)
    B = check_int("block_size", block_size, 1)
    world = len(results)
    slots = [np.asarray(res.slots[seq]) for res in results]
    n = len(slots[0])
    cols = max(len(res.block_ids[seq]) for res in results)
    width = max(n, cols * (B + 1) - 1)
    ax = new_axes(ax, figsize=(min(16.0, max(6.0, 1.8 + 0.26 * width)),
                               1.4 + 0.45 * (world + 1) * _PITCH))

    for p in range(n):
        owners = [r for r in range(world) if slots[r][p] >= 0]
        # Exactly one owner, else (no rank, or several: a bug) the cell is left blank.
        _cell(ax, p, 0, seq_color(owners[0]) if len(owners) == 1 else "white", str(p), "position")
    ax.text(-0.4, _CELL_H / 2, "positions", ha="right", va="center", fontsize=7.5,
            fontweight="bold")

    for r, res in enumerate(results):
        y = -(r + 1) * _PITCH
        ax.text(-0.4, y + _CELL_H / 2, f"rank {r}\n{res.local_seq_lens[seq]} tokens", ha="right",
                va="center", fontsize=7.5, color=seq_color(r), fontweight="bold")
        held = {int(s): p for p, s in enumerate(slots[r]) if s >= 0}     # slot -> position
        for j, block in enumerate(res.block_ids[seq]):
            x0 = j * (B + 1)
            ax.text(x0 + B / 2, y + _CELL_H + 0.08, f"block {block}", ha="center", va="bottom",
                    fontsize=6.5, color=MUTED_COLOR)
            for o in range(B):
                p = held.get(block * B + o)
                _cell(ax, x0 + o, y, seq_color(r) if p is not None else "white",
                      None if p is None else str(p), f"rank{r}")
            ax.add_patch(Rectangle((x0, y), B, _CELL_H, facecolor="none", edgecolor=EDGE_COLOR,
                                   lw=1.1))

    ax.set_xlim(-3.0, width + 0.3)
    ax.set_ylim(-world * _PITCH - 0.3, _CELL_H + 0.5)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"request {seq} ({n} tokens) over {world} ranks: each rank writes its own "
                 f"positions, packed in order, into its blocks", fontsize=9.5)
    return ax


def draw_dcp_merge(results: Sequence[Any], oracle: torch.Tensor, seq: int = 0, head: int = 0,
                   num_dims: int = 8, ax: Any = None, title: str | None = None) -> Any:
    """The first ``num_dims`` output dimensions of query head ``head`` of sequence ``seq``: each
    rank's partial output (dashed, with its weight in the legend), the merged output, the
    single-rank attention ``oracle`` (``[num_seqs, num_heads, head_size]``) and the plain average
    of the partials (what a merge without the log-sum-exps would give)."""
    seq = _check_results(results, seq)
    shape = tuple(results[0].out.shape)
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < shape[1]:
        raise ValueError(f"head must be in 0..{shape[1] - 1}, got {head!r}")
    d = min(check_int("num_dims", num_dims, 1), shape[2])
    if not isinstance(oracle, torch.Tensor) or tuple(oracle.shape) != shape:
        raise ValueError(f"oracle must be a tensor of shape {shape}")
    ax = new_axes(ax, figsize=(9.0, 4.0))
    x = np.arange(d)

    def dims(t: torch.Tensor) -> np.ndarray:
        return t[seq, head, :d].double().cpu().numpy()

    weights = dcp_merge_weights(results, seq)[:, head]
    for r, res in enumerate(results):
        ax.plot(x, dims(res.partial_out), ls="--", marker="o", ms=4, color=seq_color(r),
                label=f"rank {r}: {res.local_seq_lens[seq]} tokens, weight {weights[r]:.3f}",
                gid=f"rank{r}")
    average = np.mean([dims(res.partial_out) for res in results], axis=0)
    ax.plot(x, average, ls=":", color=MUTED_COLOR, lw=1.5, label="plain average (no rescaling)",
            gid="average")
    ax.plot(x, dims(results[0].out), color=EDGE_COLOR, lw=2,
            label="merged: sum of weight x partial", gid="merged")
    ax.plot(x, dims(oracle), ls="none", marker="x", ms=9, mew=2, color="#E45756",
            label="one rank, whole context", gid="oracle")
    ax.axhline(0, color=MUTED_COLOR, lw=0.5)
    ax.set_xticks(x)
    ax.set_xlabel("output dimension")
    ax.set_ylabel("value")
    ax.legend(fontsize=7.5, loc="best")
    ax.set_title(title if title is not None else
                 f"request {seq}, head {head}: the ranks' partial outputs, weighted by "
                 f"exp(lse_r - lse), add up to the answer", fontsize=9.5)
    return ax
