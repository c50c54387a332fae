"""The engine against Hugging Face transformers: output tokens/s, time per decode step, memory.

Usage (GPU machine, bf16):  python benchmarks/bench_engine.py [--requests 1,16,64,256]
    [--prompt-len 128] [--max-tokens 128] [--skip-static] [--json PATH]
        python benchmarks/bench_engine.py --smoke     (a tiny CPU run: does the script work?)

One process runs, for each number of requests, the engine (``LLM``: Triton attention, v2 tables,
CUDA-graph decode steps) and transformers' ``generate`` with its dynamic and its static cache, on
the same random 128-token prompts, each generating exactly ``--max-tokens`` tokens. Then the
memory question: requests held at once by a 1 GiB KV budget, paged against contiguous. The
issue's goals: at least 5x transformers' best at 64 and 256 requests, at least 1,000 tokens/s
for one request. Figures are only comparable within one run.
"""
import argparse
import json
import sys

import torch

import paged_attention  # noqa: F401  (device policy first)
from paged_attention import runtime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-static", action="store_true", help="skip transformers' static cache")
    parser.add_argument("--skip-hf", action="store_true", help="time the engine only")
    parser.add_argument("--block-tables", default="auto", help="the engine's tables: auto, v2, v2-vllm or v1")
    parser.add_argument("--json", help="write every figure here (notebook 08 plots it)")
    parser.add_argument("--smoke", action="store_true", help="a tiny CPU run in fp32 (checks the script)")
    opts = parser.parse_args()

    import transformers

    from paged_attention.bench.engine import kv_capacity, load_transformers, make_prompts, run_engine, run_transformers
    from paged_attention.engine import LLM

    if opts.smoke:
        device, dtype, sizes = torch.device("cpu"), torch.float32, [1, 2]
        opts.prompt_len, opts.max_tokens, opts.skip_static = 16, 4, True
        llm_kw = dict(device="cpu", num_gpu_blocks=64, num_cpu_blocks=0, max_num_seqs=4)
    else:
        if not torch.cuda.is_available():
            print("this benchmark needs an NVIDIA GPU (or --smoke for a CPU check of the script)")
            return 1
        device, dtype = runtime.DEVICE, torch.bfloat16
        sizes = [int(n) for n in opts.requests.split(",")]
        llm_kw = dict(dtype=dtype, max_num_seqs=max(sizes), kv_cache_memory=8 << 30, record_block_owners=False,
                      block_tables=opts.block_tables)
    print(f"# {runtime.device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{dtype}, prompts of {opts.prompt_len} tokens, {opts.max_tokens} new tokens each, "
          f"block tables {opts.block_tables}", flush=True)

    llm = LLM(**llm_kw)
    hf = None if opts.skip_hf else load_transformers(dtype, device)
    results = {"device": runtime.device_name(), "dtype": str(dtype), "prompt_len": opts.prompt_len,
               "max_tokens": opts.max_tokens, "rows": []}
    print(f"{'requests':>8} {'engine tok/s':>12} {'ms/step':>8} {'python ms':>9} {'graphs':>7} "
          f"{'HF dyn tok/s':>12} {'HF static':>10} {'engine/best HF':>14}", flush=True)
    for n in sizes:
        prompts = make_prompts(n, opts.prompt_len, llm.config.vocab_size, seed=n)
        row = {"requests": n, "engine": run_engine(llm, prompts, opts.max_tokens)}
        if hf is not None:
            row["hf_dynamic"] = run_transformers(hf, prompts, opts.max_tokens)
            if not opts.skip_static:
                row["hf_static"] = run_transformers(hf, prompts, opts.max_tokens, "static")
        best = max((row[k]["tokens_per_s"] for k in ("hf_dynamic", "hf_static") if k in row), default=float("nan"))
        e = row["engine"]
        row["ratio_to_best_hf"] = e["tokens_per_s"] / best
        results["rows"].append(row)
        static = row.get("hf_static", {}).get("tokens_per_s", float("nan"))
        dynamic = row.get("hf_dynamic", {}).get("tokens_per_s", float("nan"))
        print(f"{n:>8} {e['tokens_per_s']:>12.0f} {e['ms_per_decode_step']:>8.2f} {e['python_ms_per_step']:>9.2f} "
              f"{e['cuda_graph_steps']:>3}/{e['decode_steps']:<3} {dynamic:>12.0f} {static:>10.0f} "
              f"{row['ratio_to_best_hf']:>13.1f}x", flush=True)

    # Memory: a fixed KV budget, paged against a contiguous reservation of the context per request.
    budget = 1 << 30 if not opts.smoke else 64 << 20
    cap = kv_capacity(llm.config, llm.engine.block_size, dtype, budget, opts.prompt_len, opts.max_tokens,
                      llm.engine.max_model_len)
    many = 2 * cap["paged"] if not opts.smoke else 4
    mem_llm = LLM(**{**llm_kw, "kv_cache_memory": budget, "max_num_seqs": min(many, 1024),
                     "max_num_batched_tokens": max(min(many, 1024) * opts.prompt_len, llm.engine.max_model_len)})
    measured = run_engine(mem_llm, make_prompts(many, opts.prompt_len, llm.config.vocab_size, seed=7), opts.max_tokens)
    cap["measured_max_running"] = measured["max_running"]
    cap["measured_mean_running"] = measured["mean_running"]
    cap["measured_preemptions"] = measured["preemptions"]
    cap["budget_bytes"] = budget
    results["memory"] = cap
    print(f"# KV budget {budget / 2**30:.2f} GiB ({cap['num_blocks']} blocks of {llm.engine.block_size} tokens, "
          f"{cap['bytes_per_token']} bytes a token): {cap['paged']} requests of {opts.prompt_len}+{opts.max_tokens} "
          f"tokens fit paged (the engine, given {many}: {measured['mean_running']:.0f} running on average, "
          f"{measured['preemptions']} preemptions), {cap['contiguous']} with {llm.engine.max_model_len} tokens "
          f"reserved each", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
