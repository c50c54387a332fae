"""v2's block tables on the GPU: vLLM's kernels next to ours, and v2's step next to v1's.

``build`` makes a ``BlockTables`` full of running requests and one step's batch; the ``v2_*``
functions turn it into callables that the timers of ``bench.timing`` time: the device launches
alone, the whole per-step device path (apply + gather + slot mappings), or a real step with its
host work. ``v1_step`` is v1's step for the same kind of batch. ``report`` prints every table of
``benchmarks/bench_v2_block_tables.py``; notebook 04 uses the same functions. Every configuration
is checked against numpy (``same_results``) before it is timed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from paged_attention.bench.timing import gpu_us, graph_us, host_us, hot_us, launch_floor_us, queued_us, wall_us
from paged_attention.utils import PAD_SLOT_ID, cdiv
from paged_attention.v2.block_table import BlockTables
from paged_attention.v2 import make_block_tables
from paged_attention.v2.block_table_fast import FastBlockTables


@dataclass
class Batch:
    """One step's inputs for a ``BlockTables``: the batch order and its tokens (on the device)."""
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    positions: torch.Tensor
    num_tokens: int


def build(block_sizes: Sequence[int], num_reqs: int, tokens_per_req: int, context: int, *,
          max_num_batched_tokens: int = 16384, headroom: int = 1024, impl: str = "triton",
          device: Optional[torch.device] = None, seed: int = 0) -> tuple[BlockTables, Batch]:
    """``num_reqs`` running requests of about ``context`` tokens each (random ids, a shuffled
    batch order), each scheduled ``tokens_per_req`` tokens after its context, in a
    ``make_block_tables(..., impl=impl)``. The tables are filled and applied; ``headroom`` tokens per
    request are left for later appends. The same ``seed`` gives the same tables for either impl."""
    from paged_attention import runtime
    device = device or runtime.DEVICE
    rng = np.random.default_rng(seed)
    max_model_len = context + tokens_per_req + headroom
    bt = make_block_tables(list(block_sizes), num_reqs, max_num_batched_tokens, max_model_len, device, impl=impl)
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


# ---- What is timed ----------------------------------------------------------------------------------
def v2_device_step(bt: BlockTables, batch: Batch, via_idx: bool = False) -> Callable[[], object]:
    """The per-step device work of v2: gather, then slot mappings (no checks: timed)."""
    def run():
        bt.gather_block_tables(batch.idx_mapping, check=False)
        bt.compute_slot_mappings(batch.query_start_loc, batch.positions, check=False,
                                 idx_mapping=batch.idx_mapping if via_idx else None)
    return run


def v2_fused_device_step(bt: FastBlockTables, batch: Batch) -> Callable[[], object]:
    """Ours, the gather and the slot mappings in one launch (no checks: timed)."""
    def run():
        bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions,
                                            check=False)
    return run


def stage_appends(bt: BlockTables, batch: Batch, appends_per_step: Sequence[int], i: int = 0) -> None:
    """Step ``i``'s staging: ``appends_per_step[g]`` requests get one new block in group g
    (rotating over the requests)."""
    num_reqs = batch.idx_mapping.shape[0]
    most = max(appends_per_step)
    for k in range(most):
        req = (i * most + k) % num_reqs
        ids = tuple([1000 + k] if k < appends_per_step[g] else [] for g in range(bt.num_kv_cache_groups))
        bt.append_block_ids(req, ids, overwrite=False)


