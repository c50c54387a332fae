"""A small inference engine over the project's paged KV cache, with vLLM's interface.

Read in this order: ``sampling_params`` (how a token is chosen), ``outputs`` (what comes back),
``sampler``, ``tables`` (request-state rows to kernel inputs), ``cuda_graphs`` (decode steps
replayed), ``model_runner`` (per-request state, inputs prepared on the device, the model, the
sampler), ``v1_core`` (vLLM V1's scheduler, ``v1/core/sched``, as the engine's core), ``legacy_core``
(vLLM V0's scheduler and block manager behind the same interface),
``llm_engine`` (schedule, run, update; async scheduling), ``llm`` (``LLM``: ``generate`` and
``chat``).
"""
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine, StepStats
from paged_attention.engine.outputs import CompletionOutput, RequestOutput
from paged_attention.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "StepStats", "SamplingParams", "RequestOutput", "CompletionOutput"]
