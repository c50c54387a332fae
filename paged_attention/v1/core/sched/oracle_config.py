"""vLLM's own ``Scheduler`` built from the same plain arguments as ours, for side-by-side runs.

vLLM's scheduler reads its settings from a ``VllmConfig``. Two parts of it cannot be had on a
CPU without a model: a real ``ModelConfig`` inspects the model's files (in a subprocess that
needs vLLM's compiled extension), and the structured-output manager wants a tokenizer. So the
``VllmConfig`` here is built without a model config, and then given a stand-in that answers the
few questions the scheduler asks of it (the context length; that the model generates text, has
no encoder and no multimodal inputs), plus a structured-output manager that accepts every token
(no request here asks for structured output). Everything else is vLLM's own: its
``SchedulerConfig``, ``CacheConfig``, ``KVCacheManager`` and ``Request``.

``vllm_scheduler(o, kv_cache_config, ...)`` takes the arguments of our ``Scheduler`` (see its
module for how each maps to vLLM's configs); ``o`` is ``oracle.load(scheduler=True)`` and
``kv_cache_config`` vLLM's own ``KVCacheConfig``. ``vllm_request`` builds a vLLM ``Request``.
"""
from __future__ import annotations

import math
import os
import types
from typing import Any, Optional

__all__ = ["vllm_request", "vllm_scheduler"]


class ModelConfigStandIn:
    """The attributes of ``ModelConfig`` that vLLM's scheduler reads, for a text-only
    decoder-only model generating text. Asking for any other is an error that names it, so a
    later vLLM that reads more fails loudly instead of silently."""

    uses_mrope = False
    is_encoder_decoder = False
    runner_type = "generate"
    is_diffusion = False
    supports_multimodal_inputs = False
    return_sampling_mask = False
    multimodal_config = None
    is_submodel_config = False

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the model-config stand-in has no {name!r}: vLLM's scheduler "
                             "reads more of ModelConfig than it provides")


class AcceptEveryToken:
    """A structured-output manager for requests without structured output."""

    def accept_tokens(self, request: Any, tokens: list[int]) -> bool:
        return True


def vllm_scheduler(
    o: types.SimpleNamespace,
    kv_cache_config: Any,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    block_size: Optional[int] = None,
    enable_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
    scheduler_reserve_full_isl: bool = True,
    watermark: float = 0.0,
    use_v2_model_runner: bool = False,
    include_finished_set: bool = False,
    hash_block_size: Optional[int] = None,
    async_scheduling: bool = False,
) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``) configured as ours
    would be with the same arguments."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig

    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    if block_size is None:
        block_size = math.lcm(*sizes)
    if hash_block_size is None:
        hash_block_size = math.gcd(*sizes)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill, policy=policy,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl, watermark=watermark,
        async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_caching)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    # Which model runner vLLM assumes decides how resumed requests are sent; vLLM reads it from
    # the environment while the scheduler is built.
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if use_v2_model_runner else "0"
    try:
        vllm_config = VllmConfig(scheduler_config=scheduler_config, cache_config=cache_config)
        vllm_config.model_config = ModelConfigStandIn(max_model_len)
        # vLLM's CPU platform turns async scheduling off while the config is built; the
        # schedulers mirrored here are GPU ones (it decides how many tokens may be in flight).
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        cls = o.AsyncScheduler if async_scheduling else o.Scheduler
        scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                        structured_output_manager=AcceptEveryToken(), block_size=block_size,
                        hash_block_size=hash_block_size,
                        include_finished_set=include_finished_set, log_stats=False)
    finally:
        if saved is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    # VllmConfig may adjust what it is given; a side-by-side run must compare like with like.
    got = (scheduler.vllm_config.max_concurrent_batches,
           scheduler.max_num_running_reqs, scheduler.max_num_scheduled_tokens,
           scheduler.max_model_len, scheduler.block_size, scheduler.use_v2_model_runner,
           scheduler.scheduler_config.long_prefill_token_threshold,
           scheduler.scheduler_config.enable_chunked_prefill,
           scheduler.cache_config.enable_prefix_caching)
    want = (2 if async_scheduling else 1, max_num_seqs, max_num_batched_tokens, max_model_len,
            block_size, use_v2_model_runner, long_prefill_token_threshold,
            enable_chunked_prefill, enable_caching)
    if got != want:
        raise RuntimeError(f"vLLM's configs changed the settings: got {got}, asked for {want}")
    return scheduler


def vllm_request(o: types.SimpleNamespace, request_id: str, prompt_token_ids: list[int],
                 max_tokens: int, block_hasher: Any, eos_token_id: Optional[int] = None,
                 stop_token_ids: Optional[list[int]] = None, priority: int = 0,
                 arrival_time: float = 0.0, client_index: int = 0) -> Any:
    """A vLLM ``Request`` with its ``SamplingParams`` (the end token set as vLLM's engine sets
    it, from the model's generation config)."""
    params = o.SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    if eos_token_id is not None:
        params.update_from_generation_config({}, eos_token_id)
    return o.Request(request_id, list(prompt_token_ids), params, None, block_hasher=block_hasher,
                     priority=priority, arrival_time=arrival_time, client_index=client_index)


def smoke_test(o: types.SimpleNamespace) -> int:
    """Drive vLLM's ``Scheduler`` and ``AsyncScheduler`` through a short workload that admits,
    chunks, hits the prefix cache, preempts, finishes, aborts and resets, with either model
    runner. Returns the number of engine steps. ``fetch-core`` runs it (through the oracle's
    smoke test) so that the modules vLLM imports while building its configs are kept."""
    from paged_attention.v1.core.sched.differential import SchedulerWorkload, replay, vllm_side

    steps = 0
    for async_scheduling in (False, True):
        workload = SchedulerWorkload(
            "smoke", seed=1, groups=[("full", 4), ("window", 4, 8)], num_blocks=40,
            max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, steps=60,
            p_abort=0.1, p_reset=0.05, async_scheduling=async_scheduling,
            use_v2_model_runner=async_scheduling)
        steps += replay(workload, [vllm_side(o, workload)]).engine_steps
    return steps
