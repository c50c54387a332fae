"""Decode context parallelism on N GPUs (NCCL) against one GPU over the same whole context.

Usage (a machine with N >= 2 NVIDIA GPUs):

    python benchmarks/bench_dcp.py --world-size 2 --log dcp.log --markdown dcp.md

For each (batch, context) shape, bf16, 32 query / 8 KV heads of 128, blocks of 16 (a Llama-3-8B
layer), in one run:

* every rank writes its share of the batch's KV cache through the v1 table's DCP slot mapping,
  and rank 0 also writes the whole context into a single-GPU cache;
* one GPU: the Triton decode over the whole context, a kept ``DecodePlan`` (rank 0; the others
  wait);
* DCP: a kept ``DcpDecodePlan`` on every rank: the decode over the rank's share with
  log-sum-exps, one NCCL all-gather of outputs and log-sum-exps, the Triton merge; the slowest
  rank's time is reported. The rank's token counts are computed once per step, outside the
  timed call, as vLLM's attention metadata does for all layers (and as the one GPU is given its
  ``seq_lens``). ``partial``: the same decode launches alone, no exchange;
* each eagerly and replayed from a CUDA graph (as served decode steps are); ratio = one GPU's
  time / DCP's time (above 1: DCP is faster); ``host``: the host's time per eager call (Python
  and launches): where it exceeds the GPU's time, the eager figure is the host's.

The timer. Every timed run starts from the same state on every rank: all GPUs idle and the
hosts released together by a barrier (over a gloo group: the hosts only), then the L2 cache is
flushed (a 256 MB write, so that the step reads its caches from memory), and two CUDA events
bracket the step on each rank; the barrier and the flush lie outside the events. Median of
``--rep`` runs. (The first version timed each rank with ``bench.time_ms``, runs back to back and
never aligned: a rank's figure could then include waiting in the all-gather for the other
rank's host, however far behind it ran, which is no part of the step.)

Correctness first: the DCP output must equal the single-GPU output, be the same on every rank,
be what ``dcp_decode_attention`` (the checked call) returns, and match the float64 oracle on the
first sequence of each shape (the run stops otherwise).

The first lines name the machine (each rank's GPU, the host CPU, the software). ``--markdown
PATH`` also writes the figures as a markdown table headed by the machine, the command and the
date, for the README. ``--cpu-smoke`` runs the same code on CPU processes (gloo, Triton's
interpreter, tiny shapes, no timing): a check that the script works, on any machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import paged_attention  # noqa: F401  (device policy first)
from paged_attention.distributed import (
    DcpDecodePlan, DcpDecodeProblem, dcp_decode_attention, get_dcp_local_seq_lens, spawn,
    write_rank_cache,
)

MODEL = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
SHAPES = ((1, 32768), (1, 131072), (4, 32768), (4, 65536), (4, 131072), (16, 32768),
          (16, 131072))
SMOKE_MODEL = dict(num_heads=4, num_kv_heads=2, head_size=16, block_size=8, dtype=torch.float32)
SMOKE_SHAPES = ((1, 37), (3, 100))
HOST_CALLS = 10                          # eager calls per host-time batch (best of 3 batches)


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


# ---- Timing --------------------------------------------------------------------------------------

def _time_us(fn, rep: int, align) -> float:
    """Median microseconds of ``fn`` on this rank's GPU over ``rep`` runs, each started by
    ``align()`` (GPUs idle, hosts together) and an L2 flush, both outside the timed events."""
    flush = torch.empty(256 << 20 >> 2, dtype=torch.float32, device="cuda")
    for _ in range(min(25, rep)):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(rep)]
    for start, end in events:
        align()
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in events)


def _host_us(fn, align) -> float:
    """The host's microseconds per call of ``fn`` (Python and launches, not waiting for the GPU):
    the best of three batches of ``HOST_CALLS`` calls."""
    best = float("inf")
    for _ in range(3):
        align()
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        best = min(best, (time.perf_counter() - t0) / HOST_CALLS)
    torch.cuda.synchronize()
    return 1e6 * best


def _graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph. The capture is thread-local, so that the NCCL watchdog
    thread may keep querying its events meanwhile."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph


def _slowest(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _same_on_every_rank(out: torch.Tensor) -> bool:
    mine = out.float().flatten()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], x) for x in every)


# ---- One rank ------------------------------------------------------------------------------------

def _machine(world: int, smoke: bool) -> dict:
    """What this run ran on: every rank's device, the host CPU, the software (on every rank)."""
    import triton

    from paged_attention.bench import cpu_name

    names = [None] * world
    dist.all_gather_object(names, "CPU process" if smoke else torch.cuda.get_device_name())
    info = dict(devices=names, cpu=cpu_name(), torch=torch.__version__, triton=triton.__version__,
                backend=dist.get_backend())
    if not smoke:
        version = torch.cuda.nccl.version()
        info.update(cuda=torch.version.cuda,
                    nccl=".".join(map(str, version)) if isinstance(version, tuple) else str(version))
    return info


