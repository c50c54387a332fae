"""v2 block tables on the GPU: the seed's kernels against ours, and v2's step against v1's.

Usage (GPU machine):  python benchmarks/bench_v2_block_tables.py [--sweep] [--whole-path | --single-launch]
Prints, with the GPU's name:
* gather_block_tables and compute_slot_mappings alone, seed vs ours (do_bench: median GPU time,
  and the same call replayed from a CUDA graph), for 1024 requests of one group with 16 tokens
  each (16384 tokens) and with 1 token each (pure decode, 1024 tokens);
* the whole per-step v2 path with two groups (block sizes 16 and 32) at 1024 requests / 16384
  tokens (the issue's measure): apply of all groups' staged writes + gather + slot mappings,
  the device launches, eager (do_bench), replayed from a CUDA graph, and with the host's launch
  work hidden ("queued"); seed, ours, and ours with the gather and slots fused in one launch;
  and a real step (host staging included) on the wall clock;
* v1's step (append_row, numpy slot mapping, pinned host-to-device copies) next to v2's for
  batch sizes 8 ... 1024, decoding one token per request, on the wall clock.
``--whole-path`` prints only the launch floor and section [2]. ``--single-launch`` times only
the experimental one-launch step (run it in a process of its own: its kernel spins on a
counter). ``--sweep`` also tries launch shapes of our kernels (tile sizes; in section [2], the
staged writes' launch captured in a CUDA graph), to choose the defaults.
Every configuration is verified (seed = ours = numpy) before it is timed.
"""
import argparse
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)


def row(label: str, **cols: float) -> None:
    cells = "  ".join(f"{k} {v:7.2f} us" for k, v in cols.items())
    print(f"  {label:<44s} {cells}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep our kernels' tile sizes")
    parser.add_argument("--single-launch", action="store_true",
                        help="only time the experimental single-launch step (section [2b]): it spins on "
                             "a counter, so run it in a process of its own")
    parser.add_argument("--whole-path", action="store_true",
                        help="only the launch floor and the whole per-step path (section [2])")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs an NVIDIA GPU (on a CPU the Triton interpreter says nothing about speed)")
        return 1
    from paged_attention.bench import warm_up
    from paged_attention.v2 import bench as vb

    print(f"GPU: {torch.cuda.get_device_name()}  (torch {torch.__version__}, triton "
          f"{__import__('triton').__version__})", flush=True)
    warm_up()
    if opts.single_launch:
        print("\n[2b] the whole per-step path in ONE launch (ours, experimental; same workload as [2])")
        bt, batch = vb.build([16, 32], 1024, 16, 2048)
        ref, ref_batch = vb.build([16, 32], 1024, 16, 2048)          # the same tables (same seed)
        whole = vb.v2_single_launch_path(bt, batch, (64, 32))
        for _ in range(3):
            whole()
        vb.stage_appends(ref, ref_batch, (64, 32))
        ref.apply_staged_writes()
        ref.gather_and_compute_slot_mappings(ref_batch.idx_mapping, ref_batch.query_start_loc, ref_batch.positions)
        same = all(torch.equal(x.gpu, y.gpu) for x, y in zip(bt.block_tables, ref.block_tables)) and \
            all(torch.equal(x, y) for x, y in zip(bt.input_block_tables, ref.input_block_tables)) and \
            torch.equal(bt.slot_mappings, ref.slot_mappings) and bt._step_sync.tolist() == [0, 0]
        assert same, "the single launch disagrees with apply + fused gather/slots"
        print("  (verified: same tables, gathered tables and slots as apply + fused gather/slots)")
        row("whole path [fast, single launch]", eager=vb.gpu_us(whole), graph=vb.graph_us(whole),
            hot=vb.hot_us(whole), queued=vb.queued_us(whole), host=vb.host_us(whole))
        assert bt._step_sync.tolist() == [0, 0]
        return 0

    print("\nlaunch floor (a Triton kernel storing one int):")
    row("one store", **vb.launch_floor_us())
    print("eager: do_bench (median GPU time, L2 flushed before every call); graph: the call replayed")
    print("from a CUDA graph (L2 flushed); hot: 20 calls in one graph (warm L2), per call")

    for tokens in (() if opts.whole_path else (16, 1)):
        section_1(opts, tokens)
    section_2(opts)
    if not opts.whole_path:
        section_3()
    return 0


