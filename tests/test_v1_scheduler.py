"""The V1 scheduler on its own (no vLLM needed): the token budget, running requests first,
chunked prefill, prefix hits at admission, preemption by recomputation, max_num_seqs, stop
conditions, aborts, async scheduling's placeholders, and bad input refused with state unchanged.

Block size 4 throughout; block 0 is the null block, so a fresh pool hands out 1, 2, 3, ...
"""
import pytest
import torch

from paged_attention.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from paged_attention.v1.core import kv_cache_utils
from paged_attention.v1.core.request import Request, RequestStatus
from paged_attention.v1.core.sched.async_scheduler import AsyncScheduler
from paged_attention.v1.core.sched.differential import FakeSamplingParams
from paged_attention.v1.core.sched.messages import ModelRunnerOutput
from paged_attention.v1.core.sched.scheduler import Scheduler

BLOCK = 4


def config(num_blocks: int = 20) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["layer0"], spec)])


def scheduler(num_blocks: int = 20, cls: type = Scheduler, **kwargs) -> Scheduler:
    kwargs = dict(dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), **kwargs)
    return cls(config(num_blocks), **kwargs)


kv_cache_utils.init_none_hash(kv_cache_utils.sha256)
HASHER = kv_cache_utils.get_request_block_hasher(BLOCK, kv_cache_utils.sha256)


def request(rid: str, prompt, max_tokens: int = 16, eos=None, stop=None, priority: int = 0,
            arrival: float = 0.0) -> Request:
    return Request(rid, list(prompt), FakeSamplingParams(max_tokens, eos, stop), None,
                   priority=priority, arrival_time=arrival, block_hasher=HASHER)


def runner_output(s: Scheduler, out, tokens=None) -> ModelRunnerOutput:
    """One sampled token (``tokens[rid]``, else 100) for every request whose scheduled tokens
    reach the end of what it knows; none for a prefill chunk that stops short."""
    tokens = tokens or {}
    ids = list(out.num_scheduled_tokens)
    sampled = [[] if s.requests[r].is_prefill_chunk else [tokens.get(r, 100)] for r in ids]
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)


def step(s: Scheduler, tokens=None):
    out = s.schedule()
    results = s.update_from_output(out, runner_output(s, out, tokens))
    finished = {o.request_id: (o.new_token_ids, str(o.finish_reason), o.stop_reason)
                for outs in results.values() for o in outs.outputs if o.finished}
    return out, finished


def new_blocks(out) -> dict:
    return {n.req_id: [list(g) for g in n.block_ids] for n in out.scheduled_new_reqs}


# --------------------------------------------------------------------------------------------
# The budget
# --------------------------------------------------------------------------------------------

def test_one_budget_shared_with_a_chunked_prefill():
    s = scheduler(max_num_batched_tokens=12)
    s.add_request(request("a", range(10)))
    s.add_request(request("b", range(100, 106)))
    out, _ = step(s)
    # a takes 10 of the 12 tokens; b gets a chunk of the 2 left.
    assert list(out.num_scheduled_tokens.items()) == [("a", 10), ("b", 2)]
    assert out.total_num_scheduled_tokens == 12
    assert new_blocks(out) == {"a": [[1, 2, 3]], "b": [[4]]}
    assert s.requests["a"].num_output_tokens == 1 and s.requests["b"].num_output_tokens == 0
    out, _ = step(s)
    # Running requests in order: a's decode, then the rest of b's prompt (and its first token).
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 4)]
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["a", "b"] and cached.num_computed_tokens == [10, 2]
    assert cached.new_block_ids == [None, ([5],)]
    assert s.requests["b"].num_output_tokens == 1


def test_running_requests_are_served_before_waiting_ones():
    s = scheduler(max_num_batched_tokens=8)
    s.add_request(request("a", range(4)))
    step(s)
    s.add_request(request("b", range(100, 120)))
    out, _ = step(s)
    # a's decode comes first; b's prompt gets what is left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]


def test_long_prefill_threshold_caps_a_prompt_unless_alone():
    s = scheduler(long_prefill_token_threshold=5)
    s.add_request(request("a", range(20)))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20}          # alone: nobody to starve
    s.add_request(request("b", range(100, 120)))
    s.add_request(request("c", range(200, 220)))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 5), ("c", 5)]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    s = scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(request("a", range(40)))
    s.add_request(request("b", range(100, 130)))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 40}          # 30 more would not fit: b waits
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 30}


def test_max_num_seqs_limits_the_running_requests():
    s = scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(request(rid, range(4), max_tokens=2))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    out, finished = step(s)                               # a and b reach max_tokens=2
    assert set(finished) == {"a", "b"} and list(out.num_scheduled_tokens) == ["a", "b"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"c": 4} and out.finished_req_ids == {"a", "b"}