def _device(rank: int, smoke: bool) -> torch.device:
    return torch.device("cpu") if smoke else torch.device("cuda", rank)


def _bench_rank(rank: int, world: int, shapes, interleave: int, rep: int, graphs: bool,
                log_path: str | None, smoke: bool) -> dict:
    """One rank of the benchmark: every shape in turn; rank 0 prints and logs."""
    device = _device(rank, smoke)
    log = Log(log_path, rank == 0)
    machine = _machine(world, smoke)
    log(f"DCP decode over {world} ranks ({machine['backend']}): "
        + ", ".join(f"rank {r}: {n}" for r, n in enumerate(machine["devices"])))
    log(f"host CPU: {machine['cpu']}")
    software = f"torch {machine['torch']}, Triton {machine['triton']}"
    if not smoke:
        software += f", CUDA {machine['cuda']}, NCCL {machine['nccl']}"
    log(software)
    model = SMOKE_MODEL if smoke else MODEL
    dtype = str(model["dtype"]).replace("torch.", "")
    log(f"{model['num_heads']} query / {model['num_kv_heads']} KV heads of {model['head_size']}, "
        f"blocks of {model['block_size']}, {dtype}, interleave {interleave}")
    host_group = None
    if not smoke:
        from paged_attention.bench import warm_up

        host_group = dist.new_group(backend="gloo")     # the per-run barrier: hosts only
        warm_up(1.0)
        log(f"times in microseconds: median of {rep} runs, each started with every GPU idle and "
            f"the ranks' hosts together, L2 flushed (DCP: the slowest rank); ratio = one GPU / "
            f"DCP (above 1: DCP is faster); partial = a rank's decode alone, no exchange; host = "
            f"host time per eager call")
        log(f"{'batch':>5} {'context':>8} | {'1 GPU':>8} {'DCP':>8} {'ratio':>6} {'partial':>8} | "
            f"{'1 GPU host':>10} {'DCP host':>9} | {'1 GPU graph':>11} {'DCP graph':>10} "
            f"{'ratio':>6} | {'max |DCP-1GPU|':>14}")
    rows = []
    for batch, context in shapes:
        t0 = time.perf_counter()
        row = _bench_shape(rank, world, device, batch, context, model, interleave, rep, graphs,
                           smoke, host_group)
        rows.append(row)
        if rank == 0:
            log(_row_line(row, smoke, time.perf_counter() - t0))
        if not smoke:
            torch.cuda.empty_cache()
    return dict(machine=machine, rows=rows, model=model, interleave=interleave, rep=rep)


