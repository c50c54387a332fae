"""Decode context parallelism on N GPUs (NCCL) against one GPU over the same whole context.

Usage (a machine with N >= 2 NVIDIA GPUs):

    python benchmarks/bench_dcp.py --world-size 2 --log dcp.log

For each (batch, context) shape, bf16, 32 query / 8 KV heads of 128, blocks of 16 (a Llama-3-8B
layer), in one run:

* every rank writes its share of the batch's KV cache through the v1 table's DCP slot mapping,
  and rank 0 also writes the whole context into a single-GPU cache;
* one GPU: the Triton decode over the whole context (rank 0; the others wait);
* DCP: every rank's Triton decode over its share with log-sum-exps, the NCCL all-gather of
  outputs and log-sum-exps, the merge (``dcp_decode_attention``), timed on every rank, the
  slowest rank's time reported; and the partial decode alone (no communication);
* each eagerly and replayed from a CUDA graph (as served decode steps are), L2 flushed before
  every run (``bench.time_ms``); ratio = one GPU's time / DCP's time (above 1: DCP is faster).

Correctness first: the DCP output must equal the single-GPU output, be the same on every rank,
and match the float64 oracle on the first sequence of each shape (the run stops otherwise).

``--cpu-smoke`` runs the same code on CPU processes (gloo, Triton's interpreter, tiny shapes,
no timing): a check that the script works, on any machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import paged_attention  # noqa: F401  (device policy first)
from paged_attention.distributed import (
    DcpDecodeProblem, dcp_decode_attention, get_dcp_local_seq_lens, partial_decode_attention, spawn,
    write_rank_cache,
)

MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
SHAPES = ((1, 32768), (1, 131072), (4, 32768), (4, 65536), (4, 131072), (16, 32768),
          (16, 131072))
SMOKE_MODEL = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=torch.float32)
SMOKE_SHAPES = ((1, 37), (3, 100))


def _parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        shapes = tuple(tuple(int(x) for x in item.split("x")) for item in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(
            f"shapes are BATCHxCONTEXT,...: e.g. 1x32768,4x65536; got {text!r}")
    return shapes


class Log:
    """Rank 0's lines, to stdout and (appended) to the log file, flushed as they come."""

    def __init__(self, path: str | None, active: bool) -> None:
        self.file = open(path, "a") if path and active else None
        self.active = active

    def __call__(self, line: str = "") -> None:
        if self.active:
            print(line, flush=True)
            if self.file:
                self.file.write(line + "\n")
                self.file.flush()


def _graph_ms(fn, rep: int) -> float:
    """``time_ms`` of ``fn`` captured once in a CUDA graph and replayed. The capture is
    thread-local, so that the NCCL watchdog thread may keep querying its events meanwhile."""
    from paged_attention.bench import time_ms

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return time_ms(graph.replay, rep)


def _slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _same_on_every_rank(out: torch.Tensor) -> bool:
    mine = out.float().flatten()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], x) for x in every)


def _bench_rank(rank: int, world: int, shapes, interleave: int, rep: int, graphs: bool,
                log_path: str | None, smoke: bool) -> list[dict]:
    """One rank of the benchmark: every shape in turn; rank 0 prints and logs."""
    from paged_attention.bench import warm_up

    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    log = Log(log_path, rank == 0)
    names = [None] * world
    dist.all_gather_object(names, "CPU process" if smoke else torch.cuda.get_device_name(device))
    log(f"DCP decode over {world} ranks ({dist.get_backend()}): "
        + ", ".join(f"rank {r}: {n}" for r, n in enumerate(names)))
    if not smoke:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")
        warm_up(1.0)
    model = SMOKE_MODEL if smoke else MODEL
    dtype = str(model["dtype"]).replace("torch.", "")
    log(f"{model['num_heads']} query / {model['num_kv_heads']} KV heads of {model['head_size']}, "
        f"blocks of {model['block_size']}, {dtype}, interleave {interleave}")
    if not smoke:
        log(f"times in microseconds (median of {rep}, L2 flushed before each run; DCP: the slowest "
            f"rank); ratio = one GPU / DCP (above 1: DCP is faster); partial = a rank's decode "
            f"alone, no exchange")
        log(f"{'batch':>5} {'context':>8} | {'1 GPU':>9} {'DCP':>9} {'ratio':>6} {'partial':>9} | "
            f"{'1 GPU graph':>11} {'DCP graph':>10} {'ratio':>6} | {'max |DCP-1GPU|':>14}")
    rows = []
    for batch, context in shapes:
        t0 = time.perf_counter()
        row = _bench_shape(rank, world, device, batch, context, model, interleave, rep, graphs,
                           smoke)
        row["gpus"] = names
        rows.append(row)
        if rank == 0:
            log(_row_line(row, smoke, time.perf_counter() - t0))
        if not smoke:
            torch.cuda.empty_cache()
    return rows


def _row_line(row: dict, smoke: bool, seconds: float) -> str:
    shape = f"{row['batch']:>5} {row['context']:>8} | "
    if smoke:
        return shape + (f"checked: DCP == one rank == float64 oracle "
                        f"(max |DCP-1|: {row['max_diff']:.2e})")
    return (shape + f"{row['one_us']:>9.1f} {row['dcp_us']:>9.1f} {row['ratio']:>6.2f} "
            f"{row['partial_us']:>9.1f} | {row['one_graph_us']:>11.1f} "
            f"{row['dcp_graph_us']:>10.1f} {row['graph_ratio']:>6.2f} | "
            f"{row['max_diff']:>14.2e}   ({seconds:.0f} s)")


