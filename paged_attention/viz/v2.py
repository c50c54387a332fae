"""Drawing the model runner v2's block tables: staged writes, UVA counts, the gather, the slot-mapping grid.

* ``staged_writes`` + ``draw_staged_writes``: the ``(row, start, ids)`` writes a
  ``StagedWriteTensor`` holds on the host, and the table before and after ``apply_write()`` has
  run them, one Triton program per write, in one launch (``v2.buffers.apply_writes``: the same
  in numpy).
* ``snapshot_uva`` + ``draw_uva_counters``: a ``UvaBackedTensor`` (the per-request block counts)
  at several moments: the host array Python edits, the pool's pinned buffers, and which one
  ``.gpu`` (what kernels are given) points to.
* ``draw_gather``: the persistent rows (one per request state) and the batch-ordered rows
  ``gather_block_tables`` fills through ``idx_mapping``, with an arrow per batch row, stale
  columns and padded rows marked (``v2.block_table.gather_kinds`` says which is which).
* ``draw_slot_mapping_grid``: which tokens each program of ``compute_slot_mappings`` handles
  (the grids ``vllm_slot_programs`` and ``fast_slot_programs`` of ``paged_attention.v2`` list):
  vLLM's one program per (group, request) plus a padding program per group, and our
  token-parallel tiles, each doing every group.
* ``draw_v2_step_times``: the v1 and v2 step times against the batch size (GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.patches import Patch, Rectangle

from paged_attention.v2.block_table import vllm_slot_programs
from paged_attention.v2.block_table_fast import fast_slot_programs
from paged_attention.v2.block_table import gather_kinds
from paged_attention.v2.buffers import (StagedWrite, StagedWriteTensor, UvaBackedTensor, apply_writes,
                                        check_staged_writes)
from paged_attention.utils import check_int, check_int_array, check_int_list
from paged_attention.viz.style import (
    EDGE_COLOR, MUTED_COLOR, new_axes, plot_times, seq_color, snapshot_list, times_series,
)

STALE_COLOR = "#E45756"     # ids past a row's count (nothing reads them, but they are there)
STALE_HATCH = "////"
PADDING_COLOR = "#DDDDDD"   # padded rows and padded tokens
UNPUBLISHED_COLOR = "#EECA3B"   # host values the GPU cannot see yet


def _cell(ax: Any, x: float, y: float, value: int | None, face: str, alpha: float, gid: str, *,
          hatch: str | None = None, text_color: str = "black", h: float = 0.8) -> None:
    """One table cell: a filled box with an outline, and its value written in it (None: no text)."""
    ax.add_patch(Rectangle((x, y), 1, h, facecolor=face, alpha=alpha, edgecolor="none", gid=gid))
    if hatch:
        ax.add_patch(Rectangle((x, y), 1, h, facecolor="none", edgecolor=STALE_COLOR, lw=0, hatch=hatch,
                               alpha=0.45, gid=f"{gid}_hatch"))
    ax.add_patch(Rectangle((x, y), 1, h, facecolor="none", edgecolor=EDGE_COLOR, lw=0.5))
    if value is not None:
        ax.text(x + 0.5, y + h / 2, str(value), ha="center", va="center", fontsize=7, color=text_color, gid=gid)


# --------------------------------------------------------------------------------------------
# 1. Staged writes: a list on the host, one launch on the device
# --------------------------------------------------------------------------------------------

def staged_writes(tensor: StagedWriteTensor) -> list[StagedWrite]:
    """The writes ``tensor`` holds now, in the order they were staged (nothing is applied or
    cleared): what its next ``apply_write()`` hands to the kernel, one program each."""
    if not isinstance(tensor, StagedWriteTensor):
        raise TypeError(f"tensor must be a StagedWriteTensor, got {type(tensor).__name__}")
    return [StagedWrite(int(row), int(start), ids) for row, start, ids in tensor.staged_writes()]


def draw_staged_writes(writes: Any, before: Any, after: Any = None, ax: Any = None, title: str | None = None) -> Any:
    """The staged writes as a list (left), the table before (middle) and after (right) one
    ``apply_write()``.

    Write ``k`` is program ``k`` of the launch and has its own colour; in the right-hand table the
    cells it wrote take that colour, the others keep their values (grey where non-zero). ``after``
    defaults to ``apply_writes(before, writes)``; pass the tensor the kernel produced to draw
    that instead.
    """
    before_t = check_int_array("before", before, 2)
    writes = check_staged_writes(writes, before_t.shape)
    after_t = apply_writes(before_t, writes) if after is None else check_int_array("after", after, 2)
    if after_t.shape != before_t.shape:
        raise ValueError(f"after has shape {after_t.shape}, before {before_t.shape}")
    rows, cols = before_t.shape
    writer = np.full((rows, cols), -1)
    for k, (row, start, ids) in enumerate(writes):
        writer[row, start:start + len(ids)] = k

    list_w, gap = 7.0, 3.4
    x_before = list_w + 1.2
    x_after = x_before + cols + gap
    ax = new_axes(ax, figsize=(min(15.0, 0.5 * (x_after + cols + 1.5)), 1.5 + 0.45 * max(rows, len(writes) + 1)))

    ax.text(0, 0.35, "staged on the host: stage_write(row, start, ids)", ha="left", va="bottom", fontsize=8,
            fontweight="bold")
    for k, (row, start, ids) in enumerate(writes):
        ax.text(0, -(k + 1) + 0.4, f"write {k}: row {row}, start {start}, ids {list(ids)}", ha="left",
                va="center", fontsize=7.5, color=seq_color(k), fontweight="bold", gid="write_entry")
    if not writes:
        ax.text(0, -0.6, "(nothing staged: apply_write() launches nothing)", ha="left", va="center", fontsize=7.5,
                color=MUTED_COLOR)

    for x0, table, label in ((x_before, before_t, "before"),
                             (x_after, after_t, f"after apply_write(): one launch, grid ({len(writes)},)")):
        ax.text(x0, 0.35, label, ha="left", va="bottom", fontsize=8, fontweight="bold")
        for r in range(rows):
            y = -(r + 1)
            ax.text(x0 - 0.15, y + 0.4, f"row {r}", ha="right", va="center", fontsize=7)
            for c in range(cols):
                value = int(table[r, c])
                if table is after_t and writer[r, c] >= 0:
                    _cell(ax, x0 + c, y, value, seq_color(int(writer[r, c])), 0.6, "written")
                elif value != 0:
                    _cell(ax, x0 + c, y, value, MUTED_COLOR, 0.3, "kept" if table is after_t else "before")
                else:
                    _cell(ax, x0 + c, y, None, "white", 1.0, "zero")
    ax.annotate("", xy=(x_after - 1.1, -rows / 2), xytext=(x_before + cols + 0.3, -rows / 2),
                arrowprops=dict(arrowstyle="-|>", color=EDGE_COLOR, lw=1.2))
    ax.text(x_before + cols + (gap - 0.8) / 2, -rows / 2 + 0.15, "program k\ndoes write k", ha="center",
            va="bottom", fontsize=6.5, color=EDGE_COLOR)
    ax.set_xlim(-0.3, x_after + cols + 0.5)
    ax.set_ylim(-max(rows, len(writes)) - 0.4, 1.2)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 "StagedWriteTensor: writes recorded on the host, applied by one kernel launch", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 2. The block counts: host truth, pinned buffers, and what .gpu points to
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UvaSnapshot:
    """A ``UvaBackedTensor`` at one moment.

    ``host`` is ``.np`` (the truth Python edits), ``buffers`` the contents of each pinned pool
    buffer, ``gpu_buffer`` the buffer ``.gpu`` is a view of (what a kernel launched now would
    read), ``gpu_rows`` how many rows that view has, ``next_buffer`` where the next
    ``copy_to_uva`` will copy to. Every table is 2-D (a 1-D tensor is one row).
    """

    label: str
    host: tuple[tuple[int, ...], ...]
    buffers: tuple[tuple[tuple[int, ...], ...], ...]
    gpu_buffer: int | None
    gpu_rows: int
    next_buffer: int

    @property
    def gpu_view(self) -> tuple[tuple[int, ...], ...]:
        """What a kernel reads through ``.gpu`` now: the first ``gpu_rows`` rows of its buffer."""
        if self.gpu_buffer is None:
            return ()
        return self.buffers[self.gpu_buffer][:self.gpu_rows]

    def unpublished(self) -> list[tuple[int, int]]:
        """The (row, column) cells where the host differs from what ``.gpu`` shows (or that
        ``.gpu`` does not have): edits the GPU cannot see until the next ``copy_to_uva``."""
        view = self.gpu_view
        cells = []
        for r, row in enumerate(self.host):
            for c, value in enumerate(row):
                if r >= len(view) or view[r][c] != value:
                    cells.append((r, c))
        return cells


def _as_rows(array: np.ndarray) -> tuple[tuple[int, ...], ...]:
    a = np.asarray(array)
    if a.ndim == 1:
        a = a[None, :]
    return tuple(tuple(int(v) for v in row) for row in a.reshape(a.shape[0], -1).tolist())


def snapshot_uva(tensor: UvaBackedTensor, label: str) -> UvaSnapshot:
    """Copy ``tensor``'s host array, its pool buffers and where ``.gpu`` points now, for
    ``draw_uva_counters``."""
    if not isinstance(tensor, UvaBackedTensor):
        raise TypeError(f"tensor must be a UvaBackedTensor, got {type(tensor).__name__}")
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    pool = tensor.pool
    rows = int(tensor.gpu.shape[0]) if tensor.gpu.dim() > 1 else (1 if tensor.gpu.numel() else 0)
    return UvaSnapshot(label, _as_rows(tensor.np), tuple(_as_rows(b) for b in pool.host_contents()),
                       pool.index_of(tensor.gpu), rows, (pool.current_index + 1) % pool.max_concurrency)


def draw_uva_counters(snapshots: Any, row_labels: Sequence[str] | None = None, ax: Any = None,
                      title: str | None = None) -> Any:
    """One panel per snapshot, left to right: the host array (``.np``, top) and each pinned pool
    buffer under it, the one ``.gpu`` points to marked ``← .gpu``.

    Host cells the GPU cannot see yet (they differ from ``.gpu``'s buffer) are yellow; the
    buffer ``.gpu`` points to is coloured, the others (older copies, still readable by kernels
    launched before the last ``copy_to_uva``) are grey. ``row_labels`` names the rows (e.g. the
    KV-cache groups).
    """
    snapshots = snapshot_list(snapshots, UvaSnapshot, "snapshot_uva")
    rows, cols = len(snapshots[0].host), len(snapshots[0].host[0])
    num_bufs = len(snapshots[0].buffers)
    for s in snapshots:
        if (len(s.host), len(s.host[0]), len(s.buffers)) != (rows, cols, num_bufs):
            raise ValueError("every snapshot must come from the same UvaBackedTensor")
    if row_labels is not None and len(row_labels) != rows:
        raise ValueError(f"row_labels names {len(row_labels)} rows, the tensor has {rows}")
    labels = list(row_labels) if row_labels is not None else [f"row {r}" for r in range(rows)]

    label_w, marker_w = 2.2, 2.4
    panel_w = label_w + cols + marker_w
    block_h = rows + 1.0
    panel_h = (num_bufs + 1) * block_h + 0.8
    ax = new_axes(ax, figsize=(min(15.0, 0.36 * len(snapshots) * panel_w + 0.5), 0.36 * panel_h + 1.3))
    for k, snap in enumerate(snapshots):
        x0 = k * panel_w + label_w
        ax.text(x0 - label_w + 0.2, 0.6, f"{k + 1}. {snap.label}", ha="left", va="bottom", fontsize=7.5,
                fontweight="bold")
        unpublished = set(snap.unpublished())
        sections = [("host .np (the truth)", snap.host, "host")]
        sections += [(f"buffer {b}", buf, f"buffer{b}") for b, buf in enumerate(snap.buffers)]
        for i, (name, table, gid) in enumerate(sections):
            y_top = -i * block_h
            is_gpu = i >= 1 and i - 1 == snap.gpu_buffer
            ax.text(x0, y_top + 0.05, name, ha="left", va="bottom", fontsize=7,
                    color="black" if i == 0 or is_gpu else MUTED_COLOR)
            if is_gpu:
                ax.text(x0 + cols + 0.2, y_top - rows / 2, "← .gpu", ha="left", va="center", fontsize=8,
                        fontweight="bold", color=seq_color(0), gid="gpu_marker")
            elif i >= 1 and i - 1 == snap.next_buffer:
                ax.text(x0 + cols + 0.2, y_top - rows / 2, "← next copy", ha="left", va="center", fontsize=6.5,
                        color=MUTED_COLOR, gid="next_marker")
            for r in range(rows):
                y = y_top - (r + 1) * 0.9
                ax.text(x0 - 0.15, y + 0.4, labels[r], ha="right", va="center", fontsize=6.5, color=EDGE_COLOR)
                for c in range(cols):
                    value = table[r][c]
                    if i == 0:
                        face, alpha, cell_gid = ((UNPUBLISHED_COLOR, 0.8, "unpublished") if (r, c) in unpublished
                                                 else ("white", 1.0, "host"))
                    elif is_gpu:
                        face, alpha, cell_gid = seq_color(0), 0.35 if r < snap.gpu_rows else 0.1, "gpu"
                    else:
                        face, alpha, cell_gid = MUTED_COLOR, 0.2, "old"
                    _cell(ax, x0 + c, y, value, face, alpha, cell_gid, h=0.8)
    handles = [Patch(facecolor=UNPUBLISHED_COLOR, alpha=0.8, edgecolor=EDGE_COLOR,
                     label="host value the GPU cannot see yet"),
               Patch(facecolor=seq_color(0), alpha=0.35, edgecolor=EDGE_COLOR, label="what kernels read (.gpu)"),
               Patch(facecolor=MUTED_COLOR, alpha=0.2, edgecolor=EDGE_COLOR, label="an older copy")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    ax.set_xlim(-0.2, len(snapshots) * panel_w)
    ax.set_ylim(-(num_bufs + 1) * block_h + 0.6, 1.3)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 "UvaBackedTensor: edits on the host, published to the next pinned buffer by copy_to_uva()",
                 fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 3. The gather: batch rows from request-state rows through idx_mapping
# --------------------------------------------------------------------------------------------

def _request_names(requests: Any, count: int) -> dict[int, str]:
    if requests is None:
        return {}
    if isinstance(requests, Mapping):
        return {int(k): str(v) for k, v in requests.items() if v is not None}
    if isinstance(requests, (list, tuple)):
        if len(requests) > count:
            raise ValueError(f"requests names {len(requests)} request states, the table has {count}")
        return {k: str(v) for k, v in enumerate(requests) if v is not None}
    raise TypeError(f"requests must be a list (by request state) or a dict, got {type(requests).__name__}")


def draw_gather(persistent: Any, num_blocks: Any, idx_mapping: Any, gathered: Any, requests: Any = None,
                ax: Any = None, title: str | None = None) -> Any:
    """The persistent table (left: one row per request state, as ``block_tables[g].gpu``) and the
    gathered one (right: one row per batch position, as ``input_block_tables[g]``), with an arrow
    from request state ``idx_mapping[b]`` to batch row ``b``.

    Left, a row's first ``num_blocks[s]`` columns take the request's colour (ids past the count,
    left by a shorter overwrite, are hatched). Right, cells are drawn by ``gather_kinds``:
    copied ones in the colour of the request they came from, stale ones hatched, padded rows
    grey. ``requests`` names the request in each state (a list by state, or a dict).
    """
    src = check_int_array("persistent", persistent, 2)
    dst = check_int_array("gathered", gathered, 2)
    counts = check_int_list("num_blocks", num_blocks)
    idx = check_int_list("idx_mapping", idx_mapping)
    if len(counts) != src.shape[0]:
        raise ValueError(f"num_blocks has {len(counts)} counts but persistent has {src.shape[0]} rows")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"persistent has {src.shape[1]} columns, gathered {dst.shape[1]}")
    kinds = gather_kinds(counts, idx, dst)
    names = _request_names(requests, src.shape[0])
    rows_l, rows_r, cols = src.shape[0], dst.shape[0], src.shape[1]

    label_w, gap = 3.2, 5.5
    x_l = label_w
    x_r = x_l + cols + gap
    ax = new_axes(ax, figsize=(min(15.0, 0.42 * (x_r + cols + 1.0)), 1.6 + 0.42 * max(rows_l, rows_r)))
    ax.text(x_l, 0.2, "block_tables[g]\n(one row per request state)", ha="left", va="bottom", fontsize=8,
            fontweight="bold")
    ax.text(x_r, 0.2, f"input_block_tables[g][:{rows_r}]\n(one row per batch position)", ha="left", va="bottom",
            fontsize=8, fontweight="bold")
    in_batch = set(idx)
    for s in range(rows_l):
        y = -(s + 1)
        name = names.get(s)
        color = seq_color(s)
        ax.text(x_l - 0.15, y + 0.4, f"state {s}: {name if name else '—'}", ha="right", va="center", fontsize=7,
                color=color if s in in_batch else MUTED_COLOR, fontweight="bold" if s in in_batch else "normal")
        for c in range(cols):
            value = int(src[s, c])
            if c < counts[s]:
                _cell(ax, x_l + c, y, value, color, 0.55, "held")
            elif value != 0:
                _cell(ax, x_l + c, y, value, "white", 1.0, "held_stale", hatch=STALE_HATCH, text_color=STALE_COLOR)
            else:
                _cell(ax, x_l + c, y, None, "white", 1.0, "held_empty")
        ax.text(x_l + cols + 0.15, y + 0.4, f"n={counts[s]}", ha="left", va="center", fontsize=6.5,
                color=EDGE_COLOR)
    for b in range(rows_r):
        y = -(b + 1)
        if b < len(idx):
            s = idx[b]
            label, color = f"batch {b} ← state {s}", seq_color(s)
        else:
            label, color = f"batch {b}: padding", MUTED_COLOR
        ax.text(x_r + cols + 0.15, y + 0.4, label, ha="left", va="center", fontsize=7, color=color)
        for c in range(cols):
            kind, value = kinds[b][c], int(dst[b, c])
            if kind == "copied":
                _cell(ax, x_r + c, y, value, color, 0.55, "copied")
            elif kind == "stale":
                _cell(ax, x_r + c, y, value, "white", 1.0, "stale", hatch=STALE_HATCH, text_color=STALE_COLOR)
            elif kind == "padding":
                _cell(ax, x_r + c, y, value, PADDING_COLOR, 0.8, "padding", text_color=MUTED_COLOR)
            else:
                _cell(ax, x_r + c, y, None, "white", 1.0, "empty")
        if b < len(idx):
            ax.annotate("", xy=(x_r - 0.1, y + 0.4), xytext=(x_l + cols + 1.2, -(idx[b] + 1) + 0.4),
                        arrowprops=dict(arrowstyle="-|>", color=seq_color(idx[b]), lw=1.3, shrinkA=2, shrinkB=2),
                        gid="gather_arrow")
    handles = [Patch(facecolor=seq_color(0), alpha=0.55, edgecolor=EDGE_COLOR, label="copied (col < n)"),
               Patch(facecolor="white", edgecolor=STALE_COLOR, hatch=STALE_HATCH, label="stale: past the count"),
               Patch(facecolor=PADDING_COLOR, alpha=0.8, edgecolor=EDGE_COLOR, label="padded row (zeros)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    ax.set_xlim(-0.2, x_r + cols + 4.2)
    ax.set_ylim(-max(rows_l, rows_r) - 0.3, 1.5)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"gather_block_tables: batch row b ← request state idx_mapping[b] (idx_mapping = {idx})",
                 fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 4. The slot-mapping kernel's grid: vLLM's programs and our tiles
# --------------------------------------------------------------------------------------------

def draw_slot_mapping_grid(query_start_loc: Any, max_num_tokens: int, num_groups: int, block_tokens: int,
                           requests: Sequence[str] | None = None, ax: Any = None, title: str | None = None) -> Any:
    """The slot-mapping buffer's ``max_num_tokens`` slots (top, coloured by batch position;
    padding grey) and, under them, which program writes which slots: vLLM's (one lane per
    group; a box per request program, the padding program hatched) and ours (tiles of
    ``block_tokens`` slots, each box spanning every group). ``requests`` names the batch
    positions."""
    max_num_tokens = check_int("max_num_tokens", max_num_tokens, 1)
    num_groups = check_int("num_groups", num_groups, 1)
    block_tokens = check_int("block_tokens", block_tokens, 1)
    qsl = check_int_list("query_start_loc", query_start_loc)
    vllm = vllm_slot_programs(qsl, max_num_tokens, num_groups)       # checks qsl too
    num_reqs = len(qsl) - 1
    if requests is not None and len(requests) != num_reqs:
        raise ValueError(f"requests names {len(requests)} batch positions, query_start_loc has {num_reqs}")
    names = [str(r) for r in requests] if requests is not None else [f"batch {b}" for b in range(num_reqs)]
    fast = fast_slot_programs(max_num_tokens, block_tokens)
    owner = [None] * max_num_tokens
    for b in range(num_reqs):
        for t in range(qsl[b], qsl[b + 1]):
            owner[t] = b

    T = max_num_tokens
    w = 1.0 if T <= 40 else 40.0 / T           # width of one slot
    lane_h, pitch = 0.7, 0.95
    y_tok = 0.0
    y_vllm = y_tok - 1.6
    y_fast = y_vllm - num_groups * pitch - 1.0
    ax = new_axes(ax, figsize=(min(15.0, 2.8 + 0.36 * T * w + 3.2), 1.6 + 0.42 * (2 * num_groups + 2)))

    ax.text(-0.3, y_tok + 0.35, "slots (tokens)", ha="right", va="center", fontsize=7.5, fontweight="bold")
    for t in range(T):
        b = owner[t]
        face = seq_color(b) if b is not None else PADDING_COLOR
        ax.add_patch(Rectangle((t * w, y_tok), w, lane_h, facecolor=face, alpha=0.55 if b is not None else 0.9,
                               edgecolor=EDGE_COLOR, lw=0.4, gid="token" if b is not None else "pad_token"))
        if w >= 0.6:
            ax.text((t + 0.5) * w, y_tok + lane_h / 2, str(t), ha="center", va="center", fontsize=6)
    for b in range(num_reqs):
        if qsl[b + 1] > qsl[b]:
            ax.text((qsl[b] + qsl[b + 1]) / 2 * w, y_tok + lane_h + 0.08, names[b], ha="center", va="bottom",
                    fontsize=7, color=seq_color(b), fontweight="bold")
    if qsl[-1] < T:
        ax.text((qsl[-1] + T) / 2 * w, y_tok + lane_h + 0.08, "padding (PAD_SLOT_ID)", ha="center", va="bottom",
                fontsize=7, color=MUTED_COLOR)

    ax.text(-0.3, y_vllm + 0.55, "vLLM's", ha="right", va="bottom", fontsize=8, fontweight="bold")
    for g in range(num_groups):
        ax.text(-0.3, y_vllm - g * pitch + lane_h / 2, f"group {g}", ha="right", va="center", fontsize=7)
    for prog in vllm:
        y = y_vllm - prog.group * pitch
        g, b = prog.pid
        width = max(prog.stop - prog.start, 0.25) * w if prog.kind == "request" else (prog.stop - prog.start) * w
        if prog.kind == "request":
            face, alpha, hatch, gid = seq_color(b), 0.35, None, "vllm_program"
        else:
            face, alpha, hatch, gid = PADDING_COLOR, 0.9, "xx", "vllm_padding"
        ax.add_patch(Rectangle((prog.start * w, y), width, lane_h, facecolor=face, alpha=alpha, edgecolor=EDGE_COLOR,
                               lw=1.1, hatch=hatch, gid=gid))
        if width >= 1.4:
            ax.text(prog.start * w + width / 2, y + lane_h / 2, f"({g}, {b})", ha="center", va="center", fontsize=6.5,
                    bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
    ax.text(T * w + 0.3, y_vllm - (num_groups - 1) * pitch / 2 + lane_h / 2,
            f"grid ({num_groups}, {num_reqs} + 1):\n{len(vllm)} programs; the last\nof each group pads",
            ha="left", va="center", fontsize=7, gid="vllm_count")

    ax.text(-0.3, y_fast + lane_h + 0.15, "ours", ha="right", va="bottom", fontsize=8, fontweight="bold")
    span_h = (num_groups - 1) * pitch + lane_h
    for prog in fast:
        ax.add_patch(Rectangle((prog.start * w, y_fast - (num_groups - 1) * pitch), (prog.stop - prog.start) * w,
                               span_h, facecolor=seq_color(4), alpha=0.18, edgecolor=EDGE_COLOR, lw=1.1,
                               gid="fast_program"))
        if (prog.stop - prog.start) * w >= 1.2:
            ax.text((prog.start + prog.stop) / 2 * w, y_fast - (num_groups - 1) * pitch + span_h / 2,
                    f"program {prog.pid[0]}\nslots {prog.start}–{prog.stop - 1}\nevery group", ha="center",
                    va="center", fontsize=6.5)
    ax.text(T * w + 0.3, y_fast - (num_groups - 1) * pitch + span_h / 2,
            f"grid (cdiv({T}, {block_tokens}),):\n{len(fast)} programs; each finds\nits tokens' requests",
            ha="left", va="center", fontsize=7, gid="fast_count")
    ax.set_xlim(-2.8, T * w + 4.2)
    ax.set_ylim(y_fast - (num_groups - 1) * pitch - 0.3, y_tok + lane_h + 0.7)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"compute_slot_mappings: who writes which slot ({num_reqs} requests, {num_groups} groups, "
                 f"{T} slots)", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 5. Step times against the batch size
# --------------------------------------------------------------------------------------------

def draw_v2_step_times(batch_sizes: Sequence[int], times_us: dict[str, Sequence[float]], ax: Any = None,
                       title: str | None = None) -> Any:
    """Time per step (µs) against the number of requests in the batch, one line per
    implementation (v1's numpy step with its copies, v2 with vLLM's kernels, v2 with ours, ...). Both axes are
    logarithmic."""
    sizes = check_int_list("batch_sizes", batch_sizes, 1)
    series = times_series(times_us, len(sizes), "batch sizes")
    return plot_times(new_axes(ax, figsize=(6.5, 4.0)), sizes, series, "requests in the batch",
                      "time per step (µs, log scale)",
                      title if title is not None else "Block tables and slot mapping per step: v1 vs v2")
