"""Our V1 scheduler against vLLM 0.33's own ``Scheduler`` and ``AsyncScheduler``, step by step.

Each workload runs on both, driven by one fake model; every ``SchedulerOutput`` (new and cached
requests, block ids, tokens per request, preempted, finished), every output of
``update_from_output`` and both schedulers' state are compared after every engine step. Named
workloads each force one behaviour (and check that it happened); random ones mix everything.
Two planted bugs (preempting the first running request instead of the last; admitting waiting
requests before serving the running ones) and a scheduler without async placeholders must fail.

Needs vLLM's core files (``python tools/vllm_kernels.py fetch-core``); skipped without them.
"""
import logging

import pytest

from paged_attention.v1.core import oracle
from paged_attention.v1.core.sched import differential as d
from paged_attention.v1.core.sched.scheduler import Scheduler, StepBudget

OK, WHY = oracle.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"vLLM's core not available: {WHY}")


@pytest.fixture(scope="module")
def o():
    loaded = oracle.load(scheduler=True)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return loaded


def run(o, workload: d.SchedulerWorkload, scheduler_cls=None) -> d.ReplayStats:
    return d.replay(workload, [d.our_side(workload, scheduler_cls), d.vllm_side(o, workload)])


# A small pool (the longest request just fits) and a big budget: preemptions are certain.
TIGHT = dict(num_blocks=18, max_num_seqs=8, max_num_batched_tokens=128, max_model_len=64,
             scheduler_reserve_full_isl=False, steps=200)

# name -> (workload, the statistic that must be > 0)
NAMED = {
    "tight pool preempts": (d.SchedulerWorkload("tight", 11, **TIGHT), "preemptions"),
    "preempted requests resume": (d.SchedulerWorkload("resume", 12, **TIGHT), "resumed"),
    "async, tight": (d.SchedulerWorkload("async", 13, async_scheduling=True, **TIGHT),
                     "preemptions"),
    "priority, tight": (d.SchedulerWorkload("priority", 14, policy="priority", **TIGHT),
                        "preemptions"),
    "V2 runner, tight": (d.SchedulerWorkload("v2", 15, use_v2_model_runner=True, **TIGHT),
                         "resumed"),
    "shared prefixes hit": (d.SchedulerWorkload("prefixes", 16, num_prefixes=1,
                                                prefix_len=(24, 40)), "prefix_hits"),
    "chunked prefill": (d.SchedulerWorkload("chunks", 17, max_num_batched_tokens=16,
                                            long_prefill_token_threshold=6), "chunked_prefills"),
    "max_num_seqs=2": (d.SchedulerWorkload("seqs", 18, max_num_seqs=2), "full_batch_steps"),
    "budget full": (d.SchedulerWorkload("budget", 19, max_num_batched_tokens=16),
                    "full_budget_steps"),
    "no chunked prefill": (d.SchedulerWorkload("whole", 20, enable_chunked_prefill=False,
                                               max_num_batched_tokens=128),
                           "full_batch_steps"),
    "hybrid groups, two block sizes": (
        d.SchedulerWorkload("hybrid", 21, groups=[("full", 4), ("window", 8, 11)],
                            num_blocks=40, max_num_batched_tokens=32), "prefix_hits"),
    "aborts and resets": (d.SchedulerWorkload("aborts", 22, p_abort=0.2, p_reset=0.05),
                          "resets"),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_workload_matches_vllm(o, name):
    workload, exercised = NAMED[name]
    stats = run(o, workload)
    assert getattr(stats, exercised) > 0, f"{name}: nothing exercised ({stats})"
    assert stats.finished > 0 and stats.tokens_scheduled > 0


@pytest.mark.parametrize("seeds", [range(0, 8), range(8, 16), range(16, 24)])
def test_random_workloads_match_vllm(o, seeds):
    total = d.ReplayStats()
    for seed in seeds:
        stats = run(o, d.SchedulerWorkload.random(seed))
        total.engine_steps += stats.engine_steps
        total.preemptions += stats.preemptions
        total.prefix_hits += stats.prefix_hits
    assert total.engine_steps == 300 * len(seeds)
    assert total.preemptions > 0 and total.prefix_hits > 0


# --------------------------------------------------------------------------------------------
# Planted bugs: the comparison must catch them
# --------------------------------------------------------------------------------------------

class PreemptsTheFirst(Scheduler):
    """Planted bug: out of blocks, it preempts the oldest running request, not the newest."""

    def _preemption_victim(self):
        return self.running[0]


class AdmitsBeforeDecoding(Scheduler):
    """Planted bug: waiting requests are admitted before the running ones get their tokens."""

    def schedule(self):
        self.kv_cache_manager.new_step_starts()
        step = StepBudget(self.max_num_scheduled_tokens, self.long_prefill_token_threshold)
        running = list(self.running)
        self._schedule_waiting(step)
        admitted = self.running[len(running):]
        self.running = running
        self._schedule_running(step)
        self.running += admitted
        return self._make_scheduler_output(step)


@pytest.mark.parametrize("bug", [PreemptsTheFirst, AdmitsBeforeDecoding])
def test_planted_bugs_are_caught(o, bug):
    workload = NAMED["tight pool preempts"][0]
    with pytest.raises(d.SchedulerMismatch, match="step"):
        run(o, workload, bug)


def test_async_workload_needs_the_async_scheduler(o):
    # The plain Scheduler in vLLM's async engine loop: no placeholders, so it plans the next
    # step without the token in flight.
    workload = NAMED["async, tight"][0]
    with pytest.raises(d.SchedulerMismatch):
        run(o, workload, Scheduler)
