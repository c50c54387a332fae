"""The whole picture: the pieces of paged KV-cache serving, the data between them, and which
piece each vLLM generation (or this project's engine) implements where (host or GPU).

``PIPELINE`` names the pieces in the order a step runs them and what each hands to the next;
the cache write and attention run inside every layer of the model, and the sampler's tokens go
back to the scheduler for the next step. ``GENERATIONS`` says, for v0 (the legacy engine), v1 and
v1's model runner v2, which class or kernel does each piece, on the host or on the GPU, and which
notebook shows it; ``engine_row`` says the same of this project's engine (notebook 08) on this
machine.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from paged_attention.viz.style import EDGE_COLOR, new_axes


class Piece(NamedTuple):
    name: str
    hands_on: str        # what this piece gives the next one (the sampler's goes back to the scheduler)


class Part(NamedTuple):
    what: str            # the class or kernel
    where: str           # "host" or "GPU"
    notebook: str        # the notebook that shows it ("" if none)


PIPELINE: tuple[Piece, ...] = (
    Piece("scheduler", "who runs,\nhow many tokens"),
    Piece("block manager", "block ids\nper request"),
    Piece("block table", "rows in\nbatch order"),
    Piece("slot mapping", "one slot per\nnew token"),
    Piece("cache write", "K, V in\ntheir pages"),
    Piece("attention", "an output per\nnew token"),
    Piece("model", "logits of each\nrequest's last token"),
    Piece("sampler", "one new token per request, to the scheduler's next step"),
)
# The pieces every layer of the model runs (its projections and MLP around them: "model").
IN_EVERY_LAYER = ("cache write", "attention")

GENERATIONS: dict[str, tuple[Part, ...]] = {
    "v0 (legacy, to 0.10)": (
        Part("Scheduler", "host", "02"), Part("SelfAttnBlock-\nSpaceManager", "host", "01, 02"),
        Part("Python lists\nper sequence", "host", "01"), Part("Python loop\n(model runner)", "host", "00"),
        Part("reshape_and_cache", "GPU", "06"), Part("paged_attention\nv1 / v2 (CUDA)", "GPU", "06"),
        Part("the model's\nlayers", "GPU", "08"), Part("Sampler", "GPU", "08")),
    "v1": (
        Part("Scheduler", "host", ""), Part("KVCacheManager\n+ BlockPool", "host", "05"),
        Part("BlockTable\n(numpy rows)", "host", "03"), Part("numpy\n(BlockTable)", "host", "03"),
        Part("reshape_and_\ncache_flash", "GPU", "00"), Part("FA3, FlashInfer\nor Triton", "GPU", "00, 06"),
        Part("the model's\nlayers", "GPU", "08"), Part("Sampler", "GPU", "08")),
    "v1, model runner v2": (
        Part("Scheduler", "host", ""), Part("KVCacheManager\n+ BlockPool", "host", "05"),
        Part("BlockTables\n(rows on the GPU)", "GPU", "04"), Part("Triton kernel", "GPU", "04"),
        Part("reshape_and_\ncache_flash", "GPU", "00"), Part("FA3, FlashInfer\nor Triton", "GPU", "00, 06"),
        Part("the model's\nlayers", "GPU", "08"), Part("Sampler", "GPU", "08")),
}

WHERE_COLORS = {"host": "#F2CF5B", "GPU": "#8CB8E0"}
BOUNDARY_COLOR = "#C0392B"

# Sizes, in data units: a column is a box and the gap after it.
_W, _GAP, _ROW, _H_TOP, _H_PART = 1.7, 0.45, 1.0, 0.55, 0.8
_STEP = _W + _GAP
_LABEL_ROOM = 2.9          # left of column 0, for the rows' names


def engine_row(device_type: str = "cuda", core: str = "v1") -> dict[str, tuple[Part, ...]]:
    """This project's engine (``paged_attention.engine``, notebook 08) as one row of the picture,
    for a machine of ``device_type`` ``"cuda"`` or ``"cpu"`` and the engine's ``core``: ``"v1"``
    (the default: V1's scheduler over its KV-cache manager) or ``"v0"`` (the legacy scheduler and
    block manager). On a GPU its tables and kernels are model runner v2's and Triton's; on a CPU
    everything runs on the host, with v1's numpy tables and the plain-torch kernels."""
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if core not in ("v1", "v0"):
        raise ValueError(f"core must be 'v1' or 'v0', got {core!r}")
    gpu = device_type == "cuda"
    where = "GPU" if gpu else "host"
    if core == "v1":
        cores = (Part("Scheduler\n(V1)", "host", "07"), Part("KVCacheManager\n+ BlockPool", "host", "07"))
    else:
        cores = (Part("FcfsScheduler\n(legacy)", "host", "02"), Part("SelfAttnBlock-\nSpaceManager", "host", "01, 02"))
    parts = cores + (
        Part("V2StepTables\n(BlockTables)", "GPU", "04") if gpu else Part("V1StepTables\n(BlockTable)", "host", "03"),
        Part("Triton kernel", "GPU", "04") if gpu else Part("numpy", "host", "03"),
        Part("fused rotary\n+ cache write" if gpu else "reshape_and_\ncache_flash", where, "00"),
        Part("Triton decode\nand prefill" if gpu else "plain torch\n(the reference)", where, "06"),
        Part("LlamaForCausalLM", where, "08"),
        Part("argmax or\nsample_tensor", where, "08"),
    )
    return {f"this project's engine, core {core!r}\n(notebook 08), {'GPU' if gpu else 'CPU'}": parts}