# --------------------------------------------------------------------------------------------
# Prefix hits and preemption
# --------------------------------------------------------------------------------------------

def test_a_shared_prefix_is_a_hit_at_admission():
    s = scheduler()
    s.add_request(request("a", range(10)))
    s.add_request(request("b", list(range(8)) + [99, 98, 97]))
    out, _ = step(s)
    # b's first two blocks were cached when a allocated them, earlier in the same step.
    assert new_blocks(out) == {"a": [[1, 2, 3]], "b": [[1, 2, 4]]}
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 8]
    assert out.num_scheduled_tokens == {"a": 10, "b": 3}


def test_hits_need_caching():
    s = scheduler(enable_caching=False)
    s.add_request(request("a", range(10)))
    s.add_request(request("b", list(range(8)) + [99, 98, 97]))
    out, _ = step(s)
    assert new_blocks(out) == {"a": [[1, 2, 3]], "b": [[4, 5, 6]]}
    assert out.num_scheduled_tokens == {"a": 10, "b": 11}


def test_out_of_blocks_the_last_running_request_is_preempted_by_recomputation():
    # 6 usable blocks; three 8-token prompts fill them. Every decode then needs a new block.
    s = scheduler(num_blocks=7, scheduler_reserve_full_isl=False)
    for rid in "abc":
        s.add_request(request(rid, [ord(rid)] * 8, max_tokens=10))
    out, _ = step(s)
    assert new_blocks(out) == {"a": [[1, 2]], "b": [[3, 4]], "c": [[5, 6]]}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    out, _ = step(s)
    # a's decode needs a block: c (the last running) is preempted, its two blocks freed; a
    # and b each get one of them. c goes back to the front of the queue, its output kept.
    assert out.preempted_req_ids == {"c"}
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]
    assert out.scheduled_cached_reqs.new_block_ids == [([6],), ([5],)]
    c = s.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.output_token_ids == [100]
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    # Nobody is admitted in a step that preempted, even if blocks were left.
    s.add_request(request("d", [7], max_tokens=1))
    out, _ = step(s)
    assert "d" not in out.num_scheduled_tokens


def test_a_preempted_request_comes_back_first_with_all_its_tokens():
    s = scheduler(num_blocks=7, scheduler_reserve_full_isl=False)
    for rid in "abc":
        s.add_request(request(rid, [ord(rid)] * 8, max_tokens=2))
    step(s)
    out, finished = step(s)                  # c preempted; a and b finish (max_tokens=2)
    assert out.preempted_req_ids == {"c"} and set(finished) == {"a", "b"}
    s.add_request(request("d", [1, 2, 3]))
    out, _ = step(s)
    # c is back before d, as a resumed request: prompt and generated token recomputed.
    assert list(out.num_scheduled_tokens) == ["c", "d"]
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["c"] and cached.resumed_req_ids == {"c"}
    assert cached.all_token_ids == {"c": [ord("c")] * 8 + [100]}
    # Its own blocks were reused by a and b, so nothing is cached for it.
    assert out.num_scheduled_tokens["c"] == 9 and cached.num_computed_tokens == [0]


def test_v2_model_runner_takes_a_resumed_request_as_new():
    s = scheduler(num_blocks=7, scheduler_reserve_full_isl=False, use_v2_model_runner=True)
    for rid in "abc":
        s.add_request(request(rid, [ord(rid)] * 8, max_tokens=2))
    step(s)
    step(s)
    out, _ = step(s)
    assert out.scheduled_cached_reqs.req_ids == []
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "c" and new.prefill_token_ids == [ord("c")] * 8 + [100]
    assert new.prompt_token_ids == [ord("c")] * 8


def test_priority_policy_preempts_the_lowest_priority():
    s = scheduler(num_blocks=7, scheduler_reserve_full_isl=False, policy="priority")
    for rid, priority in (("a", 1), ("b", 0), ("c", 0)):
        s.add_request(request(rid, [ord(rid)] * 8, max_tokens=10, priority=priority,
                              arrival=float(ord(rid))))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["b", "c", "a"]     # admitted by priority
    out, _ = step(s)
    assert out.preempted_req_ids == {"a"}                         # priority 1 is the lowest


def test_reset_prefix_cache_needs_idle_blocks_or_preempts_everyone():
    s = scheduler()
    s.add_request(request("a", range(10)))
    step(s)
    assert s.reset_prefix_cache() is False
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert s.running == [] and [r.request_id for r in s.waiting] == ["a"]
    out, _ = step(s)
    assert out.preempted_req_ids == {"a"} and out.scheduled_cached_reqs.resumed_req_ids == {"a"}