def v2_whole_device_path(bt: BlockTables, batch: Batch, appends_per_step: Sequence[int],
                         fused: bool = False) -> Callable[[], object]:
    """The whole per-step device path of v2, the launches only: applying every group's staged
    writes, the gather, the slot mappings.

    One step's writes are staged and prepared on the host *once*, here; every call then
    launches what a step launches, re-applying those writes (the same device work as a fresh
    step's). vLLM's kernels: per group the values' copy and the write kernel, then the gather and
    the slot mapping (6 operations for two groups). Ours: one apply launch, then the gather and the
    slot mapping (3), or with ``fused`` the two in one (2). Captured in a CUDA graph, our apply
    reads the write count from its buffer: a graph that real steps could replay."""
    stage_appends(bt, batch, appends_per_step)
    bt.num_blocks.copy_to_uva()
    if isinstance(bt, FastBlockTables):
        packed = bt.pack_staged_writes()

        def apply():
            bt.launch_staged_writes(packed)
    else:
        prepared = [(t, t.prepare_write()) for t in bt.block_tables]
        prepared = [(t, p) for t, p in prepared if p is not None]

        def apply():
            for table, p in prepared:
                table.launch_write(p)
    rest = v2_fused_device_step(bt, batch) if fused else v2_device_step(bt, batch)

    def run():
        apply()
        rest()
    return run


def v2_full_step(bt: BlockTables, batch: Batch, appends_per_step: Sequence[int],
                 fused: bool = False) -> Callable[[int], object]:
    """A whole v2 step, host work included: staging (``stage_appends``), the apply, the gather
    and the slot mappings (with ``fused``, ours in one launch)."""
    def step(i: int):
        stage_appends(bt, batch, appends_per_step, i)
        bt.apply_staged_writes()
        if fused:
            bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, batch.positions,
                                                check=False)
        else:
            bt.gather_block_tables(batch.idx_mapping, check=False)
            bt.compute_slot_mappings(batch.query_start_loc, batch.positions, check=False)
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


# ---- Checked before timing ----------------------------------------------------------------------------
def same_results(bt: BlockTables, batch: Batch) -> bool:
    """Whether ``bt``'s kernels give numpy's gathered rows and slots: the gather then the slots,
    the slots through ``idx_mapping``, and (ours) the fused launch. Tables built by ``build``
    with the same seed hold the same ids, so two impls that pass agree with each other."""
    idx = batch.idx_mapping.cpu().numpy()
    counts = bt.num_blocks.np
    want_slots = expected_slots(bt, batch)
    runs = [lambda: (bt.gather_block_tables(batch.idx_mapping),
                     bt.compute_slot_mappings(batch.query_start_loc, batch.positions)),
            lambda: (bt.gather_block_tables(batch.idx_mapping),
                     bt.compute_slot_mappings(batch.query_start_loc, batch.positions, idx_mapping=batch.idx_mapping))]
    if isinstance(bt, FastBlockTables):
        runs.append(lambda: bt.gather_and_compute_slot_mappings(batch.idx_mapping, batch.query_start_loc,
                                                                batch.positions))
    for run in runs:
        bt.get_dummy_slot_mappings(0)
        for t in bt.input_block_tables:
            t.fill_(-7)
        tables, _ = run()
        if not np.array_equal(bt.slot_mappings.cpu().numpy(), want_slots):
            return False
        for g, (got, persistent) in enumerate(zip(tables, bt.block_tables)):
            got, rows = got.cpu().numpy(), persistent.gpu.cpu().numpy()
            if any(not np.array_equal(got[b, :counts[g, s]], rows[s, :counts[g, s]]) for b, s in enumerate(idx)):
                return False
    return True


