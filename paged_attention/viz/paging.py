"""Drawing the three things every paged-attention kernel reads: block table, slot mapping, lengths.

A sequence's tokens live in *logical* blocks of ``block_size`` tokens: token ``t`` is in logical
block ``t // block_size``, at offset ``t % block_size``. The block table says which *physical*
block of the KV cache holds each logical block. Flattening (physical block, offset) gives the
token's *slot*, the row of the cache its key and value are written to:

    slot = block_table[s][t // block_size] * block_size + t % block_size

``paged_attention.utils.slot_mapping`` computes that list (re-exported here with the drawings);
``draw_block_table`` and ``draw_slot_mapping`` draw it.
"""
from __future__ import annotations

from typing import Any

from matplotlib.patches import Rectangle

from paged_attention.utils import as_list, cdiv, check_block_table, is_int, slot_mapping
from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, seq_color

__all__ = ["draw_block_table", "draw_slot_mapping", "slot_mapping"]

# --------------------------------------------------------------------------------------------
# 1. Drawing the block table
# --------------------------------------------------------------------------------------------

_BLOCK_W = 3.0    # width of one block box, whatever the block size
_ROW_H = 0.6      # height of a block box
_PITCH = 0.85     # vertical distance between two block rows
_SEQ_GAP = 0.55   # extra space above each sequence's group of logical blocks
_GUTTER = 3.2     # horizontal space for the arrows between the two columns


def _draw_block(ax: Any, x: float, y: float, block_size: int, filled: int, color: str,
                hatch: str | None = None) -> None:
    """A block as a box of ``block_size`` slots, the first ``filled`` of them shaded."""
    cell = _BLOCK_W / block_size
    if filled:
        ax.add_patch(Rectangle((x, y), filled * cell, _ROW_H, facecolor=color, alpha=0.75,
                               edgecolor="none", hatch=hatch))
    if block_size <= 32:  # slot dividers; beyond that they would merge into grey
        for k in range(1, block_size):
            ax.plot([x + k * cell] * 2, [y, y + _ROW_H], color=EDGE_COLOR, lw=0.4, alpha=0.5)
    ax.add_patch(Rectangle((x, y), _BLOCK_W, _ROW_H, facecolor="none", edgecolor=EDGE_COLOR,
                           lw=1.0))


def draw_block_table(block_table: Any, seq_lens: Any, block_size: int,
                     num_blocks: int | None = None, ax: Any = None,
                     title: str | None = None) -> Any:
    """Logical blocks of each sequence (left), the physical block pool (right), and the table.

    Each logical block is a box of ``block_size`` slots with its filled slots shaded, so a
    partly filled last block shows. An arrow goes from each logical block to the physical block
    the table maps it to. Physical blocks no sequence uses are drawn empty; a block used by more
    than one sequence (a shared prefix) is hatched. ``num_blocks`` is the pool size (default:
    the largest id in use plus one).
    """
    rows, lens, block_size = check_block_table(block_table, seq_lens, block_size)
    used_ids = [b for row in rows for b in row]
    if num_blocks is None:
        num_blocks = max(used_ids, default=-1) + 1
    elif not is_int(num_blocks) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    if used_ids and max(used_ids) >= num_blocks:
        raise ValueError(f"block_table uses block id {max(used_ids)}, but num_blocks="
                         f"{num_blocks} means ids 0..{num_blocks - 1}")

    # Vertical positions, top to bottom: a header per sequence, then its logical blocks.
    logical_y: list[list[float]] = []
    y = 0.0
    for row in rows:
        y -= _SEQ_GAP
        logical_y.append([y - (j + 1) * _PITCH for j in range(len(row))])
        y -= max(len(row), 1) * _PITCH
    left_height = -y
    right_height = num_blocks * _PITCH
    # Centre the shorter column on the taller one.
    left_top = -max(0.0, (right_height - left_height) / 2)
    right_top = -max(0.0, (left_height - right_height) / 2)
    x_phys = _BLOCK_W + _GUTTER

    height = max(left_height, right_height)
    ax = new_axes(ax, figsize=(7.5, 1.2 + 0.34 * height / _PITCH))

    # Which sequences use each physical block, and how many of its slots are filled.
    owners: dict[int, list[int]] = {}
    fill: dict[int, int] = {}
    for s, row in enumerate(rows):
        for j, block_id in enumerate(row):
            owners.setdefault(block_id, []).append(s)
            fill[block_id] = max(fill.get(block_id, 0), min(block_size, lens[s] - j * block_size))

    # Left column: each sequence's logical blocks.
    for s, row in enumerate(rows):
        color = seq_color(s)
        header_y = left_top + (logical_y[s][0] if row else -_SEQ_GAP - _PITCH) + _ROW_H + 0.12
        ax.text(0, header_y, f"seq {s}: {lens[s]} tokens", color=color, fontsize=9,
                fontweight="bold", va="bottom")
        for j, block_id in enumerate(row):
            yj = left_top + logical_y[s][j]
            _draw_block(ax, 0, yj, block_size, min(block_size, lens[s] - j * block_size), color)
            ax.text(-0.15, yj + _ROW_H / 2, f"logical {j}", ha="right", va="center",
                    fontsize=7, color=MUTED_COLOR)

    # Right column: the physical pool, block 0 on top.
    for block_id in range(num_blocks):
        yb = right_top - (block_id + 1) * _PITCH
        users = owners.get(block_id, [])
        color = seq_color(users[0]) if users else "white"
        _draw_block(ax, x_phys, yb, block_size, fill.get(block_id, 0), color,
                    hatch="///" if len(users) > 1 else None)
        ax.text(x_phys + _BLOCK_W + 0.15, yb + _ROW_H / 2, f"block {block_id}",
                ha="left", va="center", fontsize=8,
                color=EDGE_COLOR if users else MUTED_COLOR)

    # The block table itself: one arrow per (sequence, logical block).
    for s, row in enumerate(rows):
        for j, block_id in enumerate(row):
            ax.annotate("", xy=(x_phys, right_top - (block_id + 1) * _PITCH + _ROW_H / 2),
                        xytext=(_BLOCK_W, left_top + logical_y[s][j] + _ROW_H / 2),
                        arrowprops=dict(arrowstyle="-|>", color=seq_color(s), lw=1.1,
                                        shrinkA=3, shrinkB=3, alpha=0.85))

    top = 0.5
    ax.text(_BLOCK_W / 2, top, "logical blocks", ha="center", va="bottom", fontsize=9)
    ax.text(x_phys + _BLOCK_W / 2, top, "physical blocks (KV cache)", ha="center",
            va="bottom", fontsize=9)
    ax.set_xlim(-1.6, x_phys + _BLOCK_W + 1.3)
    ax.set_ylim(-height - 0.2, top + 0.5)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"Block table: logical → physical blocks (block_size = {block_size})",
                 fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 2. Drawing the slot mapping
