"""The engine (paged_attention/engine/): LLM, SamplingParams, generate, chat.

Most cases run a tiny random Llama (2 layers, fp32), fast enough to drive hundreds of steps:
paged generation equals a dense contiguous-cache forward, batched equals solo, the prefix cache
and preemption (by swap and by recompute) change no token, and neither do the block size, the
table classes, the attention kernels, the core (V0's scheduler and block manager, or V1's) or
async scheduling. Bad input is refused before anything runs and leaves the engine as it was.
The real SmolLM2 then answers, and its greedy tokens equal those of Hugging Face
``transformers`` loading the same GGUF file. (The model runner's own pieces: test_engine_runner.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.engine import LLM, RequestOutput, SamplingParams
from paged_attention.kernels import KernelUnavailable
from paged_attention.legacy.records import RECOMPUTED, SWAPPED_IN, SWAPPED_OUT
from paged_attention.model import LlamaConfig, LlamaForCausalLM, load_gguf, random_weights
from paged_attention.model.dense import dense_generate

CPU = torch.device("cpu")
TINY = LlamaConfig.tiny(tie_word_embeddings=False)


def _sensitive_weights() -> dict[str, torch.Tensor]:
    """Random weights whose greedy tokens depend on the whole context. With plain random weights
    and tied embeddings a tiny model repeats one token whatever came before, so a wrong key or a
    lost block would change nothing. Untied, with attention projections doubled and embeddings
    scaled by 0.3, changing the third of 20 prompt tokens changes almost every one of the 16
    tokens that follow."""
    weights = random_weights(TINY, seed=0)
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            weights[name] = weights[name] * 2
        elif name == "model.embed_tokens.weight":
            weights[name] = weights[name] * 0.3
    return weights


W = _sensitive_weights()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tiny_model(attention: str = "reference", device: torch.device = CPU) -> LlamaForCausalLM:
    return LlamaForCausalLM(TINY, W, attention=attention, device=device)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


def prompts(n: int, length: int = 20, seed: int = 0, prefix: list[int] = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, TINY.vocab_size, (length + 3 * i,), generator=g).tolist()
            for i in range(n)]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# The cores and scheduling modes every invariance is checked under.
CORES = [dict(core="v0"), dict(core="v1", async_scheduling=False), dict(core="v1", async_scheduling=True)]
CORE_IDS = ["v0", "v1-sync", "v1-async"]


def engine(model: LlamaForCausalLM, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("num_cpu_blocks", 32 if kw.get("core") == "v0" else 0)
    return LLM(model, **kw)


def assert_idle(llm: LLM) -> None:
    """No request left behind, every block back in its pool, no request state held."""
    eng = llm.engine
    assert not eng.has_unfinished_requests() and not eng.requests
    if eng.core_name == "v0":
        mgr = eng.block_manager
        assert mgr.get_num_free_gpu_blocks() == mgr.num_total_gpu_blocks
        assert mgr.get_num_free_cpu_blocks() == mgr.num_total_cpu_blocks
        assert not mgr.block_tables
    else:
        pool = eng.core.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1          # all but the null block
        assert not eng.core.scheduler.requests


# --------------------------------------------------------------------------------------------
# Paged equals dense; batched equals solo; the outputs
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_paged_equals_dense(model, kw):
    ps = prompts(3)
    out = engine(model, **kw).generate(ps, GREEDY, use_tqdm=False)
    for p, o in zip(ps, out):
        assert o.outputs[0].token_ids == dense_generate(TINY, W, p, GREEDY.max_tokens)


@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_batched_equals_solo(model, kw):
    ps = prompts(5, seed=1)
    llm = engine(model, **kw)
    batched = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    solo = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in ps]
    assert batched == solo
    assert_idle(llm)


def test_the_cores_and_async_scheduling_agree(model):
    """V0's scheduler, V1's, and V1's one step ahead: the same tokens for the same requests, with
    shared prefixes, uneven lengths and early stops, in a pool tight enough to preempt."""
    system = prompts(1, length=20, seed=25)[0]
    ps = prompts(3, seed=26) + prompts(3, length=3, seed=27, prefix=system)
    free = tokens(engine(model).generate(ps, GREEDY, use_tqdm=False))
    stop = free[0][3]                                      # ends some requests early, not all
    params = [SamplingParams(temperature=0, max_tokens=8 + 2 * i, stop_token_ids=[stop]) for i in range(len(ps))]
    runs = {}
    for kw, name in zip(CORES, CORE_IDS):
        llm = engine(model, num_gpu_blocks=14, block_size=8, **kw)
        runs[name] = tokens(llm.generate(ps, params, use_tqdm=False))
        assert llm.engine.runner.num_preemptions > 0, name
    assert runs["v0"] == runs["v1-sync"] == runs["v1-async"]
    assert any(len(t) < p.max_tokens for t, p in zip(runs["v0"], params))      # some stopped early


def test_async_generate_launches_the_first_step_before_queuing_the_rest(model):
    """With async scheduling, generate() launches its first step once the queue holds that step's
    token budget, and queues the other prompts while it runs: the first step is as full as it would
    be with every prompt queued, and the tokens are those of synchronous scheduling."""
    ps = prompts(6, length=12, seed=28)                   # 12, 15, 18, ... tokens; a budget of 32
    sync = tokens(engine(model, core="v1", async_scheduling=False, max_num_batched_tokens=32,
                         max_num_seqs=4).generate(ps, GREEDY, use_tqdm=False))
    llm = engine(model, core="v1", async_scheduling=True, max_num_batched_tokens=32, max_num_seqs=4)
    eng, add = llm.engine, llm.engine._add_checked_request
    steps_before_add = []

    def spy(*args, **kwargs):
        steps_before_add.append(len(eng._in_flight))
        return add(*args, **kwargs)

    eng._add_checked_request = spy
    first = len(eng.step_stats)
    assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == sync
    # 12 + 15 tokens fit in 32; the third prompt fills the budget: the step launched then.
    assert steps_before_add == [0, 0, 0, 1, 1, 1]
    assert eng.step_stats[first].num_tokens == 32
    assert_idle(llm)


def test_outputs_in_input_order_with_their_fields(model):
    ps = prompts(4, seed=2)
    lens = [3, 9, 1, 5]
    out = engine(model).generate(ps, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens],
                                 use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == ps
    assert [len(o.outputs[0].token_ids) for o in out] == lens
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in out)
    assert len({o.request_id for o in out}) == 4
    single = engine(model).generate(ps[0], GREEDY, use_tqdm=False)          # one prompt of token ids
    assert len(single) == 1 and single[0].prompt_token_ids == ps[0]
    as_dict = engine(model).generate({"prompt_token_ids": ps[0]}, GREEDY, use_tqdm=False)
    assert tokens(as_dict) == tokens(single)


@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_stop_tokens_and_ignore_eos(model, kw):
    p = prompts(1, seed=3)[0]
    free = tokens(engine(model, **kw).generate(p, GREEDY, use_tqdm=False))[0]
    stop = free[4]
    first = free.index(stop)
    out = engine(model, **kw).generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]),
                                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:first + 1] and out.finish_reason == "stop"   # the stop token is kept
    # The model's end token stops a request unless ignore_eos.
    llm = engine(model, **kw)
    llm.engine.eos_token_ids = frozenset({stop})
    assert tokens(llm.generate(p, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False))[0] == free[:first + 1]
    assert tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] == free


@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_params_shared_by_prompts_keep_their_own_stops(model, kw):
    """A generate call checks and copies each params object once, and the core reuses one copy
    with its stop tokens for consecutive requests given the same one: params interleaved in one
    call, and one params object changed between two calls, each still stop where they say."""
    p = prompts(1, seed=3)[0]
    free = tokens(engine(model, **kw).generate(p, GREEDY, use_tqdm=False))[0]
    stop = free[4]
    cut = free[:free.index(stop) + 1]
    stopping = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    llm = engine(model, **kw)
    assert tokens(llm.generate([p] * 4, [stopping, GREEDY, stopping, GREEDY], use_tqdm=False)) == [cut, free] * 2
    changing = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert tokens(llm.generate([p, p], changing, use_tqdm=False)) == [free, free]
    changing.stop_token_ids = [stop]
    assert tokens(llm.generate([p, p], changing, use_tqdm=False)) == [cut, cut]


def test_equal_params_objects_share_one_check(model):
    """A list of equal params objects (one per prompt, as a benchmark builds them) is checked
    once per run of equal neighbours; params that differ, however slightly, get their own check
    and keep their own stops; fields ``==`` cannot compare (numpy arrays) count as different."""
    p = prompts(1, seed=3)[0]
    llm = engine(model)
    free = tokens(llm.generate(p, GREEDY, use_tqdm=False))[0]
    stop = free[4]
    cut = free[:free.index(stop) + 1]

    def params(**kw):
        return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)

    calls, check = [], llm.engine.check_request
    llm.engine.check_request = lambda ids, sp: calls.append(sp) or check(ids, sp)
    never = next(t for t in range(100, 1000) if t not in free)
    given = [params(stop_token_ids=[stop]), params(stop_token_ids=[stop]), params(), params(),
             params(stop_token_ids=[stop]), params(stop_token_ids=[never])]
    assert tokens(llm.generate([p] * 6, given, use_tqdm=False)) == [cut, cut, free, free, cut, free]
    assert [c is g for c, g in zip(calls, [given[0], given[2], given[4], given[5]])] == [True] * 4 and len(calls) == 4
    calls.clear()
    arrays = [params(), params()]
    for sp in arrays:
        sp.stop_token_ids = np.array([stop, never])     # set after construction: not normalised yet
    assert tokens(llm.generate([p] * 2, arrays, use_tqdm=False)) == [cut, cut] and len(calls) == 2
    # A bad params object equal to a good one checked before it cannot exist (the check sees
    # the same fields); one after a good one is refused as it would be alone, nothing queued.
    bad = params()
    bad.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([p] * 2, [params(), bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_context_length_ends_a_request(model):
    p = prompts(1, length=20, seed=4)[0]
    out = engine(model, max_model_len=25).generate(p, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    ps = prompts(3, seed=5)
    params = [SamplingParams(temperature=2.0, top_p=0.95, max_tokens=10, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    llm = engine(model)
    batched = tokens(llm.generate(ps, params, use_tqdm=False))
    solo = [tokens(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(ps, params)]
    assert batched == solo
    greedy = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    assert batched != [g[:10] for g in greedy]                        # sampling is not greedy
    reseeded = [SamplingParams(temperature=2.0, top_p=0.95, max_tokens=10, seed=s, ignore_eos=True) for s in (4, 5, 6)]
    assert batched != tokens(llm.generate(ps, reseeded, use_tqdm=False))     # another seed, other draws


def test_top_p_keeps_the_most_likely_tokens():
    from paged_attention.engine.sampler import top_p_filter
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    assert top_p_filter(probs, 0.5).tolist() == [0, 0.5, 0, 0]
    assert top_p_filter(probs, 0.6).tolist() == [0, 0.5, 0, 0.25]
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()


def test_batch_limits(model):
    ps = prompts(5, seed=6)
    llm = engine(model, max_num_seqs=2, core="v0")
    out = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    assert max(len(r.running) for r in llm.engine.history) == 2
    assert all(r.owners_recorded for r in llm.engine.history)
    quiet = engine(model, record_block_owners=False, core="v0")
    assert tokens(quiet.generate(ps, GREEDY, use_tqdm=False)) == out
    assert not any(r.gpu_owners for r in quiet.engine.history)
    from paged_attention.viz import draw_pool_over_time
    with pytest.raises(ValueError, match="record_block_owners"):      # no empty picture passed off as real
        draw_pool_over_time(quiet.engine.history, 64)
    # At most 48 new tokens a step (no less than max_model_len, as vLLM V0 asks).
    llm2 = engine(model, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=48, core="v0")
    assert tokens(llm2.generate(ps, GREEDY, use_tqdm=False)) == out
    assert max(s.num_tokens for s in llm2.engine.step_stats) <= 48
    # V1: the same limits, and prompts longer than a step's budget run in chunks.
    for asynchronous in (False, True):
        v1 = engine(model, max_num_seqs=2, max_num_batched_tokens=16, async_scheduling=asynchronous)
        assert tokens(v1.generate(ps, GREEDY, use_tqdm=False)) == out
        stats = v1.engine.step_stats
        assert max(s.num_reqs for s in stats) == 2 and max(s.num_tokens for s in stats) <= 16
        assert sum(not s.decode_only for s in stats) > len(ps)           # prompts of 20+ tokens: chunks


# --------------------------------------------------------------------------------------------
# The prefix cache, preemption, block sizes, tables and kernels change no token
# --------------------------------------------------------------------------------------------

def test_prefix_cache_on_equals_off(model):
    system = prompts(1, length=40, seed=7)[0]
    ps = prompts(4, length=5, seed=8, prefix=system) + [system[:32]]      # the last: a whole-prompt hit
    on = engine(model, enable_prefix_caching=True, core="v0")
    off = engine(model, enable_prefix_caching=False, core="v0")
    out_on = on.generate(ps, GREEDY, use_tqdm=False)
    assert tokens(out_on) == tokens(off.generate(ps, GREEDY, use_tqdm=False))
    # All five are admitted in the same step: they share the prompt's full blocks (one physical
    # copy), but none is computed yet when the others are admitted, so none is a cache hit.
    assert [o.num_cached_tokens for o in out_on] == [0] * 5
    first = on.engine.history[0]
    assert max(owner.num_holders for owner in first.gpu_owners.values()) == 5
    again = on.generate(ps, GREEDY, use_tqdm=False)      # later: every full block is cached
    assert tokens(again) == tokens(out_on)
    # Every full block of each prompt is a hit; prompts of 48 and 32 tokens are hit whole (their
    # last token is run again for its logits, its KV not rewritten).
    assert [len(p) for p in ps] == [45, 48, 51, 54, 32]
    assert [o.num_cached_tokens for o in again] == [32, 48, 48, 48, 32]
    one_by_one = engine(model, max_num_seqs=1, core="v0")
    out = one_by_one.generate(ps, GREEDY, use_tqdm=False)
    assert tokens(out) == tokens(out_on) and [o.num_cached_tokens for o in out] == [0, 32, 32, 32, 32]
    assert_idle(on)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_v1_prefix_cache_on_equals_off(model, asynchronous):
    """V1 caches a block as soon as it is allocated (requests admitted in one step share their
    prompt's full blocks as hits), and never the whole prompt: the last token always runs."""
    system = prompts(1, length=40, seed=7)[0]
    ps = prompts(4, length=5, seed=8, prefix=system) + [system[:32]]
    on = engine(model, enable_prefix_caching=True, async_scheduling=asynchronous)
    off = engine(model, enable_prefix_caching=False, async_scheduling=asynchronous)
    out_on = on.generate(ps, GREEDY, use_tqdm=False)
    assert tokens(out_on) == tokens(off.generate(ps, GREEDY, use_tqdm=False))
    assert [o.num_cached_tokens for o in out_on] == [0, 32, 32, 32, 16]
    again = on.generate(ps, GREEDY, use_tqdm=False)
    assert tokens(again) == tokens(out_on)
    # Prompts of 45, 48, 51, 54 and 32 tokens: every full block but a last one that would cover
    # the whole prompt (48 -> 32, 32 -> 16).
    assert [o.num_cached_tokens for o in again] == [32, 32, 48, 48, 16]
    assert_idle(on)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_changes_no_token(model, mode):
    ps = prompts(4, length=30, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = tokens(engine(model, num_gpu_blocks=64).generate(ps, params, use_tqdm=False))
    llm = engine(model, num_gpu_blocks=14, num_cpu_blocks=16, block_size=8, preemption_mode=mode, core="v0")
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == roomy
    kinds = {e.kind for r in llm.engine.history for e in r.events}
    if mode == "swap":
        assert {SWAPPED_OUT, SWAPPED_IN} <= kinds
    else:
        assert RECOMPUTED in kinds and SWAPPED_OUT not in kinds
    assert_idle(llm)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_v1_preemption_changes_no_token(model, asynchronous):
    """A tight pool: V1 preempts the newest request by recomputation (and under async
    scheduling, while its next token is still being sampled); the tokens are a roomy pool's."""
    ps = prompts(4, length=30, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = tokens(engine(model, num_gpu_blocks=64).generate(ps, params, use_tqdm=False))
    llm = engine(model, num_gpu_blocks=15, block_size=8, async_scheduling=asynchronous)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == roomy
    assert llm.engine.runner.num_preemptions > 0
    assert_idle(llm)


def test_swap_moves_the_real_cache(model):
    """A swapped-out request's blocks are on the CPU pool, bit for bit, while it waits."""
    ps = prompts(4, length=30, seed=9)
    llm = engine(model, num_gpu_blocks=14, num_cpu_blocks=16, block_size=8, core="v0")
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    checked = 0
    while eng.has_unfinished_requests():
        before = [(k.clone(), v.clone()) for k, v in eng.kv_caches]
        eng.step()
        for gpu, cpu in eng.history[-1].blocks_to_swap_out:
            for (k, v), (ck, cv) in zip(before, eng.cpu_kv_caches):
                assert torch.equal(ck[cpu], k[gpu]) and torch.equal(cv[cpu], v[gpu])
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_size_changes_no_token(model, block_size):
    ps = prompts(3, seed=10)
    assert tokens(engine(model, block_size=block_size).generate(ps, GREEDY, use_tqdm=False)) == \
        tokens(engine(model, block_size=16).generate(ps, GREEDY, use_tqdm=False))


def test_v1_and_v2_tables_agree():
    ps = prompts(3, seed=11)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128)
    model = tiny_model("reference", runtime.DEVICE)          # v2's kernels run where Triton does
    v1 = engine(model, block_tables="v1", **kw)
    v2 = engine(model, block_tables="v2", **kw)
    out = tokens(v1.generate(ps, GREEDY, use_tqdm=False))
    assert tokens(v2.generate(ps, GREEDY, use_tqdm=False)) == out
    assert type(v2.engine.tables).__name__ == "V2StepTables"


def test_reference_and_triton_attention_agree():
    ps = prompts(2, length=12, seed=12)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = tokens(engine(tiny_model("reference")).generate(ps, short, use_tqdm=False))
    tri = engine(tiny_model("triton", runtime.DEVICE), max_model_len=64, max_num_seqs=4,
                 max_num_batched_tokens=64)
    assert tokens(tri.generate(ps, short, use_tqdm=False)) == ref


# --------------------------------------------------------------------------------------------
# Bad input: a typed error before anything runs, the engine usable afterwards
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("core", ["v0", "v1"])
def test_bad_requests_are_refused_before_anything_runs(model, core):
    llm = engine(model, num_gpu_blocks=8, block_size=8, max_model_len=100, core=core)
    ok = prompts(1, seed=13)[0]
    want = tokens(llm.generate(ok, GREEDY, use_tqdm=False))
    steps = len(llm.engine.step_stats)
    bad = [
        ([], ValueError, "no prompts"),
        ([[]], ValueError, "empty"),
        ([ok, []], ValueError, "empty"),
        ([ok, [1] * 100], ValueError, "context"),                     # longer than max_model_len
        ([ok, [1] * 70], ValueError, "pool can never"),               # 9 blocks of 8 > 8 blocks
        ([ok, [5, TINY.vocab_size]], ValueError, "outside the vocabulary"),
        ([ok, [5, -1]], ValueError, "outside the vocabulary"),
        ([ok, [5, 2.0]], TypeError, "ints"),
        ("text without a tokenizer", ValueError, "tokenizer"),
        (42, TypeError, "prompts"),
    ]
    for prompt, error, match in bad:
        with pytest.raises(error, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([ok], [GREEDY, GREEDY], use_tqdm=False)
    assert len(llm.engine.step_stats) == steps     # nothing was scheduled
    assert_idle(llm)
    assert tokens(llm.generate(ok, GREEDY, use_tqdm=False)) == want


@pytest.mark.parametrize("kwargs, error", [
    (dict(max_tokens=0), ValueError), (dict(max_tokens=1.5), TypeError), (dict(temperature=-1), ValueError),
    (dict(temperature=float("nan")), ValueError), (dict(top_p=0), ValueError), (dict(top_p="1"), TypeError),
    (dict(seed=-1), ValueError), (dict(stop_token_ids=[1, "2"]), TypeError), (dict(ignore_eos=1), TypeError),
])
def test_bad_sampling_params(kwargs, error):
    with pytest.raises(error):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(attention="flash"), ValueError, "unknown attention"),
    (dict(dtype="int8"), TypeError, "dtype"),
    (dict(dtype=torch.float64), TypeError, "dtype"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(block_tables="v3"), ValueError, "block_tables"),
    (dict(preemption_mode="kill"), ValueError, "preemption_mode"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(max_model_len=10**6), ValueError, "context"),
    (dict(core="v2"), ValueError, "core"),
    (dict(async_scheduling="yes"), TypeError, "async_scheduling"),
    (dict(core="v0", async_scheduling=True), ValueError, "async_scheduling needs core='v1'"),
    (dict(preemption_mode="swap"), ValueError, "recomputation only"),
    (dict(record_gpu_time=1), TypeError, "record_gpu_time"),
    (dict(num_cpu_blocks=8), ValueError, "swap pool"),
])
def test_bad_engine_arguments_fail_before_loading(monkeypatch, kwargs, error, match):
    import paged_attention.engine.llm as llm_module

    def no_load(*a, **k):
        raise AssertionError("the weights were read before the arguments were checked")
    if "max_model_len" not in kwargs:
        monkeypatch.setattr(llm_module, "load_gguf", no_load)
    with pytest.raises(error, match=match):
        LLM(**kwargs)


