"""Workloads and timings for the v2 block tables (GPU): the seed's kernels next to ours, and v2's
step next to v1's.

Figures come from ``triton.testing.do_bench`` (median GPU time per call, the L2 cache flushed in
between), from CUDA-graph replay (the same calls captured once, so no Python launch overhead),
and, for whole steps that include host work (staging ids, numpy, copies), from the wall clock
(many steps back to back, one synchronisation at the end). ``benchmarks/bench_v2_block_tables.py``
prints them all; notebook 04 uses the same functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from paged_attention.utils import cdiv
from paged_attention.v2.block_table import BlockTables


@dataclass
class Batch:
    """One step's inputs for a ``BlockTables``: the batch order and its tokens (on the device)."""
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    num_tokens: int


def build(block_sizes: Sequence[int], num_reqs: int, tokens_per_req: int, context: int, *,
          max_num_batched_tokens: int = 16384, headroom: int = 1024, impl: str = "fast",
          device: Optional[torch.device] = None, seed: int = 0) -> tuple[BlockTables, Batch]:
    """``num_reqs`` running requests of about ``context`` tokens each (random ids, a shuffled
    batch order), each scheduled ``tokens_per_req`` tokens after its context. The tables are
    filled and applied; ``headroom`` tokens per request are left for later appends."""
    from paged_attention import runtime
    device = device or runtime.DEVICE
    rng = np.random.default_rng(seed)
    max_model_len = context + tokens_per_req + headroom
    bt = BlockTables(list(block_sizes), num_reqs, max_num_batched_tokens, max_model_len, device, impl=impl)
    contexts = rng.integers(context // 2, context + 1, size=num_reqs)
    for req in range(num_reqs):
        length = int(contexts[req]) + tokens_per_req
        ids = tuple(rng.integers(1, 1 << 20, size=cdiv(length, bs)).tolist() for bs in block_sizes)
        bt.append_block_ids(req, ids, overwrite=True)
    bt.apply_staged_writes()
    order = rng.permutation(num_reqs)
    qsl = np.arange(num_reqs + 1) * tokens_per_req
    positions = (contexts[order][:, None] + np.arange(tokens_per_req)[None, :]).reshape(-1)
    batch = Batch(torch.tensor(order, dtype=torch.int32, device=device),
                  torch.tensor(qsl, dtype=torch.int32, device=device),
                  torch.tensor(positions, dtype=torch.int64, device=device), num_reqs * tokens_per_req)
    if batch.num_tokens > max_num_batched_tokens:
        raise ValueError(f"{batch.num_tokens} tokens do not fit max_num_batched_tokens={max_num_batched_tokens}")
    return bt, batch


def gpu_us(fn: Callable[[], object]) -> float:
    """Median GPU microseconds per call (``triton.testing.do_bench``, L2 flushed between calls)."""
    import triton
    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_us(fn: Callable[[], object]) -> float:
    """``gpu_us`` of ``fn`` captured once in a CUDA graph and replayed."""
    fn()                                              # compile outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                   # warm-up on a side stream, as torch advises
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return gpu_us(graph.replay)


def hot_us(fn: Callable[[], object], k: int = 20) -> float:
    """Microseconds per call with warm caches: ``k`` calls back to back captured in one CUDA
    graph, replayed (one L2 flush per replay, amortised over the ``k`` calls). Closer to a step
    inside a model run, where these small tensors were just written and sit in L2."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(k):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return gpu_us(graph.replay) / k


def queued_us(fn: Callable[[], object], reps: int = 100, head_start_cycles: int = 2_000_000) -> float:
    """Median GPU microseconds per call with the host's launch work hidden: as ``gpu_us`` (L2
    flushed before every call), but the GPU first sleeps ``head_start_cycles`` (about a
    millisecond), so that every launch of ``fn`` is queued before the GPU reaches it. What the
    launches cost the GPU back to back on a stream (gaps between kernels included), whatever
    Python spends issuing them. ``gpu_us`` measures the same unless the host needs longer to
    issue ``fn`` than the GPU needs for the flush (then the GPU waits inside the timed span)."""
    import triton
    fn()
    torch.cuda.synchronize()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        cache.zero_()
        torch.cuda._sleep(head_start_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return 1000.0 * float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)]))


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host microseconds per call of ``fn`` (issuing its launches, checks included), with the GPU
    kept busy so that nothing waits on it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)            # the GPU is busy all along: launches never block
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def launch_floor_us() -> dict[str, float]:
    """The same three measures for a Triton kernel that stores one number: what any kernel costs."""
    import triton
    import triton.language as tl

    @triton.jit
    def _one_store(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    fn = lambda: _one_store[(1,)](x)  # noqa: E731
    return {"eager": gpu_us(fn), "graph": graph_us(fn), "hot": hot_us(fn)}


def wall_us(step: Callable[[int], object], n: int = 200) -> float:
    """Wall-clock microseconds per step, host work included: ``n`` steps back to back (the GPU
    works while the host prepares the next), one synchronisation at the end."""
    for i in range(10):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(10 + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def v2_device_step(bt: BlockTables, batch: Batch, impl: str, via_idx: bool = False) -> Callable[[], object]:
    """The per-step device work of v2: gather, then slot mappings (no checks: timed)."""
    def run():
        bt.gather_block_tables(batch.idx_mapping, impl=impl, check=False)
        bt.compute_slot_mappings(batch.query_start_loc, batch.positions, impl=impl, check=False,
                                 idx_mapping=batch.idx_mapping if via_idx else None)
    return run


def v2_fused_device_step(bt: BlockTables, batch: Batch) -> Callable[[], object]:
    """Ours, gather and slot mappings in one launch (no checks: timed)."""
    def run():
        bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions,
                                            check=False)
    return run


def stage_appends(bt: BlockTables, batch: Batch, appends_per_step: Sequence[int], i: int = 0) -> None:
    """Step ``i``'s staging: ``appends_per_step[g]`` requests get one new block in group g
    (rotating over the requests)."""
    num_reqs = batch.idx_mapping.shape[0]
    groups = bt.num_kv_cache_groups
    most = max(appends_per_step)
    for k in range(most):
        req = (i * most + k) % num_reqs
        ids = tuple([1000 + k] if k < appends_per_step[g] else [] for g in range(groups))
        bt.append_block_ids(req, ids, overwrite=False)


def v2_whole_device_path(bt: BlockTables, batch: Batch, impl: str, appends_per_step: Sequence[int],
                         fused: bool = False) -> Callable[[], object]:
    """The whole per-step device path of v2 (the issue's measure): applying the staged writes
    of every group, the gather, the slot mappings; the launches only.

    One step's writes (``appends_per_step[g]`` new ids in group g) are staged and prepared on
    the host *once*, here; every call of the returned function then launches everything a step
    launches, and so re-applies those writes (the same ids to the same cells: the same device
    work as a fresh step's). Host staging is left out (``v2_full_step`` times it):

    * ``"seed"``: per group, the values' host-to-device copy and the write kernel; then the
      gather and the slot mapping (6 operations on the stream for two groups);
    * ``"fast"``: one launch for all groups' writes (and the counts' copy), then the gather and
      the slot mapping (3 launches), or with ``fused`` the gather and the slots in one (2).

    Captured in a CUDA graph (``graph_us``), the fast apply's launch covers the most writes that
    can be staged and reads the count from its UVA buffer, as ``launch_staged_writes`` documents:
    a graph that real steps could replay, one per pool buffer."""
    stage_appends(bt, batch, appends_per_step)
    bt.num_blocks.copy_to_uva()
    if impl == "seed":
        prepared = [(t, t.prepare_write()) for t in bt.block_tables]
        prepared = [(t, p) for t, p in prepared if p is not None]

        def apply():
            for table, p in prepared:
                table.launch_write(p)
    else:
        packed = bt.pack_staged_writes()

        def apply():
            bt.launch_staged_writes(packed)
    rest = v2_fused_device_step(bt, batch) if fused else v2_device_step(bt, batch, impl)

    def run():
        apply()
        rest()
    return run


def v2_single_launch_path(bt: BlockTables, batch: Batch, appends_per_step: Sequence[int]) -> Callable[[], object]:
    """``v2_whole_device_path`` for ours in one launch (``apply_gather_and_compute_slot_mappings``,
    experimental): one step's writes packed once, every call applies them, gathers and maps."""
    stage_appends(bt, batch, appends_per_step)
    bt.num_blocks.copy_to_uva()
    packed = bt.pack_staged_writes()

    def run():
        bt.apply_gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions,
                                                  packed=packed, check=False)
    return run


