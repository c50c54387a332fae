"""A small inference engine over the project's paged KV cache, with vLLM's interface.

Read in this order: ``sampling_params`` (how a token is chosen), ``outputs`` (what comes back),
``sched_output`` (what a scheduler tells the model runner each step, and what comes back),
``sampler``, ``tables`` (request-state rows to kernel inputs), ``cuda_graphs`` (decode steps
replayed), ``model_runner`` (per-request state, inputs prepared on the device, the model, the
sampler), ``legacy_core`` (vLLM V0's scheduler and block manager behind the same interface),
``llm_engine`` (schedule, run, update; async scheduling), ``llm`` (``LLM``: ``generate`` and
``chat``).
"""
from paged_attention.engine.llm import LLM
from paged_attention.engine.llm_engine import LLMEngine, StepStats
from paged_attention.engine.outputs import CompletionOutput, RequestOutput
from paged_attention.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "StepStats", "SamplingParams", "RequestOutput", "CompletionOutput"]