def _x(column: int) -> float:
    return column * _STEP


def draw_pipeline(generations: Mapping[str, tuple[Part, ...]] | None = None, ax: Any = None,
                  notes: Mapping[str, str] | None = None, title: str | None = None) -> Any:
    """Top: the pieces of one step, left to right, with what each hands to the next; a bracket
    marks the pieces that run inside every layer of the model, and an arrow takes the sampler's
    tokens back to the scheduler. Below, one row per entry of ``generations`` (default:
    ``GENERATIONS``): what does each piece, coloured by where it runs (host or GPU), with the
    notebook that shows it, and a red line where the host hands over to the GPU.

    ``notes`` (piece name -> a short text) are written under the last row, in that piece's
    column: a worked example's own numbers, say.
    """
    rows = dict(GENERATIONS if generations is None else generations)
    if not rows:
        raise ValueError("generations must name at least one row")
    names = [p.name for p in PIPELINE]
    for name, parts in rows.items():
        if len(parts) != len(PIPELINE) or not all(isinstance(p, Part) for p in parts):
            raise ValueError(f"row {name!r} must give one Part per piece ({len(PIPELINE)}), got {len(parts)}")
        bad = [p.where for p in parts if p.where not in WHERE_COLORS]
        if bad:
            raise ValueError(f"row {name!r}: where must be 'host' or 'GPU', got {bad[0]!r}")
    notes = dict(notes or {})
    unknown = [k for k in notes if k not in names]
    if unknown:
        raise ValueError(f"notes for unknown piece {unknown[0]!r}; the pieces are {', '.join(names)}")

    n = len(PIPELINE)
    note_lines = max([s.count("\n") + 1 for s in notes.values()] + [0])
    bottom = -0.9 - 0.22 * note_lines
    top = len(rows) * _ROW + 0.55
    made = ax is None
    ax = new_axes(ax, (15.0, 2.6 + 0.75 * len(rows) + 0.18 * note_lines))
    if made:                 # the whole width for the boxes: their labels must fit inside them
        ax.figure.subplots_adjust(left=0.01, right=0.99, top=0.9, bottom=0.04)

    # The pieces, with what each hands on.
    for i, piece in enumerate(PIPELINE):
        x = _x(i)
        ax.add_patch(_box(x, top, _W, _H_TOP, "white", lw=1.4, gid="piece"))
        ax.text(x + _W / 2, top + _H_TOP / 2, piece.name, ha="center", va="center", fontsize=9,
                fontweight="bold", gid="piece")
        if i + 1 < n:
            ax.annotate("", xy=(x + _STEP, top + _H_TOP / 2), xytext=(x + _W, top + _H_TOP / 2),
                        arrowprops=dict(arrowstyle="->", color=EDGE_COLOR))
            ax.text(x + _W + _GAP / 2, top + _H_TOP + 0.08, piece.hands_on, ha="center", va="bottom",
                    fontsize=7, color=EDGE_COLOR, gid="hands_on")
    # Every layer of the model runs the cache write and attention: a bracket over them.
    first, last = names.index(IN_EVERY_LAYER[0]), names.index(IN_EVERY_LAYER[-1])
    x0, x1, yb = _x(first) - 0.1, _x(last) + _W + 0.1, top - 0.12
    ax.plot([x0, x0, x1, x1], [yb + 0.05, yb, yb, yb + 0.05], color=EDGE_COLOR, lw=1.0)
    # The sampler's tokens go back to the scheduler: an arrow over the top row.
    y_back = top + _H_TOP + 0.75
    sx = _x(n - 1) + _W / 2
    ax.plot([sx, sx, _W / 2], [top + _H_TOP, y_back, y_back], color=EDGE_COLOR, lw=1.0)
    ax.annotate("", xy=(_W / 2, top + _H_TOP), xytext=(_W / 2, y_back),
                arrowprops=dict(arrowstyle="->", color=EDGE_COLOR))
    ax.text((sx + _W / 2) / 2, y_back + 0.06, PIPELINE[-1].hands_on, ha="center", va="bottom", fontsize=7.5,
            color=EDGE_COLOR, gid="hands_on")
    ax.text((x0 + x1) / 2, yb - 0.04, "inside every layer of the model", ha="center", va="top", fontsize=7,
            color=EDGE_COLOR, style="italic", gid="layer_note")

    # One row per generation (or engine).
    for r, (name, parts) in enumerate(rows.items()):
        y = top - _ROW * (r + 1) - 0.2
        ax.text(-0.25, y + _H_PART / 2, name, ha="right", va="center", fontsize=8.5, fontweight="bold",
                linespacing=1.1, gid="row")
        for i, part in enumerate(parts):
            x = _x(i)
            ax.add_patch(_box(x - 0.1, y, _W + 0.2, _H_PART, WHERE_COLORS[part.where], gid="part"))
            ax.text(x + _W / 2, y + _H_PART * 0.58, part.what, ha="center", va="center", fontsize=7.5,
                    linespacing=1.0, gid="part")
            if part.notebook:
                ax.text(x + _W / 2, y + 0.13, f"notebook {part.notebook}", ha="center", va="center", fontsize=6.5,
                        color="#333333", gid="part")
        # The host -> GPU boundary of this row: before its first GPU piece (none: all on the host).
        first_gpu = next((i for i, p in enumerate(parts) if p.where == "GPU"), None)
        if first_gpu is not None:
            bx = _x(first_gpu) - _GAP / 2
            ax.plot([bx, bx], [y - 0.05, y + _H_PART + 0.05], color=BOUNDARY_COLOR, lw=2)
    y_last = top - _ROW * len(rows) - 0.2
    for name, text in notes.items():
        i = names.index(name)
        ax.text(_x(i) + _W / 2, y_last - 0.1, text, ha="center", va="top", fontsize=7, color="#1F4E79",
                linespacing=1.1, gid="note")

    for k, (where, color) in enumerate(WHERE_COLORS.items()):
        ax.add_patch(_box(k * 2.4, bottom + 0.05, 0.3, 0.25, color))
        ax.text(k * 2.4 + 0.4, bottom + 0.18, f"runs on the {where}", va="center", fontsize=8)
    ax.plot([4.8, 5.1], [bottom + 0.18, bottom + 0.18], color=BOUNDARY_COLOR, lw=2)
    ax.text(5.2, bottom + 0.18, "where the host hands over to the GPU", va="center", fontsize=8)
    ax.text(_x(n - 1) + _W, bottom + 0.18, "notebook 08 runs every piece with a real model", ha="right",
            va="center", fontsize=8, style="italic")
    ax.set_xlim(-_LABEL_ROOM, _x(n - 1) + _W + 0.2)
    ax.set_ylim(bottom - 0.1, y_back + 0.45)
    ax.set_axis_off()
    ax.set_title(title if title is not None else
                 "One serving step: the pieces, what they pass on, and who does each in vLLM's generations",
                 fontsize=10)
    return ax


def _box(x: float, y: float, w: float, h: float, color: str, lw: float = 0.8, gid: str | None = None) -> Any:
    from matplotlib.patches import FancyBboxPatch
    return FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.06", facecolor=color,
                          edgecolor=EDGE_COLOR, lw=lw, gid=gid)
