"""vLLM's V1 scheduler (``vllm/v1/core/sched/``): who runs each step, and how many tokens.

Read in this order: ``output`` (what a step hands the model runner: ``SchedulerOutput`` with
``NewRequestData`` and ``CachedRequestData``), ``messages`` (what comes back:
``ModelRunnerOutput``; what goes on to the engine: ``EngineCoreOutput``), ``request_queue``
(the waiting queue, first come first served or by priority), ``utils`` (when a request stops),
``scheduler`` (``Scheduler``: one token budget, running requests first, chunked prefill, prefix
hits at admission, preemption by recomputation), ``async_scheduler`` (``AsyncScheduler``: one
step ahead of the model, with placeholders for tokens not sampled yet).

``oracle_config`` builds vLLM 0.33's own ``Scheduler`` from the same arguments, and
``differential`` runs one workload through both, comparing every step.
"""
from paged_attention.v1.core.sched.async_scheduler import AsyncScheduler
from paged_attention.v1.core.sched.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
)
from paged_attention.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from paged_attention.v1.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from paged_attention.v1.core.sched.scheduler import Scheduler

__all__ = [
    "AsyncScheduler", "CachedRequestData", "EngineCoreOutput", "EngineCoreOutputs",
    "FCFSRequestQueue", "ModelRunnerOutput", "NewRequestData", "PriorityRequestQueue",
    "Scheduler", "SchedulerOutput", "SchedulingPolicy", "create_request_queue",
]
