"""The engine against Hugging Face transformers, a random-length workload, and the engine's ablation.

Usage (GPU machine, bf16, about 5 minutes):
    python benchmarks/bench_engine.py --out DIR [--core v1|v0] [--no-async] [--no-graphs]
        [--requests 1,16,64,256] [--prompt-len 128] [--max-tokens 128] [--skip-static] [--skip-hf]
        [--skip-nano] [--skip-ablation] [--skip-memory]
    python benchmarks/bench_engine.py --smoke --out DIR     (a tiny CPU run: does the script work?)

One process runs, in order:

1. for each number of requests, the engine (``LLM``; by default the V1 core with async scheduling
   and CUDA-graph decode steps) and transformers' ``generate`` with its dynamic and its static
   cache, on the same random 128-token prompts, each generating exactly ``--max-tokens`` tokens;
   per engine run, the host's time per decode step, its Python time per request and step, and
   the GPU's idle time between decode steps as a share of the step (CUDA events). Each of the
   three is timed ``--repeats`` times, taking turns (other prompts each round), and each one's
   median run is reported: a host's slow stretch (these machines have them, lasting seconds)
   then lands on one or two rounds of one side, not on the figure (five rounds by default: with
   three, two slow rounds of one side in a run had made its figure);
2. nano-vllm's workload: 256 requests, prompt and output lengths random in 100..1024;
3. the ablation at 256 requests: V0 synchronous, then V1, then async scheduling, then CUDA
   graphs, each adding one thing: tokens/s and where a decode step's time goes;
4. the memory question: requests held at once by a 1 GiB KV budget, paged against contiguous.

Everything printed goes to ``DIR/bench_engine.log`` too, and every figure to
``DIR/bench_engine.json`` (notebook 08 draws the ablation from it). The issue's goals: at least 5x
transformers' best at 64 and 256 requests; at least 1,000 tokens/s for one request (against the
limit of reading the weights once a step); GPU idle below 10% of a step at 64 and 256.
Figures are only comparable within one run.
"""
import argparse
import gc
import json
import os
import sys
import time

import torch

import paged_attention  # noqa: F401  (device policy first)
from paged_attention import runtime