def section_1(opts, tokens: int) -> None:
    """[1] gather and slot mappings alone, one group, ``tokens`` tokens per request."""
    from paged_attention.v2 import bench as vb
    if tokens == 16:
        print("\n[1] one group (block size 16), 1024 requests, context <= 2048, max_num_batched_tokens 16384")
    bt, batch = vb.build([16], 1024, tokens, 2048)
    assert vb.same_results(bt, batch), "seed and fast kernels disagree"
    print(f" {tokens} token(s) per request = {batch.num_tokens} tokens (verified: seed = ours = numpy)")
    for impl in ("seed", "fast"):
        gather = lambda impl=impl: bt.gather_block_tables(batch.idx_mapping, impl=impl, check=False)
        row(f"gather_block_tables  [{impl}]", eager=vb.gpu_us(gather), graph=vb.graph_us(gather),
            hot=vb.hot_us(gather))
    bt.apply_staged_writes(impl="seed")             # the fast gather now reads counts via UVA
    gather = lambda: bt.gather_block_tables(batch.idx_mapping, impl="fast", check=False)
    row("gather_block_tables  [fast, UVA counts]", eager=vb.gpu_us(gather), graph=vb.graph_us(gather),
        hot=vb.hot_us(gather))
    bt.apply_staged_writes(impl="fast")
    bt.gather_block_tables(batch.idx_mapping)
    for impl, via_idx in (("seed", False), ("fast", False), ("seed", True), ("fast", True)):
        idx = batch.idx_mapping if via_idx else None
        slots = lambda impl=impl, idx=idx: bt.compute_slot_mappings(
            batch.query_start_loc, batch.positions, idx_mapping=idx, impl=impl, check=False)
        label = f"compute_slot_mappings [{impl}{', idx_mapping' if via_idx else ''}]"
        row(label, eager=vb.gpu_us(slots), graph=vb.graph_us(slots), hot=vb.hot_us(slots))
    if tokens == 1:
        checked = lambda: bt.compute_slot_mappings(batch.query_start_loc, batch.positions)
        unchecked = lambda: bt.compute_slot_mappings(batch.query_start_loc, batch.positions, check=False)
        row("slot mapping wall clock [fast] check=True", wall=vb.wall_us(lambda i: checked()))
        row("slot mapping wall clock [fast] check=False", wall=vb.wall_us(lambda i: unchecked()))
    if opts.sweep:
        for bt_tokens in (64, 128, 256, 512):
            bt.slot_block_tokens = bt_tokens
            slots = lambda: bt.compute_slot_mappings(batch.query_start_loc, batch.positions, check=False)
            row(f"  sweep slot BLOCK_TOKENS={bt_tokens}", eager=vb.gpu_us(slots), graph=vb.graph_us(slots))
        bt.slot_block_tokens = 128
        for rows, cols in ((2, 128), (4, 128), (8, 128), (4, 256), (1, 256)):
            bt.gather_rows, bt.gather_block_cols = rows, cols
            gather = lambda: bt.gather_block_tables(batch.idx_mapping, check=False)
            row(f"  sweep gather ROWS={rows} BLOCK_COLS={cols}", eager=vb.gpu_us(gather), graph=vb.graph_us(gather))
        bt.gather_rows, bt.gather_block_cols = 4, 128
    del bt, batch


def section_2(opts) -> None:
    """[2] the whole per-step path, two groups (the issue's measure)."""
    from paged_attention.v2 import bench as vb
    print("\n[2] the whole per-step v2 path, two groups (block sizes 16, 32), 1024 requests x 16 tokens")
    print("    = 16384 tokens; each step 64 requests get a block in group 0 and 32 in group 1.")
    print("    whole path = apply (all groups' staged writes) + gather + slot mappings, the device launches")
    print("    only (the step's writes are staged once, and every call applies them again);")
    print("    queued: as eager, the host's launch work hidden behind a GPU sleep (GPU time alone);")
    print("    host: Python time to issue the launches; wall: a real step, host staging included")
    for impl, fused in (("seed", False), ("fast", False), ("fast", True)):
        name = f"{impl}{', fused gather+slots' if fused else ''}"
        bt, batch = vb.build([16, 32], 1024, 16, 2048, impl=impl)
        assert vb.same_results(bt, batch), "seed and fast kernels disagree"
        whole = vb.v2_whole_device_path(bt, batch, impl, (64, 32), fused=fused)
        row(f"whole path [{name}]", eager=vb.gpu_us(whole), graph=vb.graph_us(whole), hot=vb.hot_us(whole),
            queued=vb.queued_us(whole), host=vb.host_us(whole))
        part = vb.v2_fused_device_step(bt, batch) if fused else vb.v2_device_step(bt, batch, impl)
        row(f"  gather + slots only [{name}]", eager=vb.gpu_us(part), graph=vb.graph_us(part),
            hot=vb.hot_us(part), queued=vb.queued_us(part), host=vb.host_us(part))
        if impl == "fast" and opts.sweep:
            # The staged writes' launch under capture: programs x tiles of writes (the
            # defaults are capture_write_programs / capture_write_rows).
            whole = vb.v2_whole_device_path(bt, batch, impl, (64, 32), fused=fused)
            defaults = bt.capture_write_programs, bt.capture_write_rows
            for programs, rows in ((1, 128), (2, 64), (4, 32), (4, 64), (8, 16), (3, 32), (6, 16)):
                bt.capture_write_programs, bt.capture_write_rows = programs, rows
                row(f"  sweep capture programs={programs} rows={rows}", graph=vb.graph_us(whole))
            bt.capture_write_programs, bt.capture_write_rows = defaults
        del bt, batch
        bt, batch = vb.build([16, 32], 1024, 16, 2048, impl=impl)
        row(f"  wall clock, a real step [{name}]",
            wall=vb.wall_us(vb.v2_full_step(bt, batch, impl, (64, 32), fused=fused), n=100))
        del bt, batch


def section_3() -> None:
    """[3] v1's decode step next to v2's, wall clock."""
    from paged_attention.v2 import bench as vb
    print("\n[3] one decode step (1 token per request, one group of block size 16), wall clock;")
    print("    a sixteenth of the requests get a new block each step")
    for num_reqs in (8, 32, 128, 512, 1024):
        appends = max(1, num_reqs // 16)
        v1 = vb.v1_step(num_reqs, 1, 2048, appends)
        cols = {"v1": vb.wall_us(v1)}
        for impl in ("seed", "fast"):
            bt, batch = vb.build([16], num_reqs, 1, 2048, impl=impl)
            cols[f"v2-{impl}"] = vb.wall_us(vb.v2_full_step(bt, batch, impl, (appends,)))
            del bt, batch
        row(f"{num_reqs:5d} requests", **cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
