"""Drawing vLLM's legacy (V0) block layer: block tables, the physical pool, hash chains, eviction.

Three pictures, each backed by a small pure function that a test (or a curious reader) can
check against the allocator itself:

* ``draw_legacy_block_tables``: each table's logical blocks, the GPU's physical blocks with
  their reference counts, and which free id the allocator will hand out next
  (``physical_blocks``, ``allocation_order``);
* ``draw_hash_chain``: the prefix hashes of a chain of ``PrefixCachingBlock``s, each one
  covering the hash before it (``short_hash``);
* ``draw_eviction_order``: the cached blocks nobody holds, in the order the LRU evictor gives
  them up (``eviction_order``).

The state they show comes from the allocators' public accessors and from the models kept next
to them (``allocation_order``, ``eviction_order`` in ``legacy.cpu_gpu_block_allocator``): what
the drawings show is exactly the state the allocator will act on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from paged_attention.legacy.block_table import BlockTable
from paged_attention.legacy.cpu_gpu_block_allocator import (
    CpuGpuBlockAllocator, NullBlock, allocation_order, eviction_order, gpu_allocator,
)
from paged_attention.legacy.prefix_caching_block import PrefixCachingBlock, PrefixCachingBlockAllocator
from paged_attention.viz.style import EDGE_COLOR, MUTED_COLOR, new_axes, seq_color

NULL_COLOR = "#555555"     # the sliding window's null block
HIT_COLOR = "#1E8449"   # a prefix-cache hit
SHARED_HATCH = "////"      # a physical block held more than once
_MASK64 = (1 << 64) - 1

# --------------------------------------------------------------------------------------------
# 1. The state the drawings show
# --------------------------------------------------------------------------------------------


def short_hash(content_hash: int | None, digits: int = 4) -> str:
    """The last ``digits`` hex digits of a 64-bit hash (two's complement for negative ones), or
    ``"none"`` for a block without one."""
    if content_hash is None:
        return "none"
    if not isinstance(content_hash, int) or isinstance(content_hash, bool):
        raise TypeError(f"content_hash must be an int or None, got {type(content_hash).__name__}")
    if not isinstance(digits, int) or not 1 <= digits <= 16:
        raise ValueError(f"digits must be an int in 1..16, got {digits!r}")
    return f"{content_hash & _MASK64:016x}"[-digits:]


@dataclass
class PhysicalBlock:
    """One GPU block as the drawing shows it."""

    block_id: int
    refcount: int
    holders: list[tuple[str, int]] = field(default_factory=list)  # (table name, logical index)
    filled: int = 0            # most slots filled in any table's view of it
    null: bool = False         # the sliding window's null block
    evictable: bool = False    # cached, held by nobody, waiting in the evictor
    next_rank: int | None = None  # place in ``allocation_order`` (0: handed out next)

    @property
    def shared(self) -> bool:
        return self.refcount > 1

    @property
    def free(self) -> bool:
        return self.refcount == 0


def _checked_tables(tables: Any, allocator: Any) -> dict[str, BlockTable]:
    if not isinstance(allocator, CpuGpuBlockAllocator):
        raise TypeError(f"allocator must be a CpuGpuBlockAllocator, got {type(allocator).__name__}")
    if not isinstance(tables, Mapping):
        raise TypeError(f"tables must be a dict of name -> BlockTable, got {type(tables).__name__}")
    for name, table in tables.items():
        if not isinstance(name, str):
            raise TypeError(f"table names must be str, got {name!r}")
        if not isinstance(table, BlockTable):
            raise TypeError(f"tables[{name!r}] must be a BlockTable, got {type(table).__name__}")
        if table.allocator is not allocator:
            raise ValueError(f"tables[{name!r}] allocates from another allocator than the one given")
    return dict(tables)


def physical_blocks(tables: Mapping[str, BlockTable], allocator: CpuGpuBlockAllocator) -> list[PhysicalBlock]:
    """Every GPU block, in id order: reference count, which tables hold it, whether it is free,
    the null block, or waiting in the evictor, and its place in the allocation order."""
    tables = _checked_tables(tables, allocator)
    gpu = gpu_allocator(allocator)
    null_id = allocator.null_block.block_id if allocator.null_block is not None else None
    evictor = gpu.evictor if isinstance(gpu, PrefixCachingBlockAllocator) else None
    rank = {block_id: r for r, block_id in enumerate(allocation_order(allocator))}
    pool = {i: PhysicalBlock(i, gpu.refcounter.get(i), null=i == null_id,
                             evictable=evictor is not None and i in evictor, next_rank=rank.get(i))
            for i in sorted(gpu.all_block_ids)}
    for name, table in tables.items():
        for j, block in enumerate(table.blocks):
            if block.block_id in pool:
                pool[block.block_id].holders.append((name, j))
                pool[block.block_id].filled = max(pool[block.block_id].filled, len(block.token_ids))
    return list(pool.values())


# --------------------------------------------------------------------------------------------
# 2. Block tables over the physical pool
# --------------------------------------------------------------------------------------------

_W = 1.2        # width of a block box
_GAP = 0.35     # space between two boxes
_H = 0.5        # height of a block box
_ROW = 1.3      # vertical distance between two tables


def _slots(ax: Any, x: float, y: float, block_size: int, tokens: Sequence[int], color: str,
           hatch: str | None = None, show_tokens: bool = True, dashed: bool = False) -> None:
    """A block as ``block_size`` slots, the filled ones shaded (and labelled with their token)."""
    cell = _W / block_size
    n = len(tokens)
    # An opaque background: arrows (drawn below, zorder 1) pass behind the boxes.
    ax.add_patch(Rectangle((x, y), _W, _H, facecolor="white", edgecolor="none", zorder=2))
    if n:
        ax.add_patch(Rectangle((x, y), n * cell, _H, facecolor=color, alpha=0.55, edgecolor="none",
                               hatch=hatch, zorder=2.1))
    elif hatch:
        ax.add_patch(Rectangle((x, y), _W, _H, facecolor="none", edgecolor=EDGE_COLOR, lw=0, hatch=hatch,
                               alpha=0.5, zorder=2.1))
    for k in range(1, block_size):
        ax.plot([x + k * cell] * 2, [y, y + _H], color=EDGE_COLOR, lw=0.3, alpha=0.4, zorder=2.2)
    if show_tokens and block_size <= 8:
        longest = max((len(str(token)) for token in tokens), default=1)
        size = 6.5 if block_size * longest <= 4 else 5.5 if block_size * longest <= 8 else 4.5
        for k, token in enumerate(tokens):
            ax.text(x + (k + 0.5) * cell, y + _H / 2, str(token), ha="center", va="center",
                    fontsize=size, color="black", zorder=3)
    ax.add_patch(Rectangle((x, y), _W, _H, facecolor="none", edgecolor=EDGE_COLOR, lw=0.9,
                           linestyle="--" if dashed else "-", zorder=2.3))


MAX_CROSSINGS = 2     # more crossing arrows than this and the holders are named instead


def crossings(segments: Sequence[tuple[tuple[float, float], tuple[float, float]]]) -> int:
    """How many pairs of the straight ``((x0, y0), (x1, y1))`` segments cross each other (touching
    at an end does not count)."""
    def side(a, b, c) -> float:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    count = 0
    for k, (p1, p2) in enumerate(segments):
        for q1, q2 in segments[k + 1:]:
            if side(p1, p2, q1) * side(p1, p2, q2) < 0 and side(q1, q2, p1) * side(q1, q2, p2) < 0:
                count += 1
    return count


def draw_legacy_block_tables(tables: Mapping[str, BlockTable], allocator: CpuGpuBlockAllocator,
                             ax: Any = None, title: str | None = None, arrows: bool | None = None) -> Any:
    """Each table's logical blocks (top rows) over the GPU's physical blocks (bottom row).

    A logical block shows its slots (filled ones shaded, with their token ids for block sizes up
    to 8) and, above it, the physical id the table maps it to. A physical block shows its id
    above and its reference count inside; one held more than once is hatched. Free blocks are
    white and numbered in the order the allocator will hand them out (``#1`` first); the null
    block of a sliding window is dark grey; a cached block that nobody holds (waiting in a
    prefix-caching allocator's evictor) has a dashed outline.

    ``arrows``: join each table entry to its physical block with an arrow (True), or name the
    holders under each physical block instead, ``E[0]`` for entry 0 of table E (False). None
    (the default) draws arrows unless more than ``MAX_CROSSINGS`` of them would cross, where a
    tangle of lines would hide more than it shows.
    """
    tables = _checked_tables(tables, allocator)
    pool = physical_blocks(tables, allocator)
    gpu = gpu_allocator(allocator)
    block_size = gpu.block_size
    gpu_ids = {p.block_id: k for k, p in enumerate(pool)}
    colors = {name: seq_color(i) for i, name in enumerate(tables)}

    widest = max([len(t.blocks) for t in tables.values()] + [len(pool), 1])
    span = widest * (_W + _GAP)
    ax = new_axes(ax, figsize=(min(15.0, 2.2 + 0.62 * span), 1.7 + 0.62 * (len(tables) + 1.6)))

    def x_of(column: int) -> float:
        return column * (_W + _GAP)

    # Rows of logical blocks, one per table.
    for i, (name, table) in enumerate(tables.items()):
        y = -i * _ROW
        ax.text(-0.25, y + _H / 2, f"{name}\n{table.num_full_slots} tokens", ha="right", va="center",
                fontsize=8, color=colors[name], fontweight="bold")
        if not table.blocks:
            ax.text(0, y + _H / 2, "(no blocks)", va="center", fontsize=8, color=MUTED_COLOR)
        for j, block in enumerate(table.blocks):
            x = x_of(j)
            if isinstance(block, NullBlock):
                ax.add_patch(Rectangle((x, y), _W, _H, facecolor=NULL_COLOR, edgecolor=EDGE_COLOR, lw=0.9, zorder=2))
                ax.text(x + _W / 2, y + _H / 2, "null", ha="center", va="center", fontsize=7, color="white",
                        zorder=3)
            else:
                _slots(ax, x, y, block_size, block.token_ids, colors[name])
            block_id = block.block_id
            label = f"→ {block_id}" if block_id in gpu_ids else f"cpu {block_id}"
            ax.text(x + _W / 2, y + _H + 0.06, label, ha="center", va="bottom", fontsize=7,
                    color=colors[name])

    # The physical pool.
    y_pool = -len(tables) * _ROW - 0.5
    for k, p in enumerate(pool):
        x = x_of(k)
        if p.null:
            ax.add_patch(Rectangle((x, y_pool), _W, _H, facecolor=NULL_COLOR, edgecolor=EDGE_COLOR, lw=0.9,
                                   zorder=2))
            ax.text(x + _W / 2, y_pool + _H / 2, "null", ha="center", va="center", fontsize=7, color="white",
                    zorder=3)
        else:
            owner = colors[p.holders[0][0]] if p.holders else "#DDDDDD"
            tokens = [""] * p.filled if not p.free else []
            _slots(ax, x, y_pool, block_size, tokens, owner if not p.free else "white",
                   hatch=SHARED_HATCH if p.shared else None, show_tokens=False, dashed=p.evictable)
        ax.text(x + _W / 2, y_pool + _H + 0.06, str(p.block_id), ha="center", va="bottom", fontsize=8,
                color=EDGE_COLOR if not p.free else MUTED_COLOR, fontweight="bold" if p.shared else "normal")
        below = f"rc {p.refcount}" if not p.free else ""
        if p.next_rank is not None:
            below = f"#{p.next_rank + 1}" if not below else f"{below} #{p.next_rank + 1}"
        ax.text(x + _W / 2, y_pool - 0.08, below, ha="center", va="top", fontsize=7,
                color=MUTED_COLOR if p.free else EDGE_COLOR)
    ax.text(-0.25, y_pool + _H / 2, "GPU blocks", ha="right", va="center", fontsize=8, fontweight="bold")

    # The table entries as arrows from logical to physical blocks; each table's arrows leave
    # and reach the boxes at their own horizontal offset, so parallel arrows stay apart.
    links = []                      # (table, entry, block, start, end)
    for i, (name, table) in enumerate(tables.items()):
        dx = _W * (i + 1) / (len(tables) + 1)
        for j, block in enumerate(table.blocks):
            if block.block_id in gpu_ids:
                links.append((name, j, block, (x_of(j) + dx, -i * _ROW),
                              (x_of(gpu_ids[block.block_id]) + dx, y_pool + _H + 0.3)))
    if arrows is None:
        arrows = crossings([(a, b) for *_, a, b in links]) <= MAX_CROSSINGS
    y_line = y_pool - 0.55
    if arrows:
        for name, _, block, start, end in links:
            null = isinstance(block, NullBlock)
            ax.annotate("", xy=end, xytext=start,
                        arrowprops=dict(arrowstyle="-|>", color=NULL_COLOR if null else colors[name],
                                        lw=0.9, alpha=0.7, shrinkA=0, shrinkB=1,
                                        linestyle="--" if null else "-"), zorder=1)
    else:
        for k, p in enumerate(pool):
            if p.holders and not p.null:
                ax.text(x_of(k) + _W / 2, y_pool - 0.32, "\n".join(f"{n}[{j}]" for n, j in p.holders),
                        ha="center", va="top", fontsize=7, color=colors[p.holders[0][0]], gid="holders")
        y_line = y_pool - 0.4 - 0.2 * max([len(p.holders) for p in pool] + [1])

    order = allocation_order(allocator)
    num_free = len(order) - (gpu.evictor.num_blocks if isinstance(gpu, PrefixCachingBlockAllocator) else 0)
    handout = ", ".join(map(str, order[:num_free])) or "empty"
    line = f"free list, next first: {handout}"
    if isinstance(gpu, PrefixCachingBlockAllocator):
        line += f";  then evictable: {', '.join(map(str, order[num_free:])) or 'none'}"
    ax.text(0, y_line, line, ha="left", va="top", fontsize=8, color=EDGE_COLOR)

    handles = [Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch=SHARED_HATCH, label="shared (rc > 1)"),
               Patch(facecolor="white", edgecolor=MUTED_COLOR, label="free (#k: k-th handed out)")]
    if any(p.null for p in pool):
        handles.append(Patch(facecolor=NULL_COLOR, edgecolor=EDGE_COLOR, label="null block"))
    if any(p.evictable for p in pool):
        handles.append(Patch(facecolor="white", edgecolor=EDGE_COLOR, linestyle="--",
                             label="cached, evictable (rc 0)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles),
              fontsize=7, frameon=False)

    ax.set_xlim(-1.6, max(span, 4.0) + 0.2)
    ax.set_ylim(y_line - 0.35, _H + 0.45)
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"Block tables → GPU blocks (block_size = {block_size}; rc = reference count)", fontsize=10)
    return ax


# --------------------------------------------------------------------------------------------
# 3. The prefix hash chain
# --------------------------------------------------------------------------------------------

def _checked_chains(blocks: Any) -> dict[str, list[PrefixCachingBlock]]:
    if isinstance(blocks, Mapping):
        chains = {str(name): chain for name, chain in blocks.items()}
    elif isinstance(blocks, (list, tuple)):
        chains = {"": blocks}
    else:
        raise TypeError(f"blocks must be a list of PrefixCachingBlocks or a dict of name -> list, "
                        f"got {type(blocks).__name__}")
    if not chains:
        raise ValueError("blocks holds no chain to draw")
    for name, chain in chains.items():
        if not isinstance(chain, (list, tuple)):
            raise TypeError(f"each chain must be a list of PrefixCachingBlocks, got {type(chain).__name__}")
        if not chain:
            raise ValueError(f"chain {name!r} has no blocks")
        for j, block in enumerate(chain):
            if not isinstance(block, PrefixCachingBlock):
                raise TypeError(f"block {j} of chain {name!r} is a {type(block).__name__}, not a PrefixCachingBlock")
            expected_prev = chain[j - 1] if j else None
            if block.prev_block is not expected_prev:
                raise ValueError(f"block {j} of chain {name!r} does not follow block {j - 1}: a chain "
                                 "starts at a first block and each block's prev_block is the one before it")
    return chains


def draw_hash_chain(blocks: Any, ax: Any = None) -> Any:
    """The prefix hash of each block of one chain (a list) or several (a dict name -> list).

    Each block shows its tokens and physical id; below it, the last four hex digits of its
    content hash, with an arrow from the previous block's hash into it: a hash covers its
    block's tokens *and* the hash before it, so equal hashes mean equal prefixes. Blocks that
    are not full have no hash yet. A block in the prefix cache is shaded; one held by more than
    one sequence (reference count > 1) is hatched. A block whose hash an earlier row already
    has is a **prefix-cache hit**: a green outline, "hit", and a dotted line up to that block.
    """
    chains = _checked_chains(blocks)
    first_seen: dict[int, tuple[float, float]] = {}     # hash -> (x, y) of its first block drawn
    width = max(len(chain) for chain in chains.values())
    box_w, pitch, row = 1.5, 2.1, 1.6
    ax = new_axes(ax, figsize=(min(15.0, 2.5 + 1.35 * width), 0.9 + 1.05 * len(chains)))

    for r, (name, chain) in enumerate(chains.items()):
        y = -r * row
        color = seq_color(r)
        if name:
            ax.text(-1.25, y + 0.25, name, ha="right", va="center", fontsize=9, color=color, fontweight="bold")
        ax.text(-0.55, y - 0.45, "start", ha="center", va="center", fontsize=7, color=MUTED_COLOR,
                bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=MUTED_COLOR, lw=0.6))
        for j, block in enumerate(chain):
            x = j * pitch
            allocator = block.allocator
            content_hash = block.content_hash
            cached = content_hash is not None and allocator.is_block_cached(block)
            refcount = allocator.refcounter.get(block.block_id) if block.block_id is not None else 0
            ax.add_patch(FancyBboxPatch((x, y), box_w, 0.5, boxstyle="round,pad=0.02",
                                        facecolor=color if cached else "white", alpha=0.5 if cached else 1.0,
                                        edgecolor=EDGE_COLOR, lw=0.9, hatch=SHARED_HATCH if refcount > 1 else None,
                                        linestyle="-" if content_hash is not None else "--"))
            tokens = " ".join(map(str, block.token_ids))
            ax.text(x + box_w / 2, y + 0.25, tokens if len(tokens) <= 22 else tokens[:20] + "…",
                    ha="center", va="center", fontsize=7)
            ax.text(x + box_w / 2, y + 0.56, f"block {block.block_id}  rc {refcount}", ha="center",
                    va="bottom", fontsize=6.5, color=EDGE_COLOR)
            tag = f"…{short_hash(content_hash)}" if content_hash is not None else "not full: no hash"
            ax.text(x + box_w / 2, y - 0.45, tag, ha="center", va="center", fontsize=7,
                    family="monospace", color=EDGE_COLOR if content_hash is not None else MUTED_COLOR,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="#F4F4F4" if content_hash is not None else "white",
                              edgecolor=MUTED_COLOR, lw=0.6))
            if content_hash is not None and content_hash in first_seen:
                hx, hy = first_seen[content_hash]
                ax.add_patch(FancyBboxPatch((x, y), box_w, 0.5, boxstyle="round,pad=0.02", facecolor="none",
                                            edgecolor=HIT_COLOR, lw=2.2, zorder=3))
                ax.text(x + box_w + 0.05, y + 0.5, "hit", ha="left", va="bottom", fontsize=7, color=HIT_COLOR,
                        fontweight="bold")
                ax.plot([x + box_w - 0.15, hx + box_w - 0.15], [y + 0.5, hy - 0.55], ls=":", color=HIT_COLOR, lw=1.1)
            elif content_hash is not None:
                first_seen[content_hash] = (x, y)
            # The previous hash (or the start sentinel) feeds this block's hash.
            src_x = (j - 1) * pitch + box_w / 2 + 0.55 if j else -0.25
            ax.annotate("", xy=(x + 0.1, y + 0.1), xytext=(src_x, y - 0.4),
                        arrowprops=dict(arrowstyle="-|>", color=color, lw=0.9, shrinkA=2, shrinkB=1))
            ax.annotate("", xy=(x + box_w / 2, y - 0.32), xytext=(x + box_w / 2, y - 0.02),
                        arrowprops=dict(arrowstyle="-|>", color=MUTED_COLOR, lw=0.7, shrinkA=0, shrinkB=0))

    ax.set_xlim(-1.3 - (0.9 if any(chains) else 0), (width - 1) * pitch + box_w + 0.3)
    ax.set_ylim(-(len(chains) - 1) * row - 0.8, 1.0)
    ax.axis("off")
    ax.set_title("Prefix hashes: hash(previous hash, this block's tokens); shaded: in the prefix cache, "
                 "hatched: shared, green: a prefix-cache hit", fontsize=9)
    return ax


# --------------------------------------------------------------------------------------------
# 4. Eviction order
# --------------------------------------------------------------------------------------------

def draw_eviction_order(allocator: Any, ax: Any = None) -> Any:
    """The cached blocks nobody holds, left to right in the order the evictor gives them up.

    Each shows its id, its last access time, how many tokens its prefix covers and its hash.
    ``allocator`` is a ``CpuGpuBlockAllocator`` (its GPU side is drawn) or a
    ``PrefixCachingBlockAllocator``.
    """
    gpu = gpu_allocator(allocator)
    if not isinstance(gpu, PrefixCachingBlockAllocator):
        raise TypeError("only a prefix-caching allocator has an evictor; this one is naive")
    order = eviction_order(gpu.evictor)
    table = gpu.evictor.free_table
    pitch, box_w = 1.7, 1.4
    ax = new_axes(ax, figsize=(min(15.0, 2.0 + 1.15 * max(len(order), 2)), 1.9))
    for k, block_id in enumerate(order):
        meta = table[block_id]
        x = k * pitch
        ax.add_patch(Rectangle((x, 0), box_w, 0.9, facecolor=seq_color(0), alpha=0.18 + 0.5 * (k == 0),
                               edgecolor=EDGE_COLOR, lw=0.9, linestyle="--"))
        ax.text(x + box_w / 2, 0.68, f"block {block_id}", ha="center", va="center", fontsize=8, fontweight="bold")
        ax.text(x + box_w / 2, 0.42, f"t = {meta.last_accessed:g}", ha="center", va="center", fontsize=7)
        ax.text(x + box_w / 2, 0.17, f"{meta.num_hashed_tokens} tok  …{short_hash(meta.content_hash)}",
                ha="center", va="center", fontsize=6.5, family="monospace")
        ax.text(x + box_w / 2, -0.12, f"{k + 1}.", ha="center", va="top", fontsize=8, color=MUTED_COLOR)
    if order:
        ax.annotate("", xy=(max(len(order) - 1, 1) * pitch + box_w, -0.5), xytext=(0, -0.5),
                    arrowprops=dict(arrowstyle="-|>", color=MUTED_COLOR, lw=0.9))
        ax.text(0, -0.62, "evicted first", ha="left", va="top", fontsize=7, color=MUTED_COLOR)
    else:
        ax.text(0, 0.45, "(the evictor is empty)", ha="left", va="center", fontsize=8, color=MUTED_COLOR)
    ax.set_xlim(-0.2, max(len(order), 2) * pitch)
    ax.set_ylim(-0.9, 1.05)
    ax.axis("off")
    ax.set_title("Eviction order: oldest access first; then longer prefix, lower id, lower hash", fontsize=9)
    return ax
