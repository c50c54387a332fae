"""Drawing vLLM's classic CUDA paged-attention kernels: cache layout, threads, partitions, timings.

The arithmetic these pictures show (where an element of the v0 cache lives, which lane of v1
loads what, which tokens a v2 partition covers) lives with the kernels, in
:mod:`paged_attention.kernels.layout`; this module only draws it.
"""
from __future__ import annotations

from typing import Any, Sequence

from matplotlib.patches import Rectangle

from paged_attention.kernels.layout import (
    CHUNK_BYTES, WARP_SIZE, OnlineSoftmaxStep, ThreadMapping, V1Launch, online_softmax_steps, v0_key_offset,
    v0_value_offset, v1_launch, v1_thread_mapping, v2_merge_weights, v2_partitions,
)
from paged_attention.utils import cdiv, check_int, is_int
from paged_attention.viz.style import EDGE_COLOR, LANE_COLORS, MUTED_COLOR, new_axes, plot_times, seq_color, times_series

__all__ = [
    "draw_v0_key_layout", "draw_thread_mapping", "draw_v2_partitions", "draw_decode_times", "draw_decode_bandwidth",
    # the models drawn here, re-exported for the notebooks that import them with the drawings
    "ThreadMapping", "v0_key_offset", "v0_value_offset", "v1_thread_mapping", "v2_merge_weights", "v2_partitions",
    "OnlineSoftmaxStep", "online_softmax_steps", "V1Launch", "v1_launch",
]

# --------------------------------------------------------------------------------------------
# 1. The v0 cache layout
# --------------------------------------------------------------------------------------------

_MAX_CELLS = 512  # beyond this many elements per cache the labels cannot be read


def _cell(ax: Any, x: float, y: float, color: str, label: str, gid: str, alpha: float = 0.45,
          width: float = 1.0, fontsize: float = 7) -> None:
    """One element: a box of its token's colour, its dim index written inside."""
    ax.add_patch(Rectangle((x, y), width, 1, facecolor=color, alpha=alpha, edgecolor=EDGE_COLOR,
                           lw=0.4, gid=gid))
    ax.text(x + width / 2, y + 0.5, label, ha="center", va="center", fontsize=fontsize, gid=gid)


def _heading(ax: Any, y: float, text: str) -> None:
    ax.text(0, y, text, ha="left", va="bottom", fontsize=9, fontweight="bold")


