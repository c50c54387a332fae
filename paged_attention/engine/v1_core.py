"""vLLM V1's scheduler over its KV-cache manager (``v1/core/``), as the engine's core.

``LLM(core="v1")``, the default. The scheduler (``AsyncScheduler`` with async scheduling) builds
its own ``KVCacheManager`` over a ``KVCacheConfig`` of the model's layers: one KV-cache group of
full attention, ``num_gpu_blocks`` blocks (block 0 is the manager's null block, never handed
out). The block ids it hands out index the engine's KV caches directly, and go to the model
runner's tables as they are (``use_v2_model_runner``: a request back from a preemption comes as
a new one, with every token to recompute).

Stops are the scheduler's (``check_stop``): it reads the end and stop tokens from the request's
sampling parameters, so each request's parameters carry its stop tokens with the model's end
tokens added (unless ``ignore_eos``).
"""
from __future__ import annotations

import copy
from typing import Optional

from paged_attention.engine.sampling_params import SamplingParams
from paged_attention.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from paged_attention.model.config import LlamaConfig
from paged_attention.v1.core import kv_cache_utils
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.sched.async_scheduler import AsyncScheduler
from paged_attention.v1.core.sched.messages import EngineCoreOutput, ModelRunnerOutput
from paged_attention.v1.core.sched.output import SchedulerOutput
from paged_attention.v1.core.sched.scheduler import Scheduler


def kv_cache_config(config: LlamaConfig, num_blocks: int, block_size: int, dtype) -> KVCacheConfig:
    """The model's KV cache as the V1 manager sees it: one group of every layer, full attention."""
    from paged_attention.model.kv import layer_names

    names = layer_names(config)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=config.num_key_value_heads,
                             head_size=config.head_dim, dtype=dtype)
    tensors = [KVCacheTensor(size=spec.page_size_bytes * num_blocks, shared_by=[name]) for name in names]
    return KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec(names, spec)])


class V1Core:
    """The V1 scheduler behind the engine's core interface."""

    def __init__(self, model_config: LlamaConfig, dtype, *, block_size: int, num_gpu_blocks: int,
                 enable_prefix_caching: bool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 async_scheduling: bool) -> None:
        self.block_size, self.num_gpu_blocks = block_size, num_gpu_blocks
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(kv_cache_config(model_config, num_gpu_blocks, block_size, dtype),
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_caching=enable_prefix_caching,
                             use_v2_model_runner=True)
        kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
        self._hasher = kv_cache_utils.get_request_block_hasher(block_size, kv_cache_utils.sha256)
        # Prompt tokens found in the prefix cache when each request was first admitted.
        self.num_cached_tokens: dict[str, int] = {}
        self._last_params: tuple = (None, None, None)     # see add_request
        self._usable_blocks: Optional[tuple[int, str]] = None

    @property
    def kv_cache_manager(self):
        return self.scheduler.kv_cache_manager

    # ---- requests -------------------------------------------------------------------------
    def check_prompt(self, num_tokens: int) -> None:
        """Nothing beyond the engine's checks: V1 runs a long prompt in chunks."""

    @property
    def usable_blocks(self) -> tuple[int, str]:
        """The most blocks one request can ever hold, and why not all of the pool's (made once:
        the engine asks for every prompt, and the pool never changes size)."""
        if self._usable_blocks is None:
            self._usable_blocks = (self.num_gpu_blocks - 1,
                                   f"{self.num_gpu_blocks} blocks, block 0 being the null block")
        return self._usable_blocks

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stop_ids: frozenset[int]) -> None:
        # The engine's checked copy, with the end tokens added to its stop tokens: a shallow
        # copy (``dataclasses.replace`` would run every check a second time, per request).
        # Requests given the same checked copy and stop tokens (a generate call's prompts that
        # share params) share it: nothing changes a request's params once it is queued.
        last_params, last_stop_ids, own = self._last_params
        if params is not last_params or stop_ids != last_stop_ids:
            own = copy.copy(params)
            own.stop_token_ids = sorted(stop_ids)
            self._last_params = (params, stop_ids, own)
        self.scheduler.add_request(Request(request_id, prompt_token_ids, own, None, block_hasher=self._hasher))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.num_cached_tokens.setdefault(new.req_id, new.num_computed_tokens)
        return so

    def update_from_output(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        by_client = self.scheduler.update_from_output(so, output)
        if len(by_client) == 1:                  # one client (the engine): its list as it is
            return next(iter(by_client.values())).outputs
        return [out for outs in by_client.values() for out in outs.outputs]

    # ---- failure --------------------------------------------------------------------------
    def abort_all(self, why: str = "aborted") -> list[str]:
        """Finish every request (aborted) and free its blocks; forget the prefix cache (a step
        that failed half-way may have cached blocks whose keys and values were never written)."""
        dropped = [r.request_id for r in self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)]
        self.num_cached_tokens.clear()
        self.scheduler.reset_prefix_cache()
        return dropped


__all__ = ["V1Core", "kv_cache_config"]
