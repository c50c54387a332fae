"""The whole picture: the pieces of paged KV-cache serving, the data between them, and which
piece each vLLM generation implements where (host or GPU).

``PIPELINE`` names the pieces in the order a step runs them and what each hands to the next;
``GENERATIONS`` says, for v0 (the legacy engine), v1 and v1's model runner v2, which class or
kernel does each piece, on the host or on the GPU, and which notebook shows it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes


class Piece(NamedTuple):
    name: str
    hands_on: str        # what this piece gives the next one ("" for the last)


class Part(NamedTuple):
    what: str            # the class or kernel
    where: str           # "host" or "GPU"
    notebook: str        # the notebook that shows it ("" if none)


PIPELINE: tuple[Piece, ...] = (
    Piece("scheduler", "who runs,\nhow many tokens"),
    Piece("block manager", "block ids\nper request"),
    Piece("block table", "rows in\nbatch order"),
    Piece("slot mapping", "one slot\nper new token"),
    Piece("cache write", "K, V in\ntheir pages"),
    Piece("attention", ""),
)

GENERATIONS: dict[str, tuple[Part, ...]] = {
    "v0 (legacy, to 0.10)": (
        Part("Scheduler", "host", "02"), Part("SelfAttnBlock-\nSpaceManager", "host", "01, 02"),
        Part("Python lists\nper sequence", "host", "01"), Part("Python loop\n(model runner)", "host", "00"),
        Part("reshape_and_cache", "GPU", "06"), Part("paged_attention\nv1 / v2 (CUDA)", "GPU", "06")),
    "v1": (
        Part("Scheduler", "host", ""), Part("KVCacheManager\n+ BlockPool", "host", "05"),
        Part("BlockTable\n(numpy rows)", "host", "03"), Part("numpy\n(BlockTable)", "host", "03"),
        Part("reshape_and_\ncache_flash", "GPU", "00"), Part("FA3, FlashInfer\nor Triton", "GPU", "00, 06")),
    "v1, model runner v2": (
        Part("Scheduler", "host", ""), Part("KVCacheManager\n+ BlockPool", "host", "05"),
        Part("BlockTables\n(rows on the GPU)", "GPU", "04"), Part("Triton kernel", "GPU", "04"),
        Part("reshape_and_\ncache_flash", "GPU", "00"), Part("FA3, FlashInfer\nor Triton", "GPU", "00, 06")),
}

WHERE_COLORS = {"host": "#F2CF5B", "GPU": "#8CB8E0"}


def draw_pipeline(ax: Any = None) -> Any:
    """Top: the pieces of one step, left to right, with what each hands to the next. Below, one
    row per generation: what does each piece, coloured by where it runs (host or GPU), with the
    notebook that shows it. The host-to-GPU boundary moves left from v0 to model runner v2."""
    ax = new_axes(ax, (12.5, 4.4))
    n, w, h, gap = len(PIPELINE), 1.5, 0.55, 0.55
    step = w + gap
    top = len(GENERATIONS) * 0.8 + 0.5
    for i, piece in enumerate(PIPELINE):
        x = i * step
        ax.add_patch(_box(x, top, w, h, "white", lw=1.4))
        ax.text(x + w / 2, top + h / 2, piece.name, ha="center", va="center", fontsize=9.5, fontweight="bold")
        if piece.hands_on:
            ax.annotate("", xy=(x + step, top + h / 2), xytext=(x + w, top + h / 2),
                        arrowprops=dict(arrowstyle="->", color=EDGE_COLOR))
            ax.text(x + w + gap / 2, top + h + 0.08, piece.hands_on, ha="center", va="bottom", fontsize=7,
                    color=EDGE_COLOR)
    for r, (generation, parts) in enumerate(GENERATIONS.items()):
        y = top - 0.8 * (r + 1)
        ax.text(-0.15, y + 0.3, generation, ha="right", va="center", fontsize=9, fontweight="bold")
        for i, part in enumerate(parts):
            x = i * step
            ax.add_patch(_box(x - 0.12, y, w + 0.24, 0.6, WHERE_COLORS[part.where]))
            ax.text(x + w / 2, y + 0.36, part.what, ha="center", va="center", fontsize=7.5, linespacing=1.0)
            if part.notebook:
                ax.text(x + w / 2, y + 0.08, f"notebook {part.notebook}", ha="center", va="center", fontsize=6.5,
                        color=MUTED_COLOR)
        # The host -> GPU boundary of this generation: before its first GPU piece.
        first_gpu = next(i for i, p in enumerate(parts) if p.where == "GPU")
        bx = first_gpu * step - gap / 2
        ax.plot([bx, bx], [y - 0.05, y + 0.65], color="#C0392B", lw=2)
    for k, (where, color) in enumerate(WHERE_COLORS.items()):
        ax.add_patch(_box(k * 2.2, -0.55, 0.3, 0.25, color))
        ax.text(k * 2.2 + 0.4, -0.42, f"runs on the {where}", va="center", fontsize=8)
    ax.plot([4.4, 4.7], [-0.42, -0.42], color="#C0392B", lw=2)
    ax.text(4.8, -0.42, "where the host hands over to the GPU", va="center", fontsize=8)
    ax.set_xlim(-2.3, n * step)
    ax.set_ylim(-0.7, top + h + 0.6)
    ax.set_axis_off()
    ax.set_title("One serving step: the pieces, what they pass on, and who does each in vLLM's generations",
                 fontsize=10)
    return ax


def _box(x: float, y: float, w: float, h: float, color: str, lw: float = 0.8) -> Any:
    from matplotlib.patches import FancyBboxPatch
    return FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", facecolor=color,
                          edgecolor=EDGE_COLOR, lw=lw)