def test_gpu_only_attention_on_the_cpu_is_unavailable(model):
    with pytest.raises(KernelUnavailable):
        LLM(attention="cuda", device="cpu")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_v1_core_that_schedules_nothing_ends_with_a_typed_error(model, monkeypatch, asynchronous):
    """A core that stops scheduling (planted: its scheduler hands out empty steps) must not make
    ``generate`` spin: a few empty steps, then ``SchedulerStalled``, the engine idle and usable."""
    from paged_attention.engine.llm_engine import SchedulerStalled
    from paged_attention.v1.core.sched.output import SchedulerOutput
    llm = engine(model, async_scheduling=asynchronous)
    ps = prompts(2, seed=19)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    eng, ran = llm.engine, len(llm.engine.step_stats)
    monkeypatch.setattr(eng.core.scheduler, "schedule", SchedulerOutput.make_empty)
    calls, step = [0], eng.step

    def counted():
        calls[0] += 1
        return step()
    monkeypatch.setattr(eng, "step", counted)
    with pytest.raises(SchedulerStalled, match="scheduled nothing"):
        llm.generate(ps, GREEDY, use_tqdm=False)
    assert calls[0] <= 5 and len(eng.step_stats) == ran                      # a few empty steps, none recorded
    monkeypatch.undo()
    assert_idle(llm)
    assert tokens(llm.generate(ps, GREEDY, use_tqdm=False)) == want


