"""The engine against Hugging Face ``transformers``: the same model, the same prompts, one process.

``run_engine`` times ``LLM.generate`` (after a warm-up call that compiles the kernels and captures
the CUDA graphs), ``run_transformers`` a batched greedy ``model.generate`` with its dynamic or its
static cache (same warm-up). Both generate exactly ``max_tokens`` tokens per request (end tokens
ignored), so output tokens/s compare like for like. ``kv_capacity`` answers the PagedAttention
paper's memory question (its Fig. 13): how many requests a fixed KV budget holds with paging,
against a contiguous reservation of the model's whole context per request.

The issue's goals, on the GPU machine in bf16: at least 5x transformers' best at 64 and 256
requests, and at least 1,000 output tokens/s for a single request.
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any, Optional

import torch

from paged_attention.legacy.records import RECOMPUTED, SWAPPED_OUT
from paged_attention.utils import cdiv


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` different prompts of exactly ``prompt_len`` ordinary token ids (ids above
    the special tokens), so that the prefix cache finds nothing to share."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(num_requests)]


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


def run_engine(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Output tokens/s of ``llm.generate`` and where a decode step's time goes (milliseconds)."""
    from paged_attention.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    device = llm.model.device
    warm = [[(t + 1) % llm.config.vocab_size for t in p] for p in prompts]   # other prompts: no cache hits
    llm.generate(warm, params, use_tqdm=False)
    first_step, first_record = len(llm.engine.step_stats), len(llm.engine.history)
    with _no_gc():
        _sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        seconds = time.perf_counter() - start
    steps = llm.engine.step_stats[first_step:]
    decodes = [s for s in steps if s.decode_only] or steps
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tokens_per_s": num_tokens / seconds, "seconds": seconds, "num_tokens": num_tokens,
        "ms_per_decode_step": 1e3 * statistics.mean(s.total for s in decodes),
        "python_ms_per_step": 1e3 * statistics.mean(s.python for s in decodes),
        "schedule_ms_per_step": 1e3 * statistics.mean(s.schedule for s in decodes),
        "gpu_wait_ms_per_step": 1e3 * statistics.mean(s.forward + s.sample for s in decodes),
        "cuda_graph_steps": sum(s.cuda_graph for s in decodes), "decode_steps": len(decodes),
        "max_running": max(len(r.running) for r in llm.engine.history[first_record:]),
        # Requests running through the decode steps (admission can briefly exceed what then
        # fits: the scheduler preempts as the requests grow).
        "mean_running": statistics.mean(len(r.running) for r in llm.engine.history[first_record:]),
        "preemptions": sum(e.kind in (SWAPPED_OUT, RECOMPUTED)
                           for r in llm.engine.history[first_record:] for e in r.events),
    }


def load_transformers(dtype: torch.dtype, device: torch.device):
    """Hugging Face's Llama loading the packaged GGUF (the same weights the engine reads)."""
    import transformers

    from paged_attention.model.weights import packaged_model_path
    path = packaged_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def run_transformers(model, prompts: list[list[int]], max_tokens: int,
                     cache_implementation: Optional[str] = None) -> dict[str, Any]:
    """Output tokens/s of one batched greedy ``generate`` (``cache_implementation``: None for the
    dynamic cache, ``"static"``). The prompts have one length, so nothing is padded."""
    device = model.device
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                  do_sample=False, pad_token_id=0)
    if cache_implementation is not None:
        kwargs["cache_implementation"] = cache_implementation
    with torch.inference_mode():
        model.generate(ids, **kwargs)                        # warm-up (the static cache compiles here)
        with _no_gc():
            _sync(device)
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            _sync(device)
            seconds = time.perf_counter() - start
    num_tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tokens_per_s": num_tokens / seconds, "seconds": seconds, "num_tokens": num_tokens,
            "ms_per_decode_step": 1e3 * seconds / max_tokens}


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
