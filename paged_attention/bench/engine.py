"""The engine against Hugging Face ``transformers``, and the engine against itself (the ablation).

``run_engine`` times ``LLM.generate`` (after a warm-up call on other prompts of the same shape,
which compiles the kernels and captures the CUDA graphs) and reports where a decode step's time
goes: the host's parts (``StepStats``) and, where the engine recorded CUDA events around each
step's device work, how long the GPU was busy and how long it sat idle between two steps.
``run_transformers`` times a batched greedy ``model.generate`` with its dynamic or its static
cache. Both generate exactly ``max_tokens`` tokens per request (end tokens ignored), so output
tokens/s compare like for like.

``ABLATION`` is the engine's history in four steps, each adding one thing to the one before:
vLLM V0's synchronous scheduler and block manager; vLLM V1's scheduler and KV-cache manager;
async scheduling; CUDA graphs. ``random_workload`` is nano-vllm's benchmark: prompts and outputs
of random lengths. ``kv_capacity`` answers the PagedAttention paper's memory question (its
Fig. 13): how many requests a fixed KV budget holds with paging, against a contiguous
reservation of the model's whole context per request.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from paged_attention.utils import cdiv

# The ablation, in order: (name, LLM keyword arguments), each adding one thing.
ABLATION: list[tuple[str, dict]] = [
    ("V0, synchronous", dict(core="v0", async_scheduling=False, cuda_graphs=False)),
    ("V1", dict(core="v1", async_scheduling=False, cuda_graphs=False)),
    ("V1 + async", dict(core="v1", async_scheduling=True, cuda_graphs=False)),
    ("V1 + async + graphs", dict(core="v1", async_scheduling=True, cuda_graphs=True)),
]

# The host's parts of a step (StepStats fields), in the order a step runs them.
HOST_PARTS = ("schedule", "prepare", "forward", "sample", "wait", "update")

# Where a GPU run of benchmarks/bench_engine.py is committed (notebook 08 draws it).
RESULTS_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench_engine.json"


def load_results(path: Union[str, Path] = RESULTS_PATH) -> Optional[dict[str, Any]]:
    """A committed run's figures (``bench_engine.json``), or None where there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` different prompts of exactly ``prompt_len`` ordinary token ids (ids above
    the special tokens), so that the prefix cache finds nothing to share."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_requests)]