def _row_line(row: dict, smoke: bool, seconds: float) -> str:
    shape = f"{row['batch']:>5} {row['context']:>8} | "
    if smoke:
        return shape + (f"checked: DCP == one rank == dcp_decode_attention == float64 oracle "
                        f"(max |DCP-1|: {row['max_diff']:.2e})")
    return (shape + f"{row['one_us']:>8.1f} {row['dcp_us']:>8.1f} {row['ratio']:>6.2f} "
            f"{row['partial_us']:>8.1f} | {row['one_host_us']:>10.1f} {row['dcp_host_us']:>9.1f} | "
            f"{row['one_graph_us']:>11.1f} {row['dcp_graph_us']:>10.1f} {row['graph_ratio']:>6.2f} | "
            f"{row['max_diff']:>14.2e}   ({seconds:.0f} s)")


def _bench_shape(rank: int, world: int, device: torch.device, batch: int, context: int,
                 model: dict, interleave: int, rep: int, graphs: bool, smoke: bool,
                 host_group) -> dict:
    """Check, then time, one (batch, context): DCP on every rank, one GPU on rank 0."""
    from paged_attention.kernels.triton.decode import DecodePlan
    from paged_attention.kernels.workloads import assert_close_to_oracle

    problem = DcpDecodeProblem((context,) * batch, interleave=interleave, seed=batch + context,
                               spare_blocks=0, **model)
    seq_lens = torch.tensor(problem.seq_lens, dtype=torch.int32, device=device)
    query = problem.query(device)
    share = write_rank_cache(problem, world, rank, device, "triton")
    kv = (share.key_cache, share.value_cache, share.block_tables)
    # Once per step, for every layer (vLLM's attention metadata): this rank's token counts.
    local = get_dcp_local_seq_lens(seq_lens, world, rank, interleave)
    out_dcp = torch.empty_like(query)
    plan = DcpDecodePlan(query, *kv, local, problem.scale, out=out_dcp,
                         max_seq_len=int(local.max()), check_ids=False)

    def dcp_step():
        plan.run(out_dcp, query, *kv, local)

    def partial_step():
        plan.run_partial(query, *kv, local)

    row = dict(batch=batch, context=context, world=world)
    dcp_step()
    checked = dcp_decode_attention(query, *kv, seq_lens, problem.scale, interleave=interleave,
                                   max_seq_len=context)
    if rank == 0:
        whole = write_rank_cache(problem, 1, 0, device, "triton")
        one_kv = (whole.key_cache, whole.value_cache, whole.block_tables)
        out_one = torch.empty_like(query)
        one = DecodePlan(query, *one_kv, seq_lens, problem.scale, out=out_one, max_seq_len=context,
                         check_ids=False)

        def one_gpu():
            one.run(out_one, query, *one_kv, seq_lens)

        one_gpu()
        oracle, _ = problem.dense_reference(device, seqs=[0])
        assert_close_to_oracle(out_one[:1], oracle, "one GPU")
        assert_close_to_oracle(out_dcp[:1], oracle, "DCP")
        row["max_diff"] = diff = float((out_dcp.float() - out_one.float()).abs().max())
        if diff > (1e-5 if problem.dtype == torch.float32 else 1.5e-2):
            raise AssertionError(f"DCP differs from one GPU by {diff} at batch {batch}, "
                                 f"context {context}")
    if not torch.equal(checked, out_dcp):
        raise AssertionError("the kept plan and dcp_decode_attention differ")
    if not _same_on_every_rank(out_dcp):
        raise AssertionError("the ranks' merged outputs differ")
    if smoke:
        return row

    def align():                           # every GPU idle, then the hosts meet
        torch.cuda.synchronize()
        dist.barrier(group=host_group)

    nan = float("nan")
    align()
    if rank == 0:
        row["one_us"] = _time_us(one_gpu, rep, torch.cuda.synchronize)
        row["one_host_us"] = _host_us(one_gpu, torch.cuda.synchronize)
        row["one_graph_us"] = (_time_us(_graph(one_gpu).replay, rep, torch.cuda.synchronize)
                               if graphs else nan)
    align()
    row["partial_us"] = _slowest(_time_us(partial_step, rep, align), device)
    row["dcp_us"] = _slowest(_time_us(dcp_step, rep, align), device)
    row["dcp_host_us"] = _slowest(_host_us(dcp_step, align), device)
    row["dcp_graph_us"] = (_slowest(_time_us(_graph(dcp_step).replay, rep, align), device)
                           if graphs else nan)
    if rank == 0:
        row["ratio"] = row["one_us"] / row["dcp_us"]
        row["graph_ratio"] = row["one_graph_us"] / row["dcp_graph_us"]
    return row