class _Tee:
    """Print to the terminal and to the log file."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "w")

    def __call__(self, *args) -> None:
        line = " ".join(str(a) for a in args)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def _free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def _pct(x) -> str:
    return "   -" if x is None or x != x else f"{100 * x:4.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out", help="directory for bench_engine.log and bench_engine.json")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--requests", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of part 1 (engine, dynamic, static in turn); each side's median run is reported")
    parser.add_argument("--core", choices=("v1", "v0"), default="v1", help="the engine's core for parts 1 and 2")
    parser.add_argument("--no-async", action="store_true", help="synchronous scheduling (V0 always is)")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode steps")
    parser.add_argument("--block-tables", default="auto", help="auto, v2, v2-vllm or v1")
    parser.add_argument("--skip-static", action="store_true", help="skip transformers' static cache")
    parser.add_argument("--skip-hf", action="store_true", help="time the engine only")
    parser.add_argument("--skip-nano", action="store_true")
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--nano-requests", type=int, default=256)
    parser.add_argument("--nano-lens", default="100,1024", help="min,max prompt and output length")
    parser.add_argument("--ablation-requests", type=int, default=256)
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: a section that would start later is skipped (the JSON keeps what ran)")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run in fp32 (checks the script)")
    opts = parser.parse_args()
    if opts.repeats < 1:
        parser.error("--repeats must be at least 1")
    os.makedirs(opts.out, exist_ok=True)
    log = _Tee(os.path.join(opts.out, "bench_engine.log"))

    from paged_attention.bench.engine import (kv_capacity, load_transformers, make_prompts, random_workload,
                                              run_ablation, run_engine, run_transformers)
    from paged_attention.bench.timing import cpu_name, host_probe_us
    from paged_attention.engine import LLM

    started = time.perf_counter()

    def in_time(what: str) -> bool:
        if opts.time_limit is None or time.perf_counter() - started < opts.time_limit:
            return True
        log(f"# skipped (past --time-limit {opts.time_limit:.0f} s): {what}")
        return False

    def save() -> None:
        results["seconds"] = time.perf_counter() - started
        for path in [os.path.join(opts.out, "bench_engine.json")] + ([opts.json] if opts.json else []):
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    engine_kw = dict(core=opts.core, async_scheduling=None if opts.core == "v0" else not opts.no_async,
                     cuda_graphs=not opts.no_graphs, block_tables=opts.block_tables, record_gpu_time=True)
    if opts.smoke:
        device, dtype, sizes = torch.device("cpu"), torch.float32, [1, 2]
        opts.prompt_len, opts.max_tokens, opts.skip_static = 16, 4, True
        opts.nano_requests, opts.nano_lens, opts.ablation_requests = 3, "4,12", 2
        base_kw = dict(device="cpu", num_gpu_blocks=64, max_num_seqs=4)
        memory_budget = 64 << 20
    else:
        if not torch.cuda.is_available():
            print("this benchmark needs an NVIDIA GPU (or --smoke for a CPU check of the script)")
            return 1
        device, dtype = runtime.DEVICE, torch.bfloat16
        sizes = [int(n) for n in opts.requests.split(",")]
        base_kw = dict(dtype=dtype, max_num_seqs=max(sizes + [opts.nano_requests, opts.ablation_requests]),
                       kv_cache_memory=16 << 30, num_cpu_blocks=0, record_block_owners=False)
        memory_budget = 1 << 30
    import transformers
    results = {"device": runtime.device_name(), "dtype": str(dtype), "torch": torch.__version__,
               "transformers": transformers.__version__, "prompt_len": opts.prompt_len,
               "max_tokens": opts.max_tokens, "engine_config": {k: v for k, v in engine_kw.items()}, "rows": []}
    log(f"# {results['device']}, torch {torch.__version__}, transformers {transformers.__version__}, {dtype}, "
        f"prompts of {opts.prompt_len} tokens, {opts.max_tokens} new tokens each; engine: core {opts.core}, "
        f"async {engine_kw['async_scheduling'] is not False}, graphs {not opts.no_graphs}, "
        f"tables {opts.block_tables}")
    results["host"] = {"cpu": cpu_name(), "probe_us": host_probe_us()}
    log(f"# host: {results['host']['cpu']}; a pure-Python probe (256 objects' attributes and a dict, "
        f"the best of five) takes {results['host']['probe_us']:.1f} us, measured again before every engine round")

    llm = LLM(**base_kw, **engine_kw)
    model, tokenizer, config = llm.model, llm.tokenizer, llm.config
    if device.type == "cuda":
        from paged_attention.bench.timing import copy_bandwidth
        weight_bytes = sum(t.numel() * t.element_size() for t in
                           [model.embed_tokens, model.norm] + [w for layer in model.layers for w in layer.values()]
                           + ([] if model.lm_head is model.embed_tokens else [model.lm_head]))
        bandwidth = copy_bandwidth()
        results["weights"] = {"bytes": weight_bytes, "copy_bandwidth": bandwidth,
                              "tokens_per_s_limit_1_request": bandwidth / 2 / weight_bytes}
        log(f"# weights {weight_bytes / 1e6:.0f} MB; a device copy reads at {bandwidth / 2e9:.0f} GB/s, so one "
            f"request's decode cannot beat {bandwidth / 2 / weight_bytes:,.0f} tokens/s (the weights read once a step)")

    # 1. Against transformers.
    hf = None if opts.skip_hf else load_transformers(dtype, device)
    log(f"{'requests':>8} {'engine tok/s':>12} {'ms/step':>8} {'host ms':>8} {'py us/seq':>9} {'GPU idle':>8} "
        f"{'graphs':>7} {'HF dyn tok/s':>12} {'HF static':>10} {'engine/best HF':>14}")
    for n in sizes:
        if not in_time(f"{n} requests"):
            continue
        runs: dict[str, list] = {}
        probes = []
        for r in range(opts.repeats):
            # Other prompts each round (none a prefix-cache hit of the round before); both
            # sides get the same ones.
            prompts = make_prompts(n, opts.prompt_len, config.vocab_size, seed=n + 7919 * r)
            probes.append(host_probe_us())
            runs.setdefault("engine", []).append(run_engine(llm, prompts, opts.max_tokens))
            if hf is not None:
                runs.setdefault("hf_dynamic", []).append(run_transformers(hf, prompts, opts.max_tokens,
                                                                          warm_up=r == 0))
                if not opts.skip_static:
                    runs.setdefault("hf_static", []).append(run_transformers(hf, prompts, opts.max_tokens, "static",
                                                                             warm_up=r == 0))
        row = {"requests": n, "repeats": opts.repeats, "host_probe_us": probes}
        for side, done in runs.items():
            row[side] = median_run(done)
            row[f"{side}_tokens_per_s"] = [d["tokens_per_s"] for d in done]
        best = max((row[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if k in row), default=float("nan"))
        e = row["engine"]
        row["ratio_to_best_hf"] = e["tokens_per_s"] / best
        results["rows"].append(row)
        static = row.get("hf_static", {}).get("tokens_per_s", float("nan"))
        dynamic = row.get("hf_dynamic", {}).get("tokens_per_s", float("nan"))
        log(f"{n:>8} {e['tokens_per_s']:>12.0f} {e['ms_per_decode_step']:>8.2f} {e['host_ms']:>8.2f} "
            f"{e['python_us_per_seq']:>9.1f} {_pct(e.get('gpu_idle_share')):>8} "
            f"{e['cuda_graph_steps']:>3}/{e['decode_steps']:<3} {dynamic:>12.0f} {static:>10.0f} "
            f"{row['ratio_to_best_hf']:>13.1f}x")
        if opts.repeats > 1:
            other = [r.get("other_ms") for r in runs["engine"]]
            log("         rounds, tok/s: " + "; ".join(
                f"{side} " + " ".join(f"{t:.0f}" for t in row[f"{side}_tokens_per_s"]) for side in runs)
                + ("" if None in other else "; engine ms outside decode steps " + " ".join(f"{x:.1f}" for x in other))
                + "; host probe us " + " ".join(f"{x:.1f}" for x in probes))
        save()
    _free(hf)

    # 2. The ablation (the table's engine set aside first: each configuration brings its own).
    if not opts.skip_ablation and in_time("the ablation"):
        n = opts.ablation_requests
        prompts = make_prompts(n, opts.prompt_len, config.vocab_size, seed=3)
        abl_kw = {k: v for k, v in base_kw.items() if k not in ("device", "dtype")}
        rows = run_ablation(model, tokenizer, prompts, opts.max_tokens, record_gpu_time=True,
                            block_tables=opts.block_tables, **abl_kw)
        results["ablation"] = {"requests": n, "prompt_len": opts.prompt_len, "max_tokens": opts.max_tokens,
                               "rows": rows}
        log(f"# ablation, {n} requests of {opts.prompt_len} + {opts.max_tokens} tokens; ms per decode step:")
        log(f"{'':>22} {'tok/s':>8} {'step':>6} {'sched':>6} {'prep':>6} {'fwd':>6} {'sample':>6} {'wait':>6} "
            f"{'update':>6} {'GPU busy':>8} {'GPU idle':>8}")
        for r in rows:
            log(f"{r['name']:>22} {r['tokens_per_s']:>8.0f} {r['ms_per_decode_step']:>6.2f} {r['schedule_ms']:>6.2f} "
                f"{r['prepare_ms']:>6.2f} {r['forward_ms']:>6.2f} {r['sample_ms']:>6.2f} {r['wait_ms']:>6.2f} "
                f"{r['update_ms']:>6.2f} {r.get('gpu_busy_ms', float('nan')):>8.2f} "
                f"{_pct(r.get('gpu_idle_share')):>8}")
        save()

    # 3. nano-vllm's workload.
    if not opts.skip_nano and in_time("the nano-vllm workload"):
        lo, hi = (int(x) for x in opts.nano_lens.split(","))
        prompts, lens = random_workload(opts.nano_requests, lo, hi, config.vocab_size, seed=1)
        warm, _ = random_workload(opts.nano_requests, lo, hi, config.vocab_size, seed=2)
        e = run_engine(llm, prompts, lens, warm_prompts=warm)
        results["nano"] = {"requests": opts.nano_requests, "min_len": lo, "max_len": hi, "engine": e}
        log(f"# nano-vllm workload: {opts.nano_requests} requests, prompts and outputs of {lo}..{hi} tokens: "
            f"{e['num_tokens']} tokens in {e['seconds']:.2f} s, {e['tokens_per_s']:,.0f} tokens/s "
            f"({e['steps']} steps, {e['preemptions']} preemptions, GPU idle {_pct(e.get('gpu_idle_share'))} of a "
            f"decode step, {e['python_us_per_seq']:.1f} us of host time per request and step)")
        save()
    _free(llm)

    # 4. Memory: a fixed KV budget, paged against a contiguous reservation of the context per request.
    if not opts.skip_memory and in_time("the memory question"):
        cap = kv_capacity(config, 16, dtype, memory_budget, opts.prompt_len, opts.max_tokens,
                          config.max_position_embeddings)
        many = 2 * cap["paged"] if not opts.smoke else 4
        mem_kw = {k: v for k, v in base_kw.items()
                  if k not in ("device", "dtype", "max_num_seqs", "kv_cache_memory", "num_gpu_blocks")}
        mem_llm = LLM(model, tokenizer=tokenizer, **mem_kw, **engine_kw, kv_cache_memory=memory_budget,
                      max_num_seqs=min(many, 1024),
                      max_num_batched_tokens=max(min(many, 1024) * opts.prompt_len, 8192))
        measured = run_engine(mem_llm, make_prompts(many, opts.prompt_len, config.vocab_size, seed=7),
                              opts.max_tokens)
        _free(mem_llm)
        cap.update(measured_max_running=measured["max_running"], measured_mean_running=measured["mean_running"],
                   measured_preemptions=measured["preemptions"], budget_bytes=memory_budget)
        results["memory"] = cap
        log(f"# KV budget {memory_budget / 2**30:.2f} GiB ({cap['num_blocks']} blocks of 16 tokens, "
            f"{cap['bytes_per_token']} bytes a token): {cap['paged']} requests of {opts.prompt_len}+{opts.max_tokens} "
            f"tokens fit paged (the engine, given {many}: {measured['mean_running']:.0f} running on average, "
            f"{measured['preemptions']} preemptions), {cap['contiguous']} with "
            f"{config.max_position_embeddings} tokens reserved each")

    save()
    log(f"# done in {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