# --------------------------------------------------------------------------------------------
# Stopping and aborting
# --------------------------------------------------------------------------------------------

def test_stop_conditions():
    s = scheduler(max_model_len=12)
    s.add_request(request("eos", range(4), eos=7))
    s.add_request(request("stop", range(4), stop=[8, 9]))
    s.add_request(request("length", range(4), max_tokens=2))
    s.add_request(request("context", range(10), max_tokens=50))
    finished = {}
    for _ in range(3):
        finished.update(step(s, tokens={"eos": 7, "stop": 9})[1])
    assert finished == {"eos": ([7], "stop", None), "stop": ([9], "stop", 9),
                        "length": ([100], "length", None), "context": ([100], "length", None)}
    assert s.requests == {} and not s.has_unfinished_requests()
    # Every block is back (block 0, the null block, is never handed out).
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 19
    assert s.get_kv_cache_usage() == 0.0


def test_finish_requests_aborts_running_and_waiting_requests():
    s = scheduler(max_num_seqs=1)
    s.add_request(request("a", range(6)))
    s.add_request(request("b", range(6)))
    out = s.schedule()
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    aborted = s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in aborted) == ["a", "b"]
    assert aborted[0].get_finished_reason() is not None
    assert s.running == [] and len(s.waiting) == 0 and s.requests == {}
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 2
    # The step that was running when a was aborted comes back: nothing to report.
    assert s.update_from_output(out, runner_output_for(out)) == {}
    assert s.schedule().finished_req_ids == {"a", "b"}
    assert s.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []


def runner_output_for(out) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[5] for _ in ids])


def test_include_finished_set_reports_finished_ids_per_client():
    s = scheduler(include_finished_set=True)
    s.add_request(request("a", range(4), max_tokens=1))
    out = s.schedule()
    results = s.update_from_output(out, runner_output(s, out))
    assert results[0].finished_requests == {"a"}


# --------------------------------------------------------------------------------------------
# Async scheduling
# --------------------------------------------------------------------------------------------

def test_async_scheduler_plans_one_step_ahead_with_placeholders():
    s = scheduler(cls=AsyncScheduler)
    s.add_request(request("a", range(4), max_tokens=3))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 4}
    a = s.requests["a"]
    assert a.num_output_placeholders == 1 and a.num_tokens == 4
    # The next step is scheduled before the first one's token is known.
    second = s.schedule()
    assert second.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    s.update_from_output(first, runner_output_for(first))
    assert a.num_output_placeholders == 1 and a.output_token_ids == [5]
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    s.update_from_output(second, runner_output_for(second))
    # Two tokens known and the third in flight: max_tokens=3 is reached, nothing more to run.
    assert s.schedule().num_scheduled_tokens == {}
    results = s.update_from_output(third, runner_output_for(third))
    assert results[0].outputs[0].finished and a.output_token_ids == [5, 5, 5]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 19


def test_async_output_caches_the_blocks_its_tokens_fill():
    # Under async scheduling a block's last token is known only when its step's output comes
    # back. After every update, each block both computed and hashed must be cached, also in
    # the update that finishes the request (its blocks are freed cached, to the back of the
    # free queue) and in the steps where no block fills (the update skips the manager then).
    # Every prompt length and max_tokens modulo the block size is tried.
    s = scheduler(cls=AsyncScheduler, max_num_seqs=16)
    for p in range(1, BLOCK + 1):
        for m in range(BLOCK + 1, 2 * BLOCK + 1):
            s.add_request(request(f"{p}-{m}", range(100 * m + 10 * p, 100 * m + 11 * p),
                                  max_tokens=m))
    manager, pool_blocks = s.kv_cache_manager, s.kv_cache_manager.block_pool.blocks
    in_flight = [s.schedule()]
    num_checked = 0
    while s.requests:
        in_flight.append(s.schedule())
        done = in_flight.pop(0)
        requests = dict(s.requests)
        block_ids = {rid: manager.get_block_ids(rid)[0] for rid in requests}
        s.update_from_output(done, runner_output_for(done))
        for rid, r in requests.items():
            computed = min(r.num_computed_tokens - r.num_in_flight_tokens, r.num_tokens)
            expected = min(computed // BLOCK, len(r.block_hashes))
            # (At least these: a schedule may cache a block whose tokens are still in flight.)
            assert all(pool_blocks[i].block_hash is not None
                       for i in block_ids[rid][:expected]), (rid, r.num_tokens)
            num_checked += r.is_finished() and expected > 0
    assert num_checked == BLOCK * BLOCK


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error", [
    (dict(max_num_seqs=0), ValueError),
    (dict(max_num_seqs="2"), TypeError),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), ValueError),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), ValueError),
    (dict(long_prefill_token_threshold=65), ValueError),
    (dict(policy="lifo"), ValueError),
    (dict(watermark=1.0), ValueError),
    (dict(enable_caching=1), TypeError),
    (dict(block_size=0), ValueError),
])
def test_bad_configuration_is_refused(kwargs, error):
    with pytest.raises(error):
        scheduler(**kwargs)