def draw_v0_key_layout(head_size: int = 16, block_size: int = 4, x: int = 4, ax: Any = None) -> Any:
    """One KV head's keys and values of one block: logically, then in v0 key/value-cache memory order.

    Every element is a cell coloured by its token and labelled with its dim index. Top: the
    logical ``[block_size, head_size]`` keys, x-chunks marked. Middle: the key cache's memory
    order ``[head_size / x, block_size, x]``, one row per chunk ``c``: chunk ``c`` of every token
    of the block sits side by side, so a warp whose thread groups each read one token's chunk
    ``c`` reads one contiguous span (a coalesced load). Bottom: the value cache's memory order
    ``[head_size, block_size]``, tokens innermost. Both strips wrap every ``block_size * x``
    elements; the number left of a row is the memory offset of its first element.
    """
    head_size = check_int("head_size", head_size, 1)
    block_size = check_int("block_size", block_size, 1)
    x = check_int("x", x, 1)
    if head_size % x:
        raise ValueError(f"head_size ({head_size}) must be a multiple of x ({x})")
    if head_size * block_size > _MAX_CELLS:
        raise ValueError(f"head_size * block_size = {head_size * block_size} elements is too many "
                         f"to label (at most {_MAX_CELLS}); draw a smaller example")
    chunks, row = head_size // x, block_size * x
    width = max(head_size, row)
    # Heights, top to bottom: heading, logical grid, heading, key strip, heading, value strip.
    gap = 2.2
    y_logical = -gap - block_size
    y_key = y_logical - gap - chunks
    value_rows = cdiv(head_size * block_size, row)
    y_value = y_key - gap - value_rows
    ax = new_axes(ax, figsize=(1.8 + 0.34 * width, 0.5 + 0.3 * (-y_value + 1)))

    # Logical view: token t is row t, dim d is column d.
    _heading(ax, y_logical + block_size + 0.9,
             f"logical keys [block_size={block_size} tokens × head_size={head_size} dims], "
             f"in chunks of x={x}")
    for t in range(block_size):
        y = y_logical + block_size - 1 - t
        ax.text(-0.3, y + 0.5, f"token {t}", ha="right", va="center", fontsize=7, color=seq_color(t))
        for d in range(head_size):
            _cell(ax, d, y, seq_color(t), str(d), gid="logical")
    for c in range(chunks):
        ax.add_patch(Rectangle((c * x, y_logical), x, block_size, facecolor="none",
                               edgecolor=EDGE_COLOR, lw=1.6))
        ax.text(c * x + x / 2, y_logical + block_size + 0.1, f"chunk {c}", ha="center",
                va="bottom", fontsize=7)

    # Key cache: memory offset i = (c * block_size + t) * x + j holds dim c * x + j of token t.
    _heading(ax, y_key + chunks + 0.9,
             f"key cache in memory [head_size/x={chunks}, block_size={block_size}, x={x}]: "
             f"chunk c of all {block_size} tokens is one contiguous run")
    for c in range(chunks):
        y = y_key + chunks - 1 - c
        ax.text(-0.3, y + 0.5, f"+{c * row}", ha="right", va="center", fontsize=7, color=MUTED_COLOR)
        for t in range(block_size):
            for j in range(x):
                _cell(ax, t * x + j, y, seq_color(t), str(c * x + j), gid="key")
            ax.add_patch(Rectangle((t * x, y), x, 1, facecolor="none", edgecolor=EDGE_COLOR, lw=1.6))
        ax.text(row + 0.3, y + 0.5, f"chunk {c}: dims {c * x}–{c * x + x - 1} of tokens "
                f"0–{block_size - 1}", ha="left", va="center", fontsize=7)

    # Value cache: memory offset i = d * block_size + t.
    _heading(ax, y_value + value_rows + 0.9,
             f"value cache in memory [head_size={head_size}, block_size={block_size}]: "
             "tokens innermost")
    for r in range(value_rows):
        y = y_value + value_rows - 1 - r
        ax.text(-0.3, y + 0.5, f"+{r * row}", ha="right", va="center", fontsize=7, color=MUTED_COLOR)
        for i in range(r * row, min((r + 1) * row, head_size * block_size)):
            d, t = divmod(i, block_size)
            _cell(ax, i - r * row, y, seq_color(t), str(d), gid="value")

    ax.set_xlim(-3.2, max(width + 0.5, row + 11.5))  # room for the chunk labels right of the key rows
    ax.set_ylim(y_value - 0.5, 1.0)
    ax.axis("off")
    ax.set_title("vLLM v0 KV-cache layout of one block (numbers in cells: dim index; colour: token)",
                 fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 2. v1: threads, warps and blocks
# --------------------------------------------------------------------------------------------

def draw_thread_mapping(block_size: int = 16, head_size: int = 128, dtype_bytes: int = 2,
                        num_warps: int = 4, ax: Any = None) -> Any:
    """How paged_attention_v1 maps one (head, sequence) onto one CUDA block's threads.

    Top: the sequence's KV blocks in table order, coloured by the warp that takes them (warp
    ``w`` takes blocks ``w, w + num_warps, ...``). Middle: one warp on one KV block, its 32
    lanes cut into thread groups of ``THREAD_GROUP_SIZE`` lanes, one group per token. Bottom: one
    token's key, its x-chunks cut into ``VEC_SIZE``-element slices, coloured by the lane of the
    group that loads them. The numbers are listed on the right.
    """
    m = v1_thread_mapping(block_size, head_size, dtype_bytes, num_warps)
    tg = m.thread_group_size
    lane_colors = LANE_COLORS[:tg]
    ax = new_axes(ax, figsize=(13.0, 5.2))

    def highlight(x: float, y: float, w: float, h: float) -> None:
        """The thick outline that marks what the next row zooms into."""
        ax.add_patch(Rectangle((x - 0.08, y - 0.08), w + 0.16, h + 0.16, facecolor="none",
                               edgecolor="black", lw=2.2))

    # Top: the sequence's KV blocks, round-robin over the warps.
    shown = 2 * m.num_warps + 1
    box, pitch, y_top = 3.0, 3.5, 7.6
    ax.text(0, y_top + 1.35, f"one CUDA block = {m.num_threads} threads = {m.num_warps} warps per "
            "(head, sequence[, partition]); warp w takes KV blocks w, w + "
            f"{m.num_warps}, ...", fontsize=9, fontweight="bold", va="bottom")
    for j in range(shown):
        w = j % m.num_warps
        ax.add_patch(Rectangle((j * pitch, y_top), box, 1.1, facecolor=seq_color(w), alpha=0.5,
                               edgecolor=EDGE_COLOR, lw=0.8, gid="kv_block"))
        ax.text(j * pitch + box / 2, y_top + 0.55, f"block {j}\nwarp {w}", ha="center",
                va="center", fontsize=7, gid="kv_block")
    ax.text(shown * pitch, y_top + 0.55, "…", fontsize=12, va="center")
    highlight(0, y_top, box, 1.1)

    # Middle: warp 0's lanes on block 0, in thread groups.
    y_mid = 4.2
    ax.text(0, y_mid + 1.35, f"warp 0 on block 0: {WARP_SIZE} lanes, {m.groups_per_warp} thread "
            f"groups of {tg}; group g owns token g of the block", fontsize=9, fontweight="bold",
            va="bottom")
    for lane in range(WARP_SIZE):
        ax.add_patch(Rectangle((lane, y_mid), 1, 0.9, facecolor=lane_colors[lane % tg],
                               alpha=0.6, edgecolor=EDGE_COLOR, lw=0.4, gid="lane"))
        ax.text(lane + 0.5, y_mid + 0.45, str(lane), ha="center", va="center", fontsize=6)
    for g in range(m.groups_per_warp):
        ax.add_patch(Rectangle((g * tg, y_mid), tg, 0.9, facecolor="none", edgecolor=EDGE_COLOR,
                               lw=1.5, gid="thread_group"))
        ax.text(g * tg + tg / 2, y_mid - 0.1, f"t{g}", ha="center", va="top", fontsize=6,
                color=MUTED_COLOR, gid="thread_group")
    highlight(0, y_mid, tg, 0.9)

    # Bottom: token 0's key, chunk by chunk, slice by slice.
    y_low, chunks = 0.6, head_size // m.x
    chunk_w = WARP_SIZE / chunks
    slice_w = chunk_w / tg
    ax.text(0, y_low + 1.35, f"token 0's key: {chunks} chunks of x={m.x}; lane l of its group "
            f"loads elements [{m.vec_size}·l, {m.vec_size}·(l+1)) of every chunk",
            fontsize=9, fontweight="bold", va="bottom")
    for c in range(chunks):
        for place in range(tg):
            ax.add_patch(Rectangle((c * chunk_w + place * slice_w, y_low), slice_w, 0.9,
                                   facecolor=lane_colors[place], alpha=0.6, edgecolor=EDGE_COLOR,
                                   lw=0.3, gid="slice"))
            if slice_w >= 0.9:
                ax.text(c * chunk_w + (place + 0.5) * slice_w, y_low + 0.45, f"L{place}",
                        ha="center", va="center", fontsize=5.5)
        ax.add_patch(Rectangle((c * chunk_w, y_low), chunk_w, 0.9, facecolor="none",
                               edgecolor=EDGE_COLOR, lw=1.3))
        if chunk_w >= 0.9:
            ax.text(c * chunk_w + chunk_w / 2, y_low - 0.1, f"c{c}", ha="center", va="top",
                    fontsize=6, color=MUTED_COLOR)

    # The numbers.
    lines = [
        f"x = 16 B / {dtype_bytes} B = {m.x}",
        f"THREAD_GROUP_SIZE = max(32 // {block_size}, 1) = {tg}",
        f"VEC_SIZE = x // THREAD_GROUP_SIZE = {m.vec_size}",
        f"loads per lane per key = {m.vecs_per_lane}",
        f"tokens per warp at once = {m.groups_per_warp}",
        f"one warp-wide load = chunk c of {m.groups_per_warp} tokens",
        f"  = {m.groups_per_warp * CHUNK_BYTES} contiguous bytes",
        f"q·k: {tg} partial sums per token,",
        "  added with warp shuffles" if tg > 1 else "  none to add (one lane per token)",
    ]
    for i, line in enumerate(lines):
        ax.text(WARP_SIZE + 2.0, y_top + 0.9 - i * 0.85, line, fontsize=8, va="center",
                family="monospace", gid="numbers")

    ax.set_xlim(-0.5, WARP_SIZE + 16.5)
    ax.set_ylim(-0.4, y_top + 2.2)
    ax.axis("off")
    ax.set_title(f"paged_attention_v1: block_size={block_size}, head_size={head_size}, "
                 f"{dtype_bytes}-byte elements", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 3. v2: partitions and their merge
# --------------------------------------------------------------------------------------------

def draw_v2_partitions(seq_len: int = 1400, partition_size: int = 512, block_size: int = 16,
                       ax: Any = None) -> Any:
    """A sequence cut into v2's partitions, each reduced to ``(m_p, s_p, o_p)``, then merged.

    Each partition is a bar over its tokens with the KV-block boundaries ticked; the unused
    rest of the last partition is drawn empty. Under each, the CUDA block ``(h, s, p)`` that
    computes its maximum logit ``m_p``, exp-sum ``s_p`` and locally normalised output ``o_p``;
    at the bottom, the reduce kernel's formula.
    """
    seq_len = check_int("seq_len", seq_len, 1)
    partition_size = check_int("partition_size", partition_size, 1)
    block_size = check_int("block_size", block_size, 1)
    if partition_size % block_size:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of block_size "
                         f"({block_size}): a partition is a whole number of KV blocks")
    parts = v2_partitions(seq_len, partition_size)
    if len(parts) > 12:
        raise ValueError(f"{len(parts)} partitions are too many to draw (at most 12); "
                         "use a shorter seq_len or a larger partition_size")
    span = 6.0                           # drawing units per partition
    unit = span / partition_size         # per token
    gap = 0.6
    ax = new_axes(ax, figsize=(max(7.0, 1.2 + 2.9 * len(parts)), 4.2))

    y_bar, y_box, y_reduce = 3.0, 1.1, -1.3
    centres = []
    for p, tokens in enumerate(parts):
        x0 = p * (span + gap)
        filled = len(tokens) * unit
        centres.append(x0 + span / 2)
        ax.add_patch(Rectangle((x0, y_bar), filled, 0.8, facecolor=seq_color(p), alpha=0.55,
                               edgecolor="none", gid="partition"))
        if len(tokens) < partition_size:
            ax.add_patch(Rectangle((x0 + filled, y_bar), span - filled, 0.8, facecolor="none",
                                   edgecolor=MUTED_COLOR, hatch="///", lw=0.5))
        ax.add_patch(Rectangle((x0, y_bar), span, 0.8, facecolor="none", edgecolor=EDGE_COLOR, lw=1.0))
        if partition_size // block_size <= 64:  # KV-block boundaries, while they can be told apart
            for b in range(1, cdiv(len(tokens), block_size)):
                xb = x0 + b * block_size * unit
                ax.plot([xb, xb], [y_bar, y_bar + 0.8], color=EDGE_COLOR, lw=0.3, alpha=0.6)
        blocks = cdiv(len(tokens), block_size)
        ax.text(x0 + span / 2, y_bar + 0.95, f"partition {p}\ntokens {tokens.start}–{tokens.stop - 1} "
                f"({blocks} blocks)", ha="center", va="bottom", fontsize=8, gid="partition_label")
        ax.add_patch(Rectangle((x0 + 0.4, y_box), span - 0.8, 1.1, facecolor="white",
                               edgecolor=seq_color(p), lw=1.4))
        ax.text(x0 + span / 2, y_box + 0.55, f"CUDA block (h, s, {p})\nm_{p}, s_{p}, o_{p}",
                ha="center", va="center", fontsize=8)
        ax.annotate("", xy=(x0 + span / 2, y_box + 1.1), xytext=(x0 + span / 2, y_bar),
                    arrowprops=dict(arrowstyle="-|>", color=seq_color(p), lw=1.0))

    total = len(parts) * span + (len(parts) - 1) * gap
    if len(parts) > 1:
        formula = ("reduce kernel, CUDA block (h, s):  M = max_p m_p,   w_p = s_p · exp(m_p − M),\n"
                   "out = Σ_p w_p · o_p / (Σ_p w_p + 1e-6)")
    else:
        formula = "one partition: the reduce kernel copies o_0 to out"
    ax.text(total / 2, y_reduce, formula, ha="center", va="center", fontsize=9,
            bbox=dict(boxstyle="round,pad=0.4", facecolor="#F4F4F4", edgecolor=EDGE_COLOR))
    for c in centres:
        ax.annotate("", xy=(total / 2, y_reduce + 0.55), xytext=(c, y_box),
                    arrowprops=dict(arrowstyle="-|>", color=MUTED_COLOR, lw=0.9))

    ax.set_xlim(-0.3, total + 0.3)
    ax.set_ylim(y_reduce - 0.9, y_bar + 2.1)
    ax.axis("off")
    ax.set_title(f"paged_attention_v2: {seq_len} tokens in {len(parts)} partitions of "
                 f"{partition_size} (block_size={block_size})", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 4. Timings
# --------------------------------------------------------------------------------------------

def draw_decode_times(contexts: Sequence[int], times_us: dict[str, Sequence[float | None]],
                      ax: Any = None, title: str | None = None) -> Any:
    """Decode time (µs) against context length, one line per implementation.

    ``times_us`` maps an implementation's name (e.g. ``"CUDA v1"``, ``"Triton"``) to one time
    per context; ``None`` or NaN leaves a gap (a kernel that cannot run that context). Both
    axes are logarithmic: the x axis in powers of two, the y axis because times span decades.
    """
    contexts = _checked_contexts(contexts)
    series = times_series(times_us, len(contexts), "contexts", allow_gaps=True)

    ax = plot_times(new_axes(ax, figsize=(7.0, 4.0)), contexts, series, "context length (tokens)",
                    "decode time (µs, log scale)",
                    title if title is not None else "Decode attention time against context length")
    _bring_forward(ax, "Triton")
    return ax


def _bring_forward(ax: Any, name: str) -> None:
    """Draw ``name``'s line over the others, thicker, so that lines close to it cannot hide it."""
    for line in ax.lines:
        if line.get_label() == name:
            line.set_zorder(5)
            line.set_linewidth(2.6)


def draw_decode_bandwidth(contexts: Sequence[int], times_us: dict[str, Sequence[float | None]],
                          kv_bytes: Sequence[int], copy_bytes_per_s: float, ax: Any = None,
                          title: str | None = None) -> Any:
    """The same timings as KV-cache read rate (TB/s: ``kv_bytes[i]`` over the time), against the
    context, with the device-to-device copy rate measured in the same run as the ceiling: a decode
    step reads every cached key and value once, so that is how close a kernel gets to the
    memory's speed. Triton's line is drawn on top."""
    contexts = _checked_contexts(contexts)
    if len(kv_bytes) != len(contexts) or not all(is_int(b) and b > 0 for b in kv_bytes):
        raise ValueError(f"kv_bytes must hold one positive int per context, got {kv_bytes!r}")
    if not isinstance(copy_bytes_per_s, (int, float)) or not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s must be a positive number, got {copy_bytes_per_s!r}")
    series = times_series(times_us, len(contexts), "contexts", allow_gaps=True)
    # TB/s: bytes over seconds; a gap (NaN) stays a gap.
    rates = {name: [b / (t * 1e-6) / 1e12 for b, t in zip(kv_bytes, times)] for name, times in series.items()}
    ax = plot_times(new_axes(ax, figsize=(7.0, 4.0)), contexts, rates, "context length (tokens)",
                    "KV cache read (TB/s)",
                    title if title is not None else "KV-cache read rate against context length", log_y=False)
    ax.axhline(copy_bytes_per_s / 1e12, color=MUTED_COLOR, ls="--", lw=1.2,
               label=f"device copy, read + write ({copy_bytes_per_s / 1e12:.2f} TB/s)")
    _bring_forward(ax, "Triton")
    ax.set_ylim(0, copy_bytes_per_s / 1e12 * 1.15)
    ax.legend(fontsize=7, frameon=False, loc="lower right")
    return ax


def _checked_contexts(contexts: Any) -> list[int]:
    """Context lengths as a list of positive ints (a tensor or array is accepted)."""
    if hasattr(contexts, "tolist"):
        contexts = contexts.tolist()
    contexts = list(contexts)
    if not contexts or not all(is_int(c) and c > 0 for c in contexts):
        raise ValueError(f"contexts must be a non-empty list of positive ints, got {contexts!r}")
    return contexts
