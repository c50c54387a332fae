"""Drawing decode context parallelism run across real ranks (``paged_attention.distributed``).

* ``draw_dcp_shares``: for one sequence, which rank stores which position (top strip), and each
  rank's own blocks with the positions its slot mapping wrote into them.
* ``draw_dcp_merge``: for one sequence and query head, each rank's partial output (attention
  over its share only), its weight in the merge ``exp(lse_r - lse)``, the merged output, the
  single-rank answer, and what a plain average of the partials would give.

Both take what ``run_dcp_rank`` returned on each rank (``RankResult``s, in rank order): the
drawings show what the processes computed, not a formula.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from matplotlib.patches import Rectangle

from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, positive_int, seq_color


def _check_results(results: Sequence[Any], seq: int) -> int:
    if not isinstance(results, (list, tuple)) or not results:
        raise TypeError("results must be a non-empty list of run_dcp_rank's results, one per rank")
    for r, res in enumerate(results):
        for name in ("slots", "block_ids", "local_seq_lens", "partial_out", "partial_lse", "out", "lse"):
            if not hasattr(res, name):
                raise TypeError(f"results[{r}] has no {name!r}: pass what run_dcp_rank returned")
    num_seqs = len(results[0].slots)
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < num_seqs:
        raise ValueError(f"seq must be a sequence index in 0..{num_seqs - 1}, got {seq!r}")
    return seq


def draw_dcp_shares(results: Sequence[Any], block_size: int, seq: int = 0, ax: Any = None,
                    title: str | None = None) -> Any:
    """Sequence ``seq``'s positions coloured by the rank that stores them (top), and under them
    every rank's blocks (its table row's ids), each slot holding the position written there
    (empty: never written for this sequence)."""
    seq = _check_results(results, seq)
    B = positive_int("block_size", block_size)
    world = len(results)
    slots = [np.asarray(res.slots[seq]) for res in results]
    n = len(slots[0])
    cols = max(len(res.block_ids[seq]) for res in results)
    width = max(n, cols * (B + 1) - 1)
    cell_h, pitch = 0.8, 1.3
    ax = new_axes(ax, figsize=(min(16.0, max(6.0, 1.8 + 0.26 * width)), 1.4 + 0.45 * (world + 1) * pitch))

    for p in range(n):
        owners = [r for r in range(world) if slots[r][p] >= 0]
        color = seq_color(owners[0]) if len(owners) == 1 else "white"    # 0 or 2+ owners: a bug, shown blank
        ax.add_patch(Rectangle((p, 0), 1, cell_h, facecolor=color, alpha=0.55, edgecolor=EDGE_COLOR, lw=0.4,
                               gid="position"))
        ax.text(p + 0.5, cell_h / 2, str(p), ha="center", va="center", fontsize=6, gid="position")
    ax.text(-0.4, cell_h / 2, "positions", ha="right", va="center", fontsize=7.5, fontweight="bold")

    for r, res in enumerate(results):
        y = -(r + 1) * pitch
        ids = res.block_ids[seq]
        ax.text(-0.4, y + cell_h / 2, f"rank {r}\n{res.local_seq_lens[seq]} tokens", ha="right", va="center",
                fontsize=7.5, color=seq_color(r), fontweight="bold")
        held = {int(s): p for p, s in enumerate(slots[r]) if s >= 0}
        for j, block in enumerate(ids):
            x0 = j * (B + 1)
            ax.text(x0 + B / 2, y + cell_h + 0.08, f"block {block}", ha="center", va="bottom", fontsize=6.5,
                    color=MUTED_COLOR)
            for o in range(B):
                p = held.get(block * B + o)
                ax.add_patch(Rectangle((x0 + o, y), 1, cell_h, facecolor=seq_color(r) if p is not None else "white",
                                       alpha=0.55, edgecolor=EDGE_COLOR, lw=0.4, gid=f"rank{r}"))
                if p is not None:
                    ax.text(x0 + o + 0.5, y + cell_h / 2, str(p), ha="center", va="center", fontsize=6,
                            gid=f"rank{r}")
            ax.add_patch(Rectangle((x0, y), B, cell_h, facecolor="none", edgecolor=EDGE_COLOR, lw=1.1))

    ax.set_xlim(-3.0, width + 0.3)
    ax.set_ylim(-world * pitch - 0.3, cell_h + 0.5)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"request {seq} ({n} tokens) over {world} ranks: each rank writes its own positions, "
                 f"packed in order, into its blocks", fontsize=9.5)
    return ax


def dcp_merge_weights(results: Sequence[Any], seq: int = 0) -> np.ndarray:
    """``[ranks, heads]``: each rank's share of the softmax mass of sequence ``seq``,
    ``exp(lse_r - lse)``, the weights of the merge (they sum to 1 per head)."""
    seq = _check_results(results, seq)
    partial = torch.stack([res.partial_lse[seq].double() for res in results])
    return torch.exp(partial - results[0].lse[seq].double()).numpy()


def draw_dcp_merge(results: Sequence[Any], oracle: torch.Tensor, seq: int = 0, head: int = 0,
                   num_dims: int = 8, ax: Any = None, title: str | None = None) -> Any:
    """The first ``num_dims`` output dimensions of query head ``head`` of sequence ``seq``: each
    rank's partial output (dashed, with its weight in the legend), the merged output, the
    single-rank attention ``oracle`` (``[num_seqs, num_heads, head_size]``) and the plain average
    of the partials (what a merge without the log-sum-exps would give)."""
    seq = _check_results(results, seq)
    num_heads, head_size = results[0].out.shape[1:]
    if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < num_heads:
        raise ValueError(f"head must be in 0..{num_heads - 1}, got {head!r}")
    d = min(positive_int("num_dims", num_dims), head_size)
    if not isinstance(oracle, torch.Tensor) or tuple(oracle.shape) != tuple(results[0].out.shape):
        raise ValueError(f"oracle must be a tensor of shape {tuple(results[0].out.shape)}")
    ax = new_axes(ax, figsize=(9.0, 4.0))
    x = np.arange(d)
    weights = dcp_merge_weights(results, seq)[:, head]
    for r, res in enumerate(results):
        ax.plot(x, res.partial_out[seq, head, :d].double().numpy(), ls="--", marker="o", ms=4, color=seq_color(r),
                label=f"rank {r}: {res.local_seq_lens[seq]} tokens, weight {weights[r]:.3f}", gid=f"rank{r}")
    average = torch.stack([res.partial_out[seq, head, :d].double() for res in results]).mean(0)
    ax.plot(x, average.numpy(), ls=":", color=MUTED_COLOR, lw=1.5, label="plain average (no rescaling)",
            gid="average")
    ax.plot(x, results[0].out[seq, head, :d].double().numpy(), color=EDGE_COLOR, lw=2,
            label="merged: sum of weight x partial", gid="merged")
    ax.plot(x, oracle[seq, head, :d].double().cpu().numpy(), ls="none", marker="x", ms=9, mew=2, color="#E45756",
            label="one rank, whole context", gid="oracle")
    ax.axhline(0, color=MUTED_COLOR, lw=0.5)
    ax.set_xticks(x)
    ax.set_xlabel("output dimension")
    ax.set_ylabel("value")
    ax.legend(fontsize=7.5, loc="best")
    ax.set_title(title if title is not None else
                 f"request {seq}, head {head}: the ranks' partial outputs, weighted by exp(lse_r - lse), "
                 f"add up to the answer", fontsize=9.5)
    return ax