@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_a_failing_step_frees_its_blocks(model, monkeypatch, kw):
    system = prompts(1, length=40, seed=14)[0]
    ps = prompts(3, length=6, seed=15, prefix=system)
    llm = engine(model, **kw)
    want = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    llm.engine.core.abort_all()                    # forget the prefix cache
    calls = {"n": 0}
    forward = model.hidden_states

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("the GPU fell over")
        return forward(*args, **kwargs)
    monkeypatch.setattr(model, "hidden_states", flaky)
    with pytest.raises(RuntimeError, match="fell over"):
        llm.generate(ps, GREEDY, use_tqdm=False)
    assert_idle(llm)
    monkeypatch.setattr(model, "hidden_states", forward)
    out = llm.generate(ps, GREEDY, use_tqdm=False)
    # The failed step's blocks were marked computed before its KV was written: the prefix cache
    # was emptied, so nothing half-written is offered now.
    assert tokens(out) == want and out[0].num_cached_tokens == 0
    assert_idle(llm)


# --------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct, against transformers (fp32, CPU)
# --------------------------------------------------------------------------------------------

CHATS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(device="cpu", dtype=torch.float32, num_gpu_blocks=256, num_cpu_blocks=0, max_num_seqs=8)


def test_france_answers_paris(smollm):
    out = smollm.chat([{"role": "user", "content": CHATS[0]}], SamplingParams(temperature=0, max_tokens=24),
                      use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop", out.outputs[0].text
    assert out.outputs[0].token_ids[-1] == 2        # <|im_end|>, kept in the tokens, not in the text


def test_greedy_tokens_equal_transformers(smollm, hf_model):
    tok = smollm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    out = smollm.generate(texts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for text, o in zip(texts, out):
        ids = torch.tensor([tok.encode(text)])
        assert o.prompt_token_ids == ids[0].tolist()
        with torch.inference_mode():
            theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                       eos_token_id=sorted(tok.stop_token_ids), pad_token_id=2)
        assert o.outputs[0].token_ids == theirs[0, ids.size(1):].tolist(), text


def test_real_model_batched_equals_solo_and_text_equals_ids(smollm):
    messages = [[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": c}]
                for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=12)
    batched = smollm.chat(messages, params, use_tqdm=False)
    solo = [smollm.chat(m, params, use_tqdm=False)[0] for m in messages]
    assert tokens(batched) == tokens(solo)
    assert [o.outputs[0].text for o in batched] == [o.outputs[0].text for o in solo]
    by_ids = smollm.generate([o.prompt_token_ids for o in batched], params, use_tqdm=False)
    assert tokens(by_ids) == tokens(batched)
    assert all(o.num_cached_tokens > 0 for o in by_ids)      # the same prompts again: prefix-cache hits


# --------------------------------------------------------------------------------------------
# On a GPU: CUDA graphs, and the kernels against each other in bf16
# --------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("kw", CORES, ids=CORE_IDS)
def test_cuda_graph_decode_equals_eager(kw):
    """On the GPU (Triton kernels, fp32, fused layer operations): decode steps replayed from graphs
    of padded buckets give the eager tokens, under each core, in a roomy and in a tight pool, with
    shared prefixes; the CPU reference agrees."""
    m = tiny_model("triton", runtime.DEVICE)
    assert m.fused
    system = prompts(1, length=24, seed=16)[0]
    ps = prompts(5, seed=17) + prompts(2, length=4, seed=18, prefix=system)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = tokens(engine(tiny_model(), **kw).generate(ps, params, use_tqdm=False))          # CPU, reference
    eager = tokens(engine(m, cuda_graphs=False, **kw).generate(ps, params, use_tqdm=False))
    llm = engine(m, cuda_graphs=True, record_gpu_time=True, **kw)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == eager == want
    assert any(s.cuda_graph for s in llm.engine.step_stats)
    assert {key[0] for key in llm.engine.runner.graphs.graphs} >= {8}          # 7 requests padded to 8
    # Steps with prefills ran from graphs too (padded), greedy ones sampling inside the graph.
    assert any(s.cuda_graph and not s.decode_only for s in llm.engine.step_stats)
    assert any(key[2] > 1 and key[-1] == "greedy" for key in llm.engine.runner.graphs.graphs)
    # Sampling outside the graph (seeded draws): the graphs' logits are the eager ones.
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    assert tokens(llm.generate(ps, sampled, use_tqdm=False)) == \
        tokens(engine(m, cuda_graphs=False, **kw).generate(ps, sampled, use_tqdm=False))
    tight = engine(m, cuda_graphs=True, num_gpu_blocks=20, block_size=8, **kw)
    assert tokens(tight.generate(ps, params, use_tqdm=False)) == want
    assert tight.engine.runner.num_preemptions > 0
    from paged_attention.bench.engine import gpu_timeline
    timeline = gpu_timeline([s for s in llm.engine.step_stats if s.decode_only])
    assert timeline is not None and timeline["gpu_busy_ms"] > 0 and 0 <= timeline["gpu_idle_share"] < 1


@pytest.mark.cuda
def test_gpu_idle_time_includes_the_hosts_preparation():
    """The GPU's idle time between decode steps counts a GPU waiting for the host to prepare the
    next step: with every preparation 20 ms longer (the GPU's step of this tiny model takes well
    under a millisecond), each gap is at least those 20 ms and the steps' busy time stays short.
    A start event recorded before the preparation would count the 20 ms as busy instead."""
    import time

    from paged_attention.bench.engine import gpu_timeline
    llm = engine(tiny_model("triton", runtime.DEVICE), cuda_graphs=True, record_gpu_time=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts(2), params, use_tqdm=False)          # graphs captured, kernels compiled
    runner, prepare = llm.engine.runner, llm.engine.runner.prepare_inputs

    def slow_prepare(so):
        time.sleep(0.02)
        return prepare(so)

    runner.prepare_inputs = slow_prepare
    first = len(llm.engine.step_stats)
    llm.generate(prompts(2, seed=1), params, use_tqdm=False)
    timeline = gpu_timeline([s for s in llm.engine.step_stats[first:] if s.decode_only])
    assert timeline is not None
    assert timeline["gpu_idle_ms"] >= 19 and timeline["gpu_busy_ms"] < 10, timeline


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["cuda", "vllm"])
def test_gpu_attention_agrees_with_triton_in_bf16(attention):
    """The same model through another kernel: the first two greedy tokens agree. (bf16 rounds each
    kernel's sums differently, so a later near-tie between two tokens may be broken either way.)"""
    config, weights = load_gguf()
    try:
        other = LlamaForCausalLM(config, weights, dtype=torch.bfloat16, device=runtime.DEVICE, attention=attention)
    except KernelUnavailable as e:
        pytest.skip(str(e))
    base = LlamaForCausalLM(config, weights, dtype=torch.bfloat16, device=runtime.DEVICE, attention="triton")
    kw = dict(num_gpu_blocks=256, num_cpu_blocks=0, max_num_seqs=8)
    a, b = LLM(base, **kw), LLM(other, **kw)
    ids = [list(range(100, 164)), list(range(500, 540))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        ta, tb = tokens(a.generate(ids, params, use_tqdm=False)), tokens(b.generate(ids, params, use_tqdm=False))
    except KernelUnavailable as e:
        pytest.skip(str(e))
    assert [t[:2] for t in ta] == [t[:2] for t in tb]


# --------------------------------------------------------------------------------------------
# The demo command
# --------------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paged_attention", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PAGED_ATTENTION_DEVICE": "cpu"})


def test_generate_command_prints_the_answer():
    done = _cli("generate", CHATS[0], "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_generate_command_refuses_bad_arguments():
    done = _cli("generate", "hi", "--max-tokens", "0")
    assert done.returncode == 2 and "max_tokens" in done.stderr
    assert _cli("nonsense").returncode == 2