def _bench_shape(rank: int, world: int, device: torch.device, batch: int, context: int,
                 model: dict, interleave: int, rep: int, graphs: bool, smoke: bool) -> dict:
    """Check, then time, one (batch, context): DCP on every rank, one GPU on rank 0."""
    from paged_attention.bench import time_ms
    from paged_attention.kernels.triton import paged_attention_decode
    from paged_attention.kernels.workloads import assert_close_to_oracle

    problem = DcpDecodeProblem((context,) * batch, interleave=interleave, seed=batch + context,
                               spare_blocks=0, **model)
    seq_lens = torch.tensor(problem.seq_lens, dtype=torch.int32, device=device)
    query = problem.query(device)
    share = write_rank_cache(problem, world, rank, device, "triton")
    kv = (query, share.key_cache, share.value_cache, share.block_tables)
    local = get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
    local_max = int(local.max())

    def dcp_step():
        return dcp_decode_attention(*kv, seq_lens, problem.scale, interleave=interleave,
                                    impl="triton", max_seq_len=context, check_ids=False)

    def partial_step():
        return partial_decode_attention(*kv, local, problem.scale, impl="triton",
                                        max_seq_len=local_max, check_ids=False)

    row = dict(batch=batch, context=context, world=world)
    out_dcp = dcp_step()
    if rank == 0:
        whole = write_rank_cache(problem, 1, 0, device, "triton")
        out_one = torch.empty_like(query)

        def one_gpu():
            paged_attention_decode(out_one, query, whole.key_cache, whole.value_cache,
                                   whole.block_tables, seq_lens, problem.scale,
                                   max_seq_len=context, check_ids=False)

        one_gpu()
        oracle, _ = problem.dense_reference(device, seqs=[0])
        assert_close_to_oracle(out_one[:1], oracle, "one GPU")
        assert_close_to_oracle(out_dcp[:1], oracle, "DCP")
        row["max_diff"] = diff = float((out_dcp.float() - out_one.float()).abs().max())
        if diff > (1e-5 if problem.dtype == torch.float32 else 1.5e-2):
            raise AssertionError(f"DCP differs from one GPU by {diff} at batch {batch}, "
                                 f"context {context}")
    if not _same_on_every_rank(out_dcp):
        raise AssertionError("the ranks' merged outputs differ")
    if smoke:
        return row

    nan = float("nan")
    dist.barrier()
    if rank == 0:
        row["one_us"] = 1e3 * time_ms(one_gpu, rep)
        row["one_graph_us"] = 1e3 * _graph_ms(one_gpu, rep) if graphs else nan
    dist.barrier()
    row["partial_us"] = _slowest(1e3 * time_ms(partial_step, rep), device)
    row["dcp_us"] = _slowest(1e3 * time_ms(dcp_step, rep), device)
    row["dcp_graph_us"] = _slowest(1e3 * _graph_ms(dcp_step, rep), device) if graphs else nan
    if rank == 0:
        row["ratio"] = row["one_us"] / row["dcp_us"]
        row["graph_ratio"] = row["one_graph_us"] / row["dcp_graph_us"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks, one GPU each (default 2)")
    parser.add_argument("--shapes", type=_parse_shapes, default=None,
                        help="BATCHxCONTEXT,... (default: "
                        + ",".join(f"{b}x{c}" for b, c in SHAPES) + ")")
    parser.add_argument("--interleave", type=int, default=1,
                        help="DCP interleave size (default 1, as vLLM's)")
    parser.add_argument("--rep", type=int, default=50,
                        help="timed runs per measurement (default 50)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    parser.add_argument("--log", default=None, help="also append the results to this file")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU processes (gloo, Triton interpreter), checks only")
    opts = parser.parse_args()
    if opts.world_size < 2:
        parser.error("--world-size must be at least 2")
    if opts.interleave < 1 or 16 % opts.interleave:
        parser.error("--interleave must divide the block size, 16")
    smoke = opts.cpu_smoke
    if not smoke and torch.cuda.device_count() < opts.world_size:
        print(f"this benchmark needs {opts.world_size} NVIDIA GPUs, one per rank; this machine has "
              f"{torch.cuda.device_count()} (--cpu-smoke checks the script on CPU processes)")
        return 1
    shapes = opts.shapes or (SMOKE_SHAPES if smoke else SHAPES)
    interleave = min(opts.interleave, SMOKE_MODEL["block_size"]) if smoke else opts.interleave
    if smoke:
        os.environ["PAGED_ATTENTION_DEVICE"] = "cpu"    # the ranks take the CPU path on any machine
    start = time.perf_counter()
    spawn(_bench_rank, opts.world_size, shapes, interleave, opts.rep, not opts.no_graphs,
          opts.log, smoke, backend="gloo" if smoke else "nccl", timeout_s=600)
    line = f"done in {time.perf_counter() - start:.0f} s"
    print(line)
    if opts.log:
        with open(opts.log, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
