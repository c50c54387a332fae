"""vLLM V1's asynchronous scheduler (``vllm/v1/core/sched/async_scheduler.py``).

With async scheduling the engine schedules step N+1 while the model still runs step N, so that
the GPU never waits for the CPU's bookkeeping. Step N+1 must then be planned without knowing the
token step N samples. Each request that samples in a step gets a *placeholder* for that token
(``num_output_placeholders``), counted as if it were known: the next step schedules the request
for one more token, and the worker fills the real token id in on the GPU. When the output
arrives, ``update_from_output`` turns a placeholder into the token (and, where a stop ends the
request early, the placeholders into nothing).

Everything else is the ``Scheduler``'s: the scheduler takes the placeholders into account where
they matter (how many tokens a request is behind; not scheduling a request whose last token is
already in flight; output arriving for a request preempted since).
"""
from __future__ import annotations

from paged_attention.v1.core.sched.scheduler import Scheduler

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """The ``Scheduler`` planning one step ahead of the model (same arguments). vLLM overrides
    ``_update_after_schedule`` to add each sampling request's placeholder after the base
    update; here the base update's own loop does it when ``holds_output_placeholders`` is set,
    one pass over the step's requests instead of two."""

    # Two steps in flight: the one the model runs, and the one just scheduled.
    max_concurrent_batches = 2
    holds_output_placeholders = True
