"""Drawing vLLM V1's worker block table: persistent rows, the slot mapping, DCP and kernel blocks.

* ``snapshot_rows`` + ``draw_row_history``: the table's rows over several steps, as requests
  arrive, grow, finish and are moved (``add_row``, ``append_row``, ``clear_row``, ``move_row``,
  ``swap_row``). Columns a row counts (``num_blocks_per_row``) are coloured by their request;
  ids left past the count (stale: vLLM does not clear them) are hatched; ``cell_kinds`` says which is which.
* ``draw_slot_mapping_arrows``: one step's tokens in batch order, grouped by request (prefill
  or decode, ``request_kinds``), each with an arrow to the KV-cache slot it is written to.
* ``draw_dcp_ownership``: with decode context parallelism, which rank stores which position,
  and where in that rank's own blocks.
* ``draw_kernel_blocks``: one KV-cache-manager block cut into the attention kernel's smaller
  blocks (hybrid blocks), and where one position lands in both views.
* ``draw_slot_mapping_times``: ``compute_slot_mapping`` against a Python loop
  (``bench.slot_mapping_times``).
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.patches import Patch, Rectangle

from paged_attention.utils import PAD_SLOT_ID, cdiv, check_int, check_int_list, is_int
from paged_attention.v1.block_table import BlockTable
from paged_attention.v1.reference import dcp_local_position, dcp_owner_rank
from paged_attention.viz.style import (
    EDGE_COLOR, MUTED_COLOR, new_axes, plot_times, seq_color, snapshot_list, times_series,
)

STALE_COLOR = "#E45756"   # ids past a row's count: nothing reads them, but they are there
STALE_HATCH = "////"


# --------------------------------------------------------------------------------------------
# 1. Persistent rows over several steps
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowsSnapshot:
    """The host side of a v1 ``BlockTable`` at one moment, with who sits in each row.

    ``table`` holds every column of every row (stale ones too), ``counts`` is
    ``num_blocks_per_row``, ``requests[i]`` names the request in row ``i`` (None: no request),
    and ``num_reqs``, when given, is the batch size the step commits (rows ``[0, num_reqs)``).
    """

    label: str
    table: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    requests: tuple[str | None, ...]
    num_reqs: int | None = None


def snapshot_rows(block_table: BlockTable, label: str, requests: Sequence[str | None] = (),
                  num_reqs: int | None = None) -> RowsSnapshot:
    """Copy ``block_table``'s host rows and counts now, for ``draw_row_history``.

    ``requests`` names the request in each row, from row 0 (rows past the list have none).
    """
    if not isinstance(block_table, BlockTable):
        raise TypeError(f"block_table must be a v1 BlockTable, got {type(block_table).__name__}")
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    if isinstance(requests, str) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a list of names (str or None), one per row, got {requests!r}")
    rows = block_table.max_num_reqs
    if len(requests) > rows:
        raise ValueError(f"requests names {len(requests)} rows but the table has {rows}")
    for name in requests:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"each request name must be a str or None, got {name!r}")
    if num_reqs is not None and (not is_int(num_reqs) or not 0 <= num_reqs <= rows):
        raise ValueError(f"num_reqs must be None or an int in [0, {rows}], got {num_reqs!r}")
    table = tuple(tuple(int(b) for b in row) for row in block_table.get_numpy_array().tolist())
    counts = tuple(int(n) for n in block_table.num_blocks_per_row.tolist())
    names = tuple(requests) + (None,) * (rows - len(requests))
    return RowsSnapshot(label, table, counts, names, None if num_reqs is None else int(num_reqs))


def cell_kinds(snapshot: RowsSnapshot) -> list[list[str]]:
    """What each cell of a snapshot is, row by row:

    * ``"counted"``: a column the row counts (``col < num_blocks_per_row[row]``), in a row that
      holds a request: the attention kernels and the slot mapping read these;
    * ``"left_over"``: counted, but no request sits in the row (``move_row`` copies a row and
      leaves its source, count included, as it was);
    * ``"stale"``: past the count but not zero: an id an earlier request left behind, which
      ``add_row``, ``move_row`` and ``swap_row`` do not clear (nor does vLLM);
    * ``"empty"``: past the count and zero.
    """
    if not isinstance(snapshot, RowsSnapshot):
        raise TypeError(f"snapshot must be a RowsSnapshot (snapshot_rows), got {type(snapshot).__name__}")
    kinds = []
    for row, (ids, count, name) in enumerate(zip(snapshot.table, snapshot.counts, snapshot.requests)):
        kinds.append(["counted" if col < count and name is not None else
                      "left_over" if col < count else
                      "stale" if block_id != 0 else "empty"
                      for col, block_id in enumerate(ids)])
    return kinds


def request_colors(snapshots: Sequence[RowsSnapshot]) -> dict[str, str]:
    """One colour per request name, in order of first appearance over ``snapshots``."""
    colors: dict[str, str] = {}
    for snapshot in snapshots:
        for name in snapshot.requests:
            if name is not None and name not in colors:
                colors[name] = seq_color(len(colors))
    return colors


def _checked_snapshots(snapshots: Any) -> list[RowsSnapshot]:
    snapshots = snapshot_list(snapshots, RowsSnapshot, "snapshot_rows")
    shape = (len(snapshots[0].table), len(snapshots[0].table[0]))
    for s in snapshots:
        if (len(s.table), len(s.table[0])) != shape:
            raise ValueError("every snapshot must come from tables of the same shape")
    return list(snapshots)


def draw_row_history(snapshots: Any, ax: Any = None, per_line: int = 3, title: str | None = None) -> Any:
    """The table's rows at several moments, one panel per snapshot, left to right and wrapping
    after ``per_line`` panels.

    In each panel, row ``i`` (a batch position) shows all its columns: block ids the row counts
    in its request's colour, counted ids of a row nobody sits in (a ``move_row`` source) in grey,
    stale ids past the count hatched in red, zeros past the count empty. ``n=`` right of a row
    is its count. A thick outline marks the cells that changed since the previous panel; when a
    snapshot has ``num_reqs``, a dashed line closes the rows that step commits to the GPU.
    """
    snapshots = _checked_snapshots(snapshots)
    per_line = check_int("per_line", per_line, 1)
    colors = request_colors(snapshots)
    num_rows, num_cols = len(snapshots[0].table), len(snapshots[0].table[0])
    label_w, count_w, cell_h = 2.4, 1.3, 0.8
    panel_w = label_w + num_cols + count_w + 0.5
    panel_h = num_rows + 1.9
    lines = cdiv(len(snapshots), per_line)
    across = min(per_line, len(snapshots))
    ax = new_axes(ax, figsize=(min(15.0, 0.36 * across * panel_w + 0.4), 0.42 * lines * panel_h + 1.0))

    previous = None
    for k, snapshot in enumerate(snapshots):
        x0 = (k % per_line) * panel_w + label_w
        y0 = -(k // per_line) * panel_h
        label = textwrap.fill(f"{k + 1}. {snapshot.label}", width=int(4.2 * panel_w))
        ax.text(x0 - label_w + 0.2, y0 + 0.05, label, ha="left", va="bottom", fontsize=7.5)
        kinds = cell_kinds(snapshot)
        before = cell_kinds(previous) if previous is not None else None
        for r in range(num_rows):
            y = y0 - (r + 1) * 1.0
            name = snapshot.requests[r]
            ax.text(x0 - 0.15, y + cell_h / 2, f"row {r}: {name if name is not None else '—'}", ha="right",
                    va="center", fontsize=7, color=colors.get(name, MUTED_COLOR),
                    fontweight="bold" if name is not None else "normal")
            ax.text(x0 + num_cols + 0.15, y + cell_h / 2, f"n={snapshot.counts[r]}", ha="left", va="center",
                    fontsize=7, color=EDGE_COLOR)
            for c in range(num_cols):
                x, kind, block_id = x0 + c, kinds[r][c], snapshot.table[r][c]
                if kind == "counted":
                    face, alpha, hatch, text_color = colors[name], 0.55, None, "black"
                elif kind == "left_over":
                    face, alpha, hatch, text_color = MUTED_COLOR, 0.35, None, "black"
                elif kind == "stale":
                    face, alpha, hatch, text_color = "white", 1.0, STALE_HATCH, STALE_COLOR
                else:
                    face, alpha, hatch, text_color = "white", 1.0, None, None
                ax.add_patch(Rectangle((x, y), 1, cell_h, facecolor=face, alpha=alpha, edgecolor="none",
                                       gid=kind))
                if hatch:
                    ax.add_patch(Rectangle((x, y), 1, cell_h, facecolor="none", edgecolor=STALE_COLOR, lw=0,
                                           hatch=hatch, alpha=0.45, gid="stale_hatch"))
                ax.add_patch(Rectangle((x, y), 1, cell_h, facecolor="none", edgecolor=EDGE_COLOR, lw=0.5))
                if text_color is not None:
                    ax.text(x + 0.5, y + cell_h / 2, str(block_id), ha="center", va="center", fontsize=7,
                            color=text_color, gid=kind)
                if before is not None and (before[r][c] != kind or previous.table[r][c] != block_id):
                    ax.add_patch(Rectangle((x, y), 1, cell_h, facecolor="none", edgecolor=EDGE_COLOR, lw=2.0,
                                           gid="changed"))
        if snapshot.num_reqs is not None:
            y_line = y0 - snapshot.num_reqs * 1.0 - 0.1
            ax.plot([x0 - 0.3, x0 + num_cols + 0.3], [y_line] * 2, color=STALE_COLOR, lw=1.0, ls="--")
            ax.text(x0 + num_cols + 0.15, y_line - 0.05, f"commit {snapshot.num_reqs}", ha="left", va="top",
                    fontsize=6.5, color=STALE_COLOR)
        previous = snapshot

    handles = [Patch(facecolor=seq_color(0), alpha=0.55, edgecolor=EDGE_COLOR, label="counted (col < n)"),
               Patch(facecolor=MUTED_COLOR, alpha=0.35, edgecolor=EDGE_COLOR, label="counted, row has no request"),
               Patch(facecolor="white", edgecolor=STALE_COLOR, hatch=STALE_HATCH, label="stale: past the count"),
               Patch(facecolor="white", edgecolor=EDGE_COLOR, lw=2.0, label="changed since the last panel")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7, frameon=False)
    ax.set_xlim(-0.2, across * panel_w)
    ax.set_ylim(-lines * panel_h + 1.0, 1.0)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 "v1 BlockTable rows over time (numbers: block ids; n = num_blocks_per_row)", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 2. One step's slot mapping as arrows
# --------------------------------------------------------------------------------------------

def request_kinds(req_indices: Any, positions: Any) -> dict[int, str]:
    """Row -> ``"decode"`` or ``"prefill"`` for each request of a step, in batch order.

    A request that schedules exactly one token, past position 0, is decoding (its prompt is in
    the cache already); anything else is a prefill: a whole prompt, or a chunk of one.
    """
    rows = check_int_list("req_indices", req_indices)
    pos = check_int_list("positions", positions)
    if len(rows) != len(pos):
        raise ValueError(f"req_indices and positions must have the same length, got {len(rows)} and {len(pos)}")
    tokens: dict[int, list[int]] = {}
    for r, p in zip(rows, pos):
        tokens.setdefault(r, []).append(p)
    return {r: "decode" if len(ps) == 1 and ps[0] > 0 else "prefill" for r, ps in tokens.items()}


def draw_slot_mapping_arrows(req_indices: Any, positions: Any, slots: Any, block_size: int,
                             requests: Sequence[str] | Mapping[int, str] | None = None, ax: Any = None,
                             title: str | None = None) -> Any:
    """One step's tokens (top), the KV-cache blocks they are written to (bottom), and an arrow
    from each token to its slot.

    Tokens are drawn in batch order, grouped by request (``req_indices``: the row of each
    token), each labelled with its position and its request's kind (``request_kinds``). Only
    the cache blocks this step writes to are drawn, in id order, each as ``block_size`` slots
    numbered with their slot id; the slots written now are coloured by their request. A token
    whose slot is ``PAD_SLOT_ID`` (-1: another DCP rank stores it) is hatched and has no arrow.
    ``requests`` names the request in each row (default: ``row r``).
    """
    rows = check_int_list("req_indices", req_indices)
    pos = check_int_list("positions", positions)
    slot_ids = check_int_list("slots", slots)
    block_size = check_int("block_size", block_size, 1)
    if not len(rows) == len(pos) == len(slot_ids):
        raise ValueError(f"req_indices, positions and slots must have the same length, "
                         f"got {len(rows)}, {len(pos)} and {len(slot_ids)}")
    if not rows:
        raise ValueError("there are no tokens to draw")
    if min(slot_ids) < PAD_SLOT_ID:
        raise ValueError(f"slots must be >= 0, or {PAD_SLOT_ID} for a token this rank does not store")
    kinds = request_kinds(rows, pos)
    if requests is None:
        names = {r: f"row {r}" for r in kinds}
    elif isinstance(requests, Mapping):
        names = {r: f"{requests[r]} (row {r})" if r in requests else f"row {r}" for r in kinds}
    else:
        names = {r: f"{requests[r]} (row {r})" if 0 <= r < len(requests) else f"row {r}" for r in kinds}
    color = {r: seq_color(i) for i, r in enumerate(kinds)}

    # Token x positions: contiguous runs of one row, with a gap between runs (and room for the
    # run's two-line label, however few its tokens).
    group_gap, min_group_w, block_gap, cell_h = 0.8, 3.2, 0.7, 0.8
    token_x, groups, x, group_start = [], [], 0.0, 0.0
    for t, r in enumerate(rows):
        if t == 0 or r != rows[t - 1]:
            if t:
                x = max(x, group_start + min_group_w) + group_gap
            group_start = x
            groups.append((r, x, t))
        token_x.append(x)
        x += 1
    tokens_w = x
    blocks = sorted({s // block_size for s in slot_ids if s >= 0})
    blocks_w = len(blocks) * block_size + max(len(blocks) - 1, 0) * block_gap
    width = max(tokens_w, blocks_w)
    shift_tokens, shift_blocks = (width - tokens_w) / 2, (width - blocks_w) / 2
    block_x = {b: shift_blocks + k * (block_size + block_gap) for k, b in enumerate(blocks)}
    writer = {s: r for r, s in zip(rows, slot_ids) if s >= 0}

    y_tok, y_cache = 3.2, 0.0
    ax = new_axes(ax, figsize=(min(16.0, max(6.0, 1.8 + 0.3 * width)), 3.6))
    for k, (r, gx, first) in enumerate(groups):
        last = groups[k + 1][2] if k + 1 < len(groups) else len(rows)
        ax.text(shift_tokens + gx, y_tok + cell_h + 0.12, f"{names[r]}\n{kinds[r]}, {last - first} token"
                f"{'s' if last - first > 1 else ''}", ha="left", va="bottom", fontsize=7, color=color[r],
                fontweight="bold")
    for t, (r, p, s) in enumerate(zip(rows, pos, slot_ids)):
        xt = shift_tokens + token_x[t]
        local = s >= 0
        ax.add_patch(Rectangle((xt, y_tok), 1, cell_h, facecolor=color[r], alpha=0.55 if local else 0.15,
                               edgecolor=EDGE_COLOR, lw=0.5, hatch=None if local else STALE_HATCH,
                               gid="token" if local else "pad_token"))
        ax.text(xt + 0.5, y_tok + cell_h / 2, str(p), ha="center", va="center", fontsize=6.5, gid="position")
        if not local:
            ax.text(xt + 0.5, y_tok - 0.1, str(PAD_SLOT_ID), ha="center", va="top", fontsize=6, color=STALE_COLOR)
            continue
        b, off = divmod(s, block_size)
        ax.annotate("", xy=(block_x[b] + off + 0.5, y_cache + cell_h), xytext=(xt + 0.5, y_tok),
                    arrowprops=dict(arrowstyle="-|>", color=color[r], lw=0.8, alpha=0.8, shrinkA=1, shrinkB=1))

    for b in blocks:
        for off in range(block_size):
            s = b * block_size + off
            r = writer.get(s)
            ax.add_patch(Rectangle((block_x[b] + off, y_cache), 1, cell_h,
                                   facecolor=color[r] if r is not None else "white",
                                   alpha=0.55 if r is not None else 1.0, edgecolor=EDGE_COLOR, lw=0.4,
                                   gid="written_slot" if r is not None else "slot"))
            if block_size <= 16:
                ax.text(block_x[b] + off + 0.5, y_cache + cell_h / 2, str(s), ha="center", va="center",
                        fontsize=5.5 if s >= 100 else 6.5, gid="slot")
        ax.add_patch(Rectangle((block_x[b], y_cache), block_size, cell_h, facecolor="none", edgecolor=EDGE_COLOR,
                               lw=1.2))
        ax.text(block_x[b] + block_size / 2, y_cache - 0.12, f"block {b}", ha="center", va="top", fontsize=7.5)

    ax.text(-0.4, y_tok + cell_h / 2, "tokens\n(batch order;\nnumber: position)", ha="right", va="center",
            fontsize=7, color=MUTED_COLOR)
    ax.text(-0.4, y_cache + cell_h / 2, "KV cache\n(number: slot)", ha="right", va="center", fontsize=7,
            color=MUTED_COLOR)
    ax.set_xlim(-3.4, width + 0.3)
    ax.set_ylim(y_cache - 0.7, y_tok + cell_h + 1.2)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"Slot mapping of one step: slot = row[p // B] * B + p % B, B = {block_size}", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 3. Decode context parallelism: which rank stores which token
# --------------------------------------------------------------------------------------------

def draw_dcp_ownership(num_positions: int, dcp_world_size: int, interleave: int, block_size: int,
                       ax: Any = None, title: str | None = None) -> Any:
    """Positions ``0 .. num_positions-1`` of one request, coloured by the DCP rank that stores
    them, and under them each rank's own blocks, holding the positions written in their cells.

    Every rank's table has the same columns; column ``j`` covers the ``block_size *
    dcp_world_size`` positions of "virtual block" ``j``, of which each rank stores
    ``block_size``, packed densely in its own block ``j``. The drawing gives each column a band
    of its own, one under the other: the column's positions on top, every rank's block ``j``
    under them (so a wide request stays readable: a band is one virtual block wide).
    """
    n = check_int("num_positions", num_positions, 1)
    world = check_int("dcp_world_size", dcp_world_size, 1)
    step = check_int("interleave", interleave, 1)
    B = check_int("block_size", block_size, 1)
    if world > 1 and B % step:
        raise ValueError(f"with DCP the interleave size ({step}) must divide the block size ({B})")
    virtual = B * world
    width = min(n, virtual)
    bands = cdiv(n, virtual)
    cell_h, pitch = 0.8, 1.05
    band_h = (world + 1) * pitch + 0.75
    ax = new_axes(ax, figsize=(min(15.0, max(6.0, 2.0 + 0.36 * width)), 0.9 + 0.33 * band_h * bands))
    font = 7.5 if width <= 40 else 6

    owners = [dcp_owner_rank(p, world, step) for p in range(n)]
    for j in range(bands):
        y_top = -j * band_h
        first, last = j * virtual, min((j + 1) * virtual, n) - 1
        ax.text(0, y_top + cell_h + 0.1, f"column {j}: positions {first}–{last}", ha="left", va="bottom",
                fontsize=8, color=EDGE_COLOR)
        ax.text(-0.4, y_top + cell_h / 2, "positions", ha="right", va="center", fontsize=8, fontweight="bold")
        for p in range(first, last + 1):
            ax.add_patch(Rectangle((p - first, y_top), 1, cell_h, facecolor=seq_color(owners[p]), alpha=0.55,
                                   edgecolor=EDGE_COLOR, lw=0.4, gid=f"rank{owners[p]}"))
            ax.text(p - first + 0.5, y_top + cell_h / 2, str(p), ha="center", va="center", fontsize=font,
                    gid=f"rank{owners[p]}")
        for r in range(world):
            y = y_top - (r + 1) * pitch
            ax.text(-0.4, y + cell_h / 2, f"rank {r}, block {j}", ha="right", va="center", fontsize=8,
                    color=seq_color(r), fontweight="bold")
            ax.add_patch(Rectangle((0, y), B, cell_h, facecolor="none", edgecolor=EDGE_COLOR, lw=1.1))
    for p in range(n):
        r = owners[p]
        local = dcp_local_position(p, world, step)
        j, x = divmod(local, B)                         # the rank's block j, place x in it
        y = -j * band_h - (r + 1) * pitch
        ax.add_patch(Rectangle((x, y), 1, cell_h, facecolor=seq_color(r), alpha=0.55, edgecolor=EDGE_COLOR,
                               lw=0.4, gid=f"local{r}"))
        ax.text(x + 0.5, y + cell_h / 2, str(p), ha="center", va="center", fontsize=font, gid=f"local{r}")

    ax.set_xlim(-4.2, width + 0.3)
    ax.set_ylim(-(bands - 1) * band_h - world * pitch - 0.3, cell_h + 0.8)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"DCP over {world} ranks, interleave {step}, block size {B}: runs of {step} position"
                 f"{'s' if step > 1 else ''} go to the ranks in turn; each rank packs its own into its blocks",
                 fontsize=9.5)
    return ax


# --------------------------------------------------------------------------------------------
# 4. Hybrid blocks: a manager block cut into kernel blocks
# --------------------------------------------------------------------------------------------

_LABEL_BOX = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8)


def draw_kernel_blocks(manager_block_ids: Any, block_size: int, kernel_block_size: int, position: int | None = None,
                       ax: Any = None, title: str | None = None) -> Any:
    """One request's row twice: as the KV-cache manager allocates it (blocks of ``block_size``
    tokens, top) and as the table stores it for the kernel (blocks of ``kernel_block_size``,
    bottom), with the token positions each covers. Manager block ``b`` becomes kernel blocks
    ``b*bpk .. b*bpk + bpk-1`` (``BlockTable.map_to_kernel_blocks``). With ``position``, that
    token is marked in both, with its slot computed both ways (they are the same slot).
    """
    ids = check_int_list("manager_block_ids", manager_block_ids)
    if not ids or min(ids) < 0:
        raise ValueError(f"manager_block_ids must be a non-empty list of block ids >= 0, got {ids!r}")
    bs = check_int("block_size", block_size, 1)
    kb = check_int("kernel_block_size", kernel_block_size, 1)
    if bs % kb:
        raise ValueError(f"kernel_block_size {kb} must divide block_size {bs} evenly")
    bpk = bs // kb
    kernel_ids = BlockTable.map_to_kernel_blocks(np.asarray(ids, dtype=np.int64), bpk, None).tolist()
    if position is not None and (not is_int(position) or not 0 <= position < len(ids) * bs):
        raise ValueError(f"position must be an int in [0, {len(ids) * bs}) (the row's tokens), got {position!r}")

    w, h = 2.2, 0.8                         # width of one kernel block, height of a box
    y_m, y_k = 1.7, 0.0
    ax = new_axes(ax, figsize=(min(15.0, 1.8 + 0.62 * w * len(kernel_ids)), 2.9))
    for j, b in enumerate(ids):
        x = j * bpk * w
        ax.add_patch(Rectangle((x, y_m), bpk * w, h, facecolor=seq_color(j), alpha=0.35, edgecolor=EDGE_COLOR,
                               lw=1.2, gid="manager_block"))
        ax.text(x + bpk * w / 2, y_m + h / 2, f"manager block {b}", ha="center", va="center", fontsize=8,
                fontweight="bold", zorder=4, bbox=_LABEL_BOX, gid="manager_block")
        ax.text(x + bpk * w / 2, y_m + h + 0.08, f"positions {j * bs}–{(j + 1) * bs - 1}", ha="center",
                va="bottom", fontsize=7, color=MUTED_COLOR)
    for c, k in enumerate(kernel_ids):
        x = c * w
        ax.add_patch(Rectangle((x, y_k), w, h, facecolor=seq_color(c // bpk), alpha=0.2 + 0.3 * (c % 2),
                               edgecolor=EDGE_COLOR, lw=0.9, gid="kernel_block"))
        ax.text(x + w / 2, y_k + h / 2, f"kernel {k}", ha="center", va="center", fontsize=7.5, zorder=4,
                bbox=_LABEL_BOX, gid="kernel_block")
        ax.text(x + w / 2, y_k - 0.08, f"pos {c * kb}–{(c + 1) * kb - 1}", ha="center", va="top", fontsize=6.5,
                color=MUTED_COLOR)
        ax.plot([x + w / 2, x + w / 2], [y_k + h, y_m], color=MUTED_COLOR, lw=0.6, ls=":")
    ax.text(-0.2, y_m + h / 2, f"manager\nB = {bs}", ha="right", va="center", fontsize=7.5)
    ax.text(-0.2, y_k + h / 2, f"table / kernel\nB = {kb}", ha="right", va="center", fontsize=7.5)

    if position is not None:
        p = position
        c, off = divmod(p, kb)
        m = ids[p // bs]
        slot = kernel_ids[c] * kb + off
        for y, x in ((y_m, (p / bs) * bpk * w), (y_k, (p / kb) * w)):
            ax.plot([x + w / kb / 2] * 2, [y, y + h], color="black", lw=2.0, zorder=3, gid="position")
        ax.text(0, y_k - 0.55, f"position {p}: kernel column {c} holds kernel block {kernel_ids[c]} "
                f"= {m}·{bpk} + {c % bpk}, offset {off} → slot {kernel_ids[c]}·{kb} + {off} = {slot} "
                f"= {m}·{bs} + {p % bs} (the manager's view)", ha="left", va="top", fontsize=7.5,
                gid="position")
    ax.set_xlim(-2.4, len(kernel_ids) * w + 0.2)
    ax.set_ylim(y_k - (0.95 if position is not None else 0.5), y_m + h + 0.5)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"Hybrid blocks: each manager block of {bs} tokens is {bpk} kernel blocks of {kb}", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 5. compute_slot_mapping against a Python loop
# --------------------------------------------------------------------------------------------

def draw_slot_mapping_times(num_tokens: Sequence[int], times_us: dict[str, Sequence[float]], ax: Any = None,
                            title: str | None = None) -> Any:
    """Time per call (µs) against the number of tokens in the step, one line per
    implementation (``bench.slot_mapping_times``'s result). Both axes are logarithmic."""
    tokens = check_int_list("num_tokens", num_tokens, 1)
    series = times_series(times_us, len(tokens), "token counts")
    return plot_times(new_axes(ax, figsize=(6.0, 4.0)), tokens, series, "tokens in the step",
                      "time per call (µs, log scale)",
                      title if title is not None else "Slot mapping: numpy over the batch vs a Python loop")