def test_kv_cache_config_must_be_one():
    with pytest.raises(TypeError):
        Scheduler(None)


def test_bad_requests_are_refused_and_change_nothing():
    s = scheduler(max_model_len=16)
    s.add_request(request("a", range(4)))
    with pytest.raises(ValueError, match="already"):
        s.add_request(request("a", range(8)))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(request("long", range(16)))
    with pytest.raises(TypeError):
        s.add_request("b")
    tiny = scheduler(num_blocks=4, max_model_len=16)         # 3 usable blocks: 12 tokens
    tiny.add_request(request("fits", range(4), max_tokens=8))
    with pytest.raises(ValueError, match="blocks"):
        tiny.add_request(request("never", range(4), max_tokens=9))
    assert list(tiny.requests) == ["fits"]
    running = request("r", range(4))
    running.status = RequestStatus.RUNNING
    with pytest.raises(ValueError, match="not new"):
        s.add_request(running)
    assert list(s.requests) == ["a"] and [r.request_id for r in s.waiting] == ["a"]
    assert s.requests["a"].num_tokens == 4
    with pytest.raises(ValueError):
        s.finish_requests("a", RequestStatus.RUNNING)
    assert s.requests["a"].status == RequestStatus.WAITING
    assert step(s)[0].num_scheduled_tokens == {"a": 4}


def test_priority_preemption_of_a_request_scheduled_earlier_gives_its_tokens_back():
    # Running order b, a, c with b the lowest priority: when c's chunk finds no free block, b
    # (already given a token this step) is preempted, and its token goes back to the budget.
    s = scheduler(num_blocks=9, max_num_seqs=4, max_num_batched_tokens=8,
                  scheduler_reserve_full_isl=False, policy="priority")
    s.add_request(request("b", [1] * 7, max_tokens=20, priority=1, arrival=0))
    step(s)
    s.add_request(request("a", [2] * 7, max_tokens=20, priority=0, arrival=1))
    step(s)
    s.add_request(request("c", [3] * 14, max_tokens=4, priority=0, arrival=2))
    out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"b": 1, "a": 1, "c": 6}
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"}
    assert dict(out.num_scheduled_tokens) == {"a": 1, "c": 6}
    assert out.total_num_scheduled_tokens == 7
    # The next step starts from a full budget again: c's last 2 prompt tokens and a's decode.
    out, _ = step(s)
    assert dict(out.num_scheduled_tokens) == {"a": 1, "c": 2}
    assert out.total_num_scheduled_tokens == 3


def test_outputs_are_grouped_per_client_in_step_order():
    # Requests of two clients interleaved in one step: each client gets its own requests'
    # outputs, in the order they ran.
    s = scheduler()
    for rid, client in (("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2)):
        r = request(rid, [ord(rid)] * 3, max_tokens=5)
        r.client_index = client
        s.add_request(r)
    out = s.schedule()
    results = s.update_from_output(out, runner_output(s, out))
    assert {client: [o.request_id for o in outs.outputs] for client, outs in results.items()} \
        == {0: ["a", "c"], 1: ["b", "d"], 2: ["e"]}
    assert list(results) == [0, 1, 2]


def test_a_manager_that_overrides_allocate_slots_is_asked_for_every_running_request():
    # The running loop may skip allocate_slots' own entry for the manager's fast path; a
    # manager class with its own allocate_slots must still get every call.
    s = scheduler()
    calls = []

    class Recording(type(s.kv_cache_manager)):
        def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
            calls.append((request.request_id, num_new_tokens))
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)

    s.kv_cache_manager.__class__ = Recording
    for rid in "ab":
        s.add_request(request(rid, [ord(rid)] * 8, max_tokens=5))
    step(s)
    del calls[:]
    step(s)
    assert calls == [("a", 1), ("b", 1)]


def test_every_attribute_a_request_is_made_with_has_a_slot():
    # The scheduler reaches a dozen of a request's attributes per step; past 30 attributes
    # CPython keeps them in a plain dict unless they have slots. One set in the constructor
    # without a slot would land in __dict__ (still correct, only slower): none may.
    r = request("a", [1, 2, 3])
    assert vars(r) == {}
    r.anything_else = 1         # attributes set from outside still work
    assert r.anything_else == 1 and vars(r) == {"anything_else": 1}