def expected_slots(bt: BlockTables, batch: Batch) -> np.ndarray:
    """The whole ``slot_mappings`` buffer computed in numpy from the persistent tables."""
    idx = batch.idx_mapping.cpu().numpy()
    qsl = batch.query_start_loc.cpu().numpy()
    pos = batch.positions.cpu().numpy()[:qsl[-1]]
    rows = idx[np.repeat(np.arange(idx.shape[0]), np.diff(qsl))]
    out = np.full(tuple(bt.slot_mappings.shape), PAD_SLOT_ID, dtype=np.int64)
    for g, (table, bs) in enumerate(zip(bt.block_tables, bt.block_sizes)):
        ids = table.gpu.cpu().numpy().astype(np.int64)
        out[g, :pos.shape[0]] = ids[rows, pos // bs] * bs + pos % bs
    return out


# ---- The printed report --------------------------------------------------------------------------------
IMPL_NAMES = {"vllm": "vLLM's kernels", "triton": "ours"}


def _row(print_fn: Callable[[str], object], label: str, **cols: float) -> None:
    cells = "  ".join(f"{k} {v:7.2f} us" for k, v in cols.items())
    print_fn(f"  {label:<44s} {cells}")


def report(*, sweep: bool = False, whole_path_only: bool = False, print_fn: Callable[[str], object] = print) -> None:
    """Print every table: the launch floor; [1] gather and slot mappings alone, one group; [2]
    the whole per-step path, two groups; [3] v1's step next to v2's. ``whole_path_only`` prints
    the floor and [2]; ``sweep`` also tries our kernels' tile sizes (to choose the defaults)."""
    print_fn("\nlaunch floor (a Triton kernel storing one int):")
    _row(print_fn, "one store", **launch_floor_us())
    print_fn("eager: do_bench (median GPU time, L2 flushed before every call); graph: the call replayed")
    print_fn("from a CUDA graph (L2 flushed); hot: 20 calls in one graph (warm L2), per call")
    if not whole_path_only:
        print_fn("\n[1] one group (block size 16), 1024 requests, context <= 2048, max_num_batched_tokens 16384")
        for tokens in (16, 1):
            gather_and_slots_alone(tokens, sweep=sweep, print_fn=print_fn)
    whole_path(sweep=sweep, print_fn=print_fn)
    if not whole_path_only:
        v1_against_v2(print_fn=print_fn)


def gather_and_slots_alone(tokens: int, *, sweep: bool = False, print_fn: Callable[[str], object] = print) -> None:
    """[1] ``gather_block_tables`` and ``compute_slot_mappings`` alone, one group, 1024
    requests of ``tokens`` tokens each, both kernel sets."""
    for impl in ("vllm", "triton"):
        bt, batch = build([16], 1024, tokens, 2048, impl=impl)
        assert same_results(bt, batch), f"{impl} kernels disagree with numpy"
        print_fn(f" {tokens} token(s) per request = {batch.num_tokens} tokens, {IMPL_NAMES[impl]} (verified = numpy)")
        gather = lambda: bt.gather_block_tables(batch.idx_mapping, check=False)  # noqa: E731
        _row(print_fn, f"gather_block_tables [{impl}]", eager=gpu_us(gather), graph=graph_us(gather),
             hot=hot_us(gather))
        if impl == "triton":
            bt.num_blocks.copy_to_uva()           # re-binds .gpu: the gather now reads the counts over the bus
            _row(print_fn, "gather_block_tables [fast, UVA counts]", eager=gpu_us(gather), graph=graph_us(gather),
                 hot=hot_us(gather))
            bt.apply_staged_writes()
        bt.gather_block_tables(batch.idx_mapping)
        for idx in (None, batch.idx_mapping):
            slots = lambda idx=idx: bt.compute_slot_mappings(  # noqa: E731
                batch.query_start_loc, batch.positions, idx_mapping=idx, check=False)
            label = f"compute_slot_mappings [{impl}{', idx_mapping' if idx is not None else ''}]"
            _row(print_fn, label, eager=gpu_us(slots), graph=graph_us(slots), hot=hot_us(slots))
        if impl == "triton" and tokens == 1:
            for check in (True, False):
                slots = lambda check=check: bt.compute_slot_mappings(  # noqa: E731
                    batch.query_start_loc, batch.positions, check=check)
                _row(print_fn, f"slot mapping wall clock [fast] check={check}", wall=wall_us(lambda i: slots()))
        if impl == "triton" and sweep:
            _sweep_tiles(bt, batch, print_fn)
        bt = batch = None                         # freed before the next kernel set's


def _sweep_tiles(bt: FastBlockTables, batch: Batch, print_fn: Callable[[str], object]) -> None:
    defaults = bt.slot_block_tokens, bt.gather_rows, bt.gather_block_cols
    for block_tokens in (64, 128, 256, 512):
        bt.slot_block_tokens = block_tokens
        slots = lambda: bt.compute_slot_mappings(batch.query_start_loc, batch.positions, check=False)  # noqa: E731
        _row(print_fn, f"  sweep slot BLOCK_TOKENS={block_tokens}", eager=gpu_us(slots), graph=graph_us(slots))
    bt.slot_block_tokens = defaults[0]
    for rows, cols in ((2, 128), (4, 128), (8, 128), (4, 256), (1, 256)):
        bt.gather_rows, bt.gather_block_cols = rows, cols
        gather = lambda: bt.gather_block_tables(batch.idx_mapping, check=False)  # noqa: E731
        _row(print_fn, f"  sweep gather ROWS={rows} BLOCK_COLS={cols}", eager=gpu_us(gather), graph=graph_us(gather))
    bt.slot_block_tokens, bt.gather_rows, bt.gather_block_cols = defaults


def whole_path(*, sweep: bool = False, print_fn: Callable[[str], object] = print) -> None:
    """[2] the whole per-step device path, two groups, 1024 requests x 16 tokens."""
    print_fn("\n[2] the whole per-step v2 path, two groups (block sizes 16, 32), 1024 requests x 16 tokens")
    print_fn("    = 16384 tokens; each step 64 requests get a block in group 0 and 32 in group 1.")
    print_fn("    whole path = apply (all groups' staged writes) + gather + slot mappings, the device launches")
    print_fn("    only (the step's writes are staged once, and every call applies them again);")
    print_fn("    queued: as eager, the host's launch work hidden behind a GPU sleep (GPU time alone);")
    print_fn("    host: Python time to issue the launches; wall: a real step, host staging included")
    for impl, fused in (("vllm", False), ("triton", False), ("triton", True)):
        name = f"{impl}{', fused gather+slots' if fused else ''}"
        bt, batch = build([16, 32], 1024, 16, 2048, impl=impl)
        assert same_results(bt, batch), f"{impl} kernels disagree with numpy"
        whole = v2_whole_device_path(bt, batch, (64, 32), fused=fused)
        _row(print_fn, f"whole path [{name}]", eager=gpu_us(whole), graph=graph_us(whole), hot=hot_us(whole),
             queued=queued_us(whole), host=host_us(whole))
        part = v2_fused_device_step(bt, batch) if fused else v2_device_step(bt, batch)
        _row(print_fn, f"  gather + slots only [{name}]", eager=gpu_us(part), graph=graph_us(part),
             hot=hot_us(part), queued=queued_us(part), host=host_us(part))
        if impl == "triton" and sweep:
            # Our apply under capture: programs x tiles of writes.
            whole = v2_whole_device_path(bt, batch, (64, 32), fused=fused)
            defaults = bt.capture_write_programs, bt.capture_write_rows
            for programs, rows in ((1, 128), (2, 64), (4, 32), (4, 64), (8, 16), (3, 32), (6, 16)):
                bt.capture_write_programs, bt.capture_write_rows = programs, rows
                _row(print_fn, f"  sweep capture programs={programs} rows={rows}", graph=graph_us(whole))
            bt.capture_write_programs, bt.capture_write_rows = defaults
        del bt, batch
        bt, batch = build([16, 32], 1024, 16, 2048, impl=impl)
        _row(print_fn, f"  wall clock, a real step [{name}]",
             wall=wall_us(v2_full_step(bt, batch, (64, 32), fused=fused), n=100))
        del bt, batch


def v1_against_v2(*, print_fn: Callable[[str], object] = print) -> None:
    """[3] one decode step of v1 and of v2 (both kernel sets), wall clock, 8 to 1024 requests."""
    print_fn("\n[3] one decode step (1 token per request, one group of block size 16), wall clock;")
    print_fn("    a sixteenth of the requests get a new block each step")
    for num_reqs in (8, 32, 128, 512, 1024):
        appends = max(1, num_reqs // 16)
        cols = {"v1": wall_us(v1_step(num_reqs, 1, 2048, appends))}
        for impl in ("vllm", "triton"):
            bt, batch = build([16], num_reqs, 1, 2048, impl=impl)
            cols[f"v2-{impl}"] = wall_us(v2_full_step(bt, batch, (appends,)))
            del bt, batch
        _row(print_fn, f"{num_reqs:5d} requests", **cols)