def random_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int,
                    seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark: ``(prompts, max_tokens)``, each prompt and each output length drawn
    uniformly from ``[min_len, max_len]``."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(min_len, max_len + 1, (num_requests,), generator=g).tolist()
    output_lens = torch.randint(min_len, max_len + 1, (num_requests,), generator=g).tolist()
    prompts = [torch.randint(100, vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    return prompts, output_lens


@contextlib.contextmanager
def _no_gc():
    """Collect first, then keep Python's garbage collector out of a timed run: a full collection
    over the objects a loaded model (or a compiled one) leaves behind can take a second, and
    would land in whichever run it happens to fall into."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def idle_gap_ms(before: Any, step: Any) -> Optional[float]:
    """The GPU's idle time (ms) between two steps' device work, from the end event of ``before``
    to the start event of ``step`` (``StepStats.gpu_events``); None unless both recorded events
    and ``step`` ran right after ``before`` (by ``StepStats.step``: a step left out between two,
    a prefill say, would count as idle time)."""
    if (before is None or before.gpu_events is None or step.gpu_events is None
            or getattr(step, "step", 1) - getattr(before, "step", 0) != 1):
        return None
    return max(0.0, before.gpu_events[1].elapsed_time(step.gpu_events[0]))


def gpu_timeline(steps: Sequence[Any]) -> Optional[dict[str, float]]:
    """From the CUDA events of steps (``StepStats.gpu_events``, recorded around each step's device
    work): mean GPU busy time per step, and over the pairs of consecutive steps (by
    ``StepStats.step``) the mean idle gap between one step's end and the next one's start
    (milliseconds), and the idle share of the time from one step's end to the next one's end.
    None without such a pair."""
    steps = [s for s in steps if s.gpu_events is not None]
    # Pairs of steps that ran one right after the other (``idle_gap_ms``).
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if idle_gap_ms(a, b) is not None]
    if not pairs:
        return None
    busy = [start.elapsed_time(end) for start, end in (s.gpu_events for s in steps)]
    idle = [idle_gap_ms(a, b) for a, b in pairs]
    span = sum(a.gpu_events[1].elapsed_time(b.gpu_events[1]) for a, b in pairs)
    return {"gpu_busy_ms": statistics.mean(busy), "gpu_idle_ms": statistics.mean(idle),
            "gpu_idle_share": sum(idle) / span if span > 0 else float("nan")}


def step_breakdown(steps: Sequence[Any]) -> dict[str, float]:
    """Mean milliseconds per step of each host part, and the host's own time per request and
    step (µs: everything but waiting for the GPU), the median over the steps."""
    out = {f"{part}_ms": 1e3 * statistics.mean(getattr(s, part) for s in steps) for part in HOST_PARTS}
    out["host_ms"] = sum(out[f"{p}_ms"] for p in HOST_PARTS if p != "wait")
    out["python_us_per_seq"] = 1e6 * statistics.median((s.total - s.wait) / s.num_reqs for s in steps)
    return out


def run_engine(llm, prompts: list[list[int]], max_tokens: Union[int, list[int]],
               warm_prompts: Optional[list[list[int]]] = None) -> dict[str, Any]:
    """Output tokens/s of ``llm.generate`` and where a decode step's time goes.

    A warm-up call first, on ``warm_prompts`` (default: the prompts with every id shifted, so
    that nothing is a prefix-cache hit) with the same output lengths. The timed call records no
    CUDA events, so that its figures are what a user's code gets; when the engine was made with
    ``record_gpu_time``, one more call (the ids shifted again) records them, for the GPU's busy
    and idle time per decode step. (On an H200 at 256 requests the events cost within the
    run-to-run spread, about 2%, in one run of alternating calls; an earlier pair of runs had
    shown 5 to 9%.)"""
    from paged_attention.engine import SamplingParams

    lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    device = llm.model.device
    if warm_prompts is None:
        warm_prompts = [[(t + 1) % llm.config.vocab_size for t in p] for p in prompts]
    llm.generate(warm_prompts, params, use_tqdm=False)
    engine = llm.engine
    first_step = len(engine.step_stats)
    preempted = engine.runner.num_preemptions
    # The timed run records no CUDA events (two a step cost the host time a user's code does not
    # spend); where the engine records them, a second run below measures the GPU's timeline.
    record, engine.runner.record_gpu_time = engine.runner.record_gpu_time, False
    try:
        with _no_gc():
            _sync(device)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            _sync(device)
            seconds = time.perf_counter() - start
    finally:
        engine.runner.record_gpu_time = record
    steps = engine.step_stats[first_step:]
    decodes = [s for s in steps if s.decode_only] or steps
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "tokens_per_s": num_tokens / seconds, "seconds": seconds, "num_tokens": num_tokens,
        "steps": len(steps), "decode_steps": len(decodes), "ms_per_step": 1e3 * seconds / max(1, len(steps)),
        "ms_per_decode_step": 1e3 * statistics.mean(s.total for s in decodes),
        # The call's time outside its decode steps (the requests queued, the prefill steps, the
        # end): where a round that differs from its neighbours usually differs.
        "other_ms": 1e3 * (seconds - sum(s.total for s in decodes)) if decodes is not steps else None,
        "cuda_graph_steps": sum(s.cuda_graph for s in decodes),
        "mean_running": statistics.mean(s.num_reqs for s in steps),
        "max_running": max(s.num_reqs for s in steps),
        "preemptions": engine.runner.num_preemptions - preempted,
        "core": engine.core_name, "async_scheduling": engine.async_scheduling,
        "cuda_graphs": engine.runner.graphs is not None,
    }
    result.update(step_breakdown(decodes))
    if record:
        # The same work again (the ids shifted once more: no prefix-cache hits), with events.
        first_timeline = len(engine.step_stats)
        with _no_gc():
            llm.generate([[(t + 2) % llm.config.vocab_size for t in p] for p in prompts], params, use_tqdm=False)
        timeline = gpu_timeline([s for s in engine.step_stats[first_timeline:] if s.decode_only])
        if timeline is not None:
            result.update(timeline)
    return result


def load_transformers(dtype: torch.dtype, device: torch.device):
    """Hugging Face's Llama loading the packaged GGUF (the same weights the engine reads)."""
    import transformers

    from paged_attention.model.weights import packaged_model_path
    path = packaged_model_path()
    # Without progress bars (in a notebook, widgets that a saved page cannot show): the GGUF
    # reader's, and transformers' own ("Loading weights", transformers 5).
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    hf_logging = transformers.utils.logging
    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if bars_on:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()


def run_transformers(model, prompts: list[list[int]], max_tokens: int,
                     cache_implementation: Optional[str] = None, warm_up: bool = True) -> dict[str, Any]:
    """Output tokens/s of one batched greedy ``generate`` (``cache_implementation``: None for the
    dynamic cache, ``"static"``). The prompts have one length, so nothing is padded. ``warm_up``:
    one untimed call first (the static cache compiles there); a later round of the same shape
    can go without."""
    device = model.device
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                  do_sample=False, pad_token_id=0)
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    with torch.inference_mode():
        if warm_up:
            model.generate(ids, **kwargs)                    # (the static cache compiles here)
        with _no_gc():
            _sync(device)
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            _sync(device)
            seconds = time.perf_counter() - start
    num_tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tokens_per_s": num_tokens / seconds, "seconds": seconds, "num_tokens": num_tokens,
            "ms_per_decode_step": 1e3 * seconds / max_tokens}


def run_ablation(model, tokenizer, prompts: list[list[int]], max_tokens: int, configs=ABLATION,
                 **llm_kw: Any) -> list[dict[str, Any]]:
    """``run_engine`` for each configuration of the ablation on the same model and prompts (an
    engine each, freed before the next: each holds its own KV cache)."""
    from paged_attention.engine import LLM

    rows = []
    for name, kw in configs:
        llm = LLM(model, tokenizer=tokenizer, **llm_kw, **kw)
        rows.append({"name": name, **kw, **run_engine(llm, prompts, max_tokens)})
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def kv_capacity(config, block_size: int, dtype: torch.dtype, budget_bytes: int, prompt_len: int,
                output_len: int, max_model_len: int) -> dict[str, int]:
    """Requests of ``prompt_len + output_len`` tokens that ``budget_bytes`` of KV cache holds at once:
    with paging (each holds ``cdiv(tokens, block_size)`` blocks) and with a contiguous reservation
    of ``max_model_len`` tokens each (what a server that cannot page must set aside)."""
    from paged_attention.model import kv_cache_bytes_per_block

    per_block = kv_cache_bytes_per_block(config, block_size, dtype)
    num_blocks = budget_bytes // per_block
    per_token = per_block // block_size
    return {"num_blocks": num_blocks, "bytes_per_token": per_token,
            "paged": num_blocks // cdiv(prompt_len + output_len, block_size),
            "contiguous": budget_bytes // (per_token * max_model_len)}
