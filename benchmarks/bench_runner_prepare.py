"""The model runner's host preparation per kind of step: what ``StepStats.prepare`` records.

Usage (any machine; a GPU if there is one):
    python benchmarks/bench_runner_prepare.py [--requests 256] [--prompt-len 128] [--repeat 3]

Runs ``--requests`` prompts through ``LLM.generate``-like steps (random weights, end tokens
ignored: SmolLM2-135M's shape on a GPU, the two-layer tiny model on a CPU) and prints,
per run, the median ``prepare`` (update the request states and tables, pack the inputs, launch
the tables' kernel and the copy; on a CPU the v1 tables' numpy) of the first step (new requests only), the second, the
ordinary decode steps of every request, and the block-boundary steps (where most requests
gain a block). The work timed is the host's. To compare two trees, run this with
``PYTHONPATH`` at each in turn, on the same machine.
"""
import argparse
import gc
import statistics
import sys
import time

import torch

import paged_attention  # noqa: F401  (device policy first)
from paged_attention.bench.engine import make_prompts
from paged_attention.engine import LLM, SamplingParams
from paged_attention.model import LlamaConfig, LlamaForCausalLM
from paged_attention.model.weights import random_weights
from profile_engine import SMOLLM2_135M     # (this folder's: the shape profile_engine runs)


def one_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Median prepare (ms) per kind of step of one run of ``prompts``."""
    engine, runner = llm.engine, llm.engine.runner
    gained = []                      # per step: how many running requests gained a block
    execute = runner.execute_model

    def counting(so):
        gained.append(sum(ids is not None for ids in so.scheduled_cached_reqs.new_block_ids))
        return execute(so)
    runner.execute_model = counting
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = len(engine.step_stats)
    gc.collect()
    gc.disable()
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        gc.enable()
        del runner.execute_model
    stats = [s for s in engine.step_stats[first:] if s.num_tokens]
    kinds: dict[str, list[float]] = {"first": [], "second": [], "decode": [], "boundary": []}
    n = len(prompts)
    for i, (s, g) in enumerate(zip(stats, gained)):
        if i < 2:
            kinds[("first", "second")[i]].append(s.prepare)
        elif s.decode_only and s.num_reqs == n:
            kinds["boundary" if g > n // 4 else "decode"].append(s.prepare)
    return {k: 1e3 * statistics.median(v) for k, v in kinds.items() if v}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    opts = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        config = LlamaConfig(**SMOLLM2_135M)
        model = LlamaForCausalLM(config, random_weights(config), dtype=torch.bfloat16, device="cuda")
        llm = LLM(model, max_num_seqs=opts.requests, kv_cache_memory=8 << 30, record_block_owners=False,
                  enable_prefix_caching=False)
        name = torch.cuda.get_device_name()
    else:
        config = LlamaConfig.tiny(max_position_embeddings=1024)
        model = LlamaForCausalLM(config, random_weights(config), dtype=torch.float32, device="cpu")
        llm = LLM(model, max_num_seqs=opts.requests, max_num_batched_tokens=16384, max_model_len=1024,
                  enable_prefix_caching=False)
        name = "CPU"
    print(f"# {name}: {opts.requests} requests of {opts.prompt_len} tokens, +{opts.max_tokens}; "
          f"tables {type(llm.engine.runner.tables).__name__}; median prepare per step kind (ms)")
    prompts = make_prompts(opts.requests, opts.prompt_len, config.vocab_size, seed=0)
    one_run(llm, prompts, 4)        # warm-up: compiles the kernels and captures the graphs
    for r in range(opts.repeat):
        got = one_run(llm, prompts, opts.max_tokens)
        print(f"run {r}: " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