# ---- The markdown table --------------------------------------------------------------------------

def markdown(result: dict, command: str, smoke: bool) -> str:
    """The run as a markdown table, headed by what it ran on, the command and the date."""
    m, model = result["machine"], result["model"]
    devices = m["devices"]
    if len(set(devices)) == 1:
        where = f"{len(devices)} × {devices[0]}"
    else:
        where = ", ".join(f"rank {r}: {n}" for r, n in enumerate(devices))
    software = f"torch {m['torch']}, Triton {m['triton']}"
    if not smoke:
        software += f", CUDA {m['cuda']}, NCCL {m['nccl']}"
    dtype = str(model["dtype"]).replace("torch.", "")
    lines = [
        f"One run of `{command}` on {where} ({m['backend']}), host CPU {m['cpu']}; {software}; "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"{model['num_heads']} query / {model['num_kv_heads']} KV heads of {model['head_size']}, "
        f"blocks of {model['block_size']}, {dtype}, interleave {result['interleave']}. "
        + ("CPU smoke run: checks only, no timings." if smoke else
           f"Microseconds, median of {result['rep']} runs, each started with every GPU idle and "
           f"the ranks' hosts together, L2 flushed; DCP: the slowest rank; ratio = one GPU / DCP "
           f"(above 1: DCP is faster); partial: a rank's decode alone; host: host time per eager "
           f"call."),
        "",
        "| batch | context | 1 GPU | DCP | ratio | partial | 1 GPU host | DCP host "
        "| 1 GPU graph | DCP graph | graph ratio | max \\|DCP − 1 GPU\\| |",
        "|" + "---:|" * 12,
    ]
    for row in result["rows"]:
        def f(key, spec=".1f"):
            return "–" if key not in row else format(row[key], spec)

        lines.append(
            f"| {row['batch']} | {row['context']} | {f('one_us')} | {f('dcp_us')} | "
            f"{f('ratio', '.2f')} | {f('partial_us')} | {f('one_host_us')} | "
            f"{f('dcp_host_us')} | {f('one_graph_us')} | {f('dcp_graph_us')} | "
            f"{f('graph_ratio', '.2f')} | {f('max_diff', '.2e')} |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="write the results as a markdown table (machine, command, date)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes on CPU processes (gloo, Triton interpreter), checks only")
    opts = parser.parse_args()
    if opts.world_size < 2:
        parser.error("--world-size must be at least 2")
    if opts.interleave < 1 or 16 % opts.interleave:
        parser.error("--interleave must divide the block size, 16")
    if opts.rep < 1:
        parser.error("--rep must be at least 1")
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
    results = spawn(_bench_rank, opts.world_size, shapes, interleave, opts.rep,
                    not opts.no_graphs, opts.log, smoke, backend="gloo" if smoke else "nccl",
                    timeout_s=600)
    line = f"done in {time.perf_counter() - start:.0f} s"
    print(line)
    if opts.log:
        with open(opts.log, "a") as f:
            f.write(line + "\n")
    if opts.markdown:
        command = "python " + " ".join(sys.argv)
        with open(opts.markdown, "w") as f:
            f.write(markdown(results[0], command, smoke))
        print(f"markdown table written to {opts.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
