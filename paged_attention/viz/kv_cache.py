"""Drawings of notebook 05: from raw KV-cache bytes to per-layer views (``vllm/v1/worker/gpu_model_runner.py``).

* ``kv_pages`` / ``draw_raw_to_views``: where each (K or V, block) page of a layer's view lies
  in its raw int8 buffer, read from the view's own strides;
* ``draw_element_order``: the memory order of the elements of one block's K page under the NHD
  and HND layouts (``kv_cache.attn_utils.element_order``, computed by the library's reshape);
* ``draw_shared_tensors``: which layers use which raw buffer (hybrid models, KV sharing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from paged_attention.kv_cache.attn_utils import element_order
from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, seq_color

K_COLOR, V_COLOR = "#4C78A8", "#F58518"


@dataclass(frozen=True)
class KVPage:
    """One page of a layer's view: ``kv`` 0 (K) or 1 (V) of ``block``, at ``start`` bytes into
    the raw buffer, ``nbytes`` long."""
    kv: int
    block: int
    start: int
    nbytes: int


def kv_dim_of(backend: Any) -> int:
    """The logical dimension that separates K from V: 0 for FlashAttention's
    ``(2, num_blocks, ...)``, 1 for FlashInfer's and Triton's ``(num_blocks, 2, ...)``."""
    return 0 if backend.get_name() == "FLASH_ATTN" else 1


def kv_pages(view: torch.Tensor, raw: torch.Tensor, kv_dim: int) -> list[KVPage]:
    """Every (kv, block) page of ``view``, a 5-d view of ``raw``'s bytes, sorted by where it
    starts in ``raw``. A page is the ``[block_size, num_kv_heads, head_size]`` slab of one K or
    V of one block; its start comes from the view's strides, not from any assumption."""
    if view.dim() != 5 or kv_dim not in (0, 1):
        raise ValueError(f"expected a 5-d KV-cache view and kv_dim 0 or 1, got {view.dim()}-d, "
                         f"kv_dim {kv_dim!r}")
    base = raw.data_ptr()
    item = view.element_size()
    num_blocks = view.size(1 - kv_dim)
    pages = []
    for kv in range(2):
        for b in range(num_blocks):
            page = view.select(kv_dim, kv).select(0, b)
            pages.append(KVPage(kv, b, page.data_ptr() - base, page.numel() * item))
    return sorted(pages, key=lambda p: p.start)


def draw_raw_to_views(raw: torch.Tensor, views: dict[str, torch.Tensor], kv_dims: dict[str, int],
                      ax: Any = None, title: str | None = None) -> Any:
    """The raw int8 buffer as one bar of bytes, and under it each named view's K and V pages
    at the bytes they cover (K blue, V orange, ``K3`` = K page of block 3), with the view's
    logical shape and its strides in elements."""
    ax = new_axes(ax, (13, 1.2 + 1.0 * len(views)))
    total = raw.numel()
    ax.add_patch(_rect(0, 0, total, "#DDDDDD"))
    ax.text(total / 2, 0.4, f"raw int8 buffer: {total:,} bytes", ha="center", va="center", fontsize=9)
    for row, (name, view) in enumerate(views.items(), start=1):
        y = -1.1 * row
        for p in kv_pages(view, raw, kv_dims[name]):
            ax.add_patch(_rect(p.start, y, p.nbytes, K_COLOR if p.kv == 0 else V_COLOR))
            ax.text(p.start + p.nbytes / 2, y + 0.4, f"{'KV'[p.kv]}{p.block}", ha="center",
                    va="center", fontsize=8, color="white")
        ax.text(0, y - 0.15, f"{name}: {str(view.dtype).replace('torch.', '')} shape "
                f"{tuple(view.shape)}, strides {tuple(view.stride())}", fontsize=8, va="top")
    ax.set_xlim(-total * 0.01, total * 1.01)
    ax.set_ylim(-1.1 * len(views) - 0.5, 1.0)
    ax.set_yticks([])
    ax.set_xlabel("byte offset in the raw buffer")
    ax.set_title(title or "one raw buffer, viewed as a layer's KV cache", fontsize=10)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    return ax