def v2_full_step(bt: BlockTables, batch: Batch, impl: str, appends_per_step: Sequence[int],
                 fused: bool = False) -> Callable[[int], object]:
    """A whole v2 step, host work included: ``appends_per_step[g]`` requests get one new block in
    group g (rotating over the requests), staged writes applied, gather, slot mappings (with
    ``fused``, ours in one launch)."""
    def step(i: int):
        stage_appends(bt, batch, appends_per_step, i)
        bt.apply_staged_writes(impl=impl)
        if fused:
            bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions,
                                                check=False)
        else:
            bt.gather_block_tables(batch.idx_mapping, impl=impl, check=False)
            bt.compute_slot_mappings(batch.query_start_loc, batch.positions, impl=impl, check=False)
    return step


def v1_step(num_reqs: int, tokens_per_req: int, context: int, appends_per_step: int, *,
            block_size: int = 16, max_num_batched_tokens: int = 16384, headroom: int = 1024,
            seed: int = 0) -> Callable[[int], object]:
    """v1's step for the same kind of batch: ``append_row`` for a few requests, the numpy slot
    mapping, and the two pinned host-to-device copies (table rows in use, slots)."""
    from paged_attention.v1.block_table import BlockTable
    rng = np.random.default_rng(seed)
    max_blocks = cdiv(context + tokens_per_req + headroom, block_size)
    bt = BlockTable(block_size, num_reqs, max_blocks, max_num_batched_tokens, True, "cuda", block_size, 1)
    contexts = rng.integers(context // 2, context + 1, size=num_reqs)
    for row in range(num_reqs):
        bt.add_row(rng.integers(1, 1 << 20, size=cdiv(int(contexts[row]) + tokens_per_req, block_size)), row)
    req_indices = np.repeat(np.arange(num_reqs), tokens_per_req)
    positions = (contexts[:, None] + np.arange(tokens_per_req)[None, :]).reshape(-1)
    num_tokens = num_reqs * tokens_per_req

    def step(i: int):
        for k in range(appends_per_step):
            bt.append_row([1000 + k], (i * appends_per_step + k) % num_reqs)
        bt.compute_slot_mapping(req_indices, positions)
        bt.commit_block_table(num_reqs)
        bt.commit_slot_mapping(num_tokens)
    return step


def same_results(bt: BlockTables, batch: Batch) -> bool:
    """Seed and fast kernels (and the idx_mapping form) give identical tables and slots."""
    outs = []
    for impl, via_idx in (("seed", False), ("fast", False), ("fast", True), ("seed", True)):
        bt.get_dummy_slot_mappings(0)
        for t in bt.input_block_tables:
            t.fill_(-7)
        tables = [t.clone() for t in bt.gather_block_tables(batch.idx_mapping, impl=impl)]
        slots = bt.compute_slot_mappings(batch.query_start_loc, batch.positions, impl=impl,
                                         idx_mapping=batch.idx_mapping if via_idx else None).clone()
        outs.append((tables, bt.slot_mappings.clone()))
        del slots
    bt.get_dummy_slot_mappings(0)
    for t in bt.input_block_tables:
        t.fill_(-7)
    tables, _ = bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions)
    outs.append(([t.clone() for t in tables], bt.slot_mappings.clone()))
    first = outs[0]
    if not np.array_equal(first[1].cpu().numpy(), expected_slots(bt, batch)):
        return False
    return all(all(torch.equal(a, b) for a, b in zip(o[0], first[0])) and torch.equal(o[1], first[1])
               for o in outs[1:])


def expected_slots(bt: BlockTables, batch: Batch) -> np.ndarray:
    """The whole ``slot_mappings`` buffer computed in numpy from the persistent tables."""
    from paged_attention.utils import PAD_SLOT_ID
    idx = batch.idx_mapping.cpu().numpy()
    qsl = batch.query_start_loc.cpu().numpy()
    pos = batch.positions.cpu().numpy()[:qsl[-1]]
    rows = idx[np.repeat(np.arange(idx.shape[0]), np.diff(qsl))]
    out = np.full(tuple(bt.slot_mappings.shape), PAD_SLOT_ID, dtype=np.int64)
    for g, (table, bs) in enumerate(zip(bt.block_tables, bt.block_sizes)):
        ids = table.gpu.cpu().numpy().astype(np.int64)
        out[g, :pos.shape[0]] = ids[rows, pos // bs] * bs + pos % bs
    return out