# --------------------------------------------------------------------------------------------

_GROUP_GAP = 0.45  # space between two blocks' worth of tokens


def draw_slot_mapping(block_table: Any, seq_lens: Any, block_size: int, ax: Any = None,
                      seqs: list[int] | None = None, max_tokens: int | None = None) -> Any:
    """Each token of each sequence as a cell labelled with its slot, grouped by physical block.

    The token's position is written small under its cell and the physical block above each
    group, so the formula in the title can be checked cell by cell. ``seqs`` picks which
    sequences to draw (default: all); ``max_tokens`` draws only the first tokens of each.
    """
    rows, lens, block_size = check_block_table(block_table, seq_lens, block_size)
    if seqs is None:
        seqs = list(range(len(lens)))
    seqs = as_list(seqs, "seqs")
    for s in seqs:
        if not is_int(s) or not 0 <= s < len(lens):
            raise ValueError(f"seqs must hold sequence indices in 0..{len(lens) - 1}, got {s!r}")
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens <= 0):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")

    shown = [lens[s] if max_tokens is None else min(lens[s], max_tokens) for s in seqs]
    widest = max([n + _GROUP_GAP * cdiv(n, block_size) for n in shown], default=1)
    ax = new_axes(ax, figsize=(min(16.0, max(6.0, 1.5 + 0.32 * widest)), 0.9 + 1.05 * len(seqs)))

    for r, s in enumerate(seqs):
        y = -r * 1.6  # each row: block labels above, cells, token positions below
        ax.text(-0.4, y + 0.4, f"seq {s}", ha="right", va="center", fontsize=9,
                color=seq_color(s), fontweight="bold")
        for t in range(shown[r]):
            j, offset = divmod(t, block_size)
            x = t + _GROUP_GAP * j
            slot = rows[s][j] * block_size + offset
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=seq_color(s),
                                   alpha=0.25 if j % 2 == 0 else 0.45, edgecolor=EDGE_COLOR,
                                   lw=0.6))
            ax.text(x + 0.5, y + 0.4, str(slot), ha="center", va="center", fontsize=7)
            ax.text(x + 0.5, y - 0.12, str(t), ha="center", va="top", fontsize=5.5,
                    color=MUTED_COLOR)
            if offset == 0:  # first token of a block: name the physical block above it
                ax.text(x, y + 0.88, f"block {rows[s][j]}", ha="left", va="bottom",
                        fontsize=7, color=EDGE_COLOR)
        if shown[r] < lens[s]:
            x_end = shown[r] + _GROUP_GAP * cdiv(shown[r], block_size)
            ax.text(x_end, y + 0.4, f"… ({lens[s] - shown[r]} more)", va="center", fontsize=8,
                    color=MUTED_COLOR)
        if lens[s] == 0:
            ax.text(0, y + 0.4, "(empty)", va="center", fontsize=8, color=MUTED_COLOR)

    ax.set_xlim(-2.2, widest + (3.5 if max_tokens is not None else 0.5))
    ax.set_ylim(-(len(seqs) - 1) * 1.6 - 0.6, 1.4)
    ax.axis("off")
    ax.set_title("Slot mapping: slot = block_table[s][t // B] * B + t % B\n"
                 f"B = block_size = {block_size}; small numbers under the cells: token position t",
                 fontsize=9)
    return ax