def draw_element_order(block_size: int, num_kv_heads: int, head_size: int, layout: str,
                       ax: Any = None) -> Any:
    """One block's K page as a grid (a row per token, a column per (head, dim)), each cell
    labelled with its position in memory and shaded by it: NHD runs along the rows, HND down
    each head's columns."""
    order = element_order(block_size, num_kv_heads, head_size, layout)
    grid = order.reshape(block_size, num_kv_heads * head_size)
    ax = new_axes(ax, (0.5 * grid.shape[1] + 1, 0.45 * block_size + 1))
    ax.imshow(grid, cmap="Blues", vmin=-grid.max() * 0.3, vmax=grid.max() * 1.1, aspect="auto")
    for t in range(grid.shape[0]):
        for c in range(grid.shape[1]):
            ax.text(c, t, str(grid[t, c]), ha="center", va="center", fontsize=7)
    for h in range(1, num_kv_heads):
        ax.axvline(h * head_size - 0.5, color=EDGE_COLOR, lw=2)
    ax.set_xticks(range(grid.shape[1]))
    ax.set_xticklabels([f"h{h}\nd{d}" for h in range(num_kv_heads) for d in range(head_size)],
                       fontsize=7)
    ax.set_yticks(range(block_size))
    ax.set_yticklabels([f"token {t}" for t in range(block_size)], fontsize=7)
    ax.set_title(f"{layout}: element order in one block's K page", fontsize=10)
    return ax


def draw_shared_tensors(kv_cache_config: Any, shared_kv_cache_layers: dict[str, str] | None = None,
                        ax: Any = None) -> Any:
    """Each ``KVCacheTensor`` as one buffer (a bar cut into its blocks) with, stacked over it, a
    band for every layer that views it, spanning the whole buffer: the layers do not split the
    buffer, each sees all of it (a block id is given to one group at a time). Bands are coloured
    by the layer's KV-cache group; a layer that reuses another layer's cache (KV sharing) is
    hatched, over its target's buffer."""
    shared = dict(shared_kv_cache_layers or {})
    group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups)
                for name in group.layer_names}
    tensors = kv_cache_config.kv_cache_tensors
    rows = [list(t.shared_by) + [s for s, target in shared.items() if target in t.shared_by]
            for t in tensors]
    num_blocks = kv_cache_config.num_blocks
    cells = min(num_blocks, 16)                  # beyond 16 blocks, the bar is drawn uncut
    length, band = 8.0, 0.32
    heights = [0.5 + band * len(names) + 0.45 for names in rows]
    ax = new_axes(ax, (11, 0.6 + 0.75 * sum(heights)))
    y = 0.0
    for i, (tensor, names) in enumerate(zip(tensors, rows)):
        y -= heights[i]
        # The buffer: its blocks side by side.
        ax.add_patch(_rect(0, y, length, "#EEEEEE", height=0.5))
        for b in range(1, cells):
            ax.plot([b * length / cells] * 2, [y, y + 0.5], color=MUTED_COLOR, lw=0.5)
        block_label = "block {}" if cells == num_blocks else None
        for b in range(cells if block_label else 0):
            ax.text((b + 0.5) * length / cells, y + 0.25, block_label.format(b), ha="center", va="center",
                    fontsize=6.5, color=EDGE_COLOR)
        if block_label is None:
            ax.text(length / 2, y + 0.25, f"{num_blocks:,} blocks", ha="center", va="center", fontsize=7)
        ax.text(-0.15, y + 0.25, f"tensor {i}\n{tensor.size:,} B", ha="right", va="center", fontsize=8)
        # The layers that view it, each over the whole buffer.
        for k, name in enumerate(names):
            yb = y + 0.55 + band * k
            ax.add_patch(_rect(0, yb, length, seq_color(group_of.get(name, 0)), height=band * 0.85,
                               hatch="//" if name in shared else None))
            label = name if name not in shared else f"{name} (reuses {shared[name]})"
            ax.text(0.1, yb + band * 0.42, f"{label}: views all of tensor {i}", ha="left", va="center",
                    fontsize=7, color="white" if name not in shared else EDGE_COLOR)
    handles = [_rect(0, 0, 1, seq_color(g)) for g in range(len(kv_cache_config.kv_cache_groups))]
    labels = [f"group {g}: {type(grp.kv_cache_spec).__name__}"
              for g, grp in enumerate(kv_cache_config.kv_cache_groups)]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(-1.6, length + 0.1)
    ax.set_ylim(y - 0.1, 0.1)
    ax.axis("off")
    ax.set_title(f"{len(tensors)} raw buffers of {num_blocks} blocks each; every layer over a buffer "
                 "views all of it", fontsize=10)
    return ax


def _rect(x: float, y: float, w: float, color: str, hatch: str | None = None, height: float = 0.7):
    from matplotlib.patches import Rectangle
    return Rectangle((x, y), w, height, facecolor=color, edgecolor=EDGE_COLOR if hatch is None
                     else MUTED_COLOR, lw=0.6, hatch=hatch)
