"""The model runner's pieces (paged_attention/engine/model_runner.py) on the tiny model, on a CPU:
request states, the packed inputs of a mixed batch, tokens fed from the device, and the padded
batch a CUDA graph runs (the padding computed eagerly here, where graphs cannot be captured)."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch

from paged_attention.engine import LLM, SamplingParams
from paged_attention.engine.cuda_graphs import StepGraphs
from paged_attention.engine.model_runner import RequestStates
from paged_attention.model import LlamaForCausalLM
from paged_attention.utils import PAD_SLOT_ID
from paged_attention.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tests.test_engine import GREEDY, TINY, W, prompts, tokens

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(TINY, W, attention="reference")


def test_request_states_refuse_without_changing_anything():
    states = RequestStates(2, 32, CPU)
    a = states.add("a", [1, 2, 3], 0, GREEDY)
    before = (dict(states.index_of), list(states._free), states.token_ids.copy())
    for args in [("a", [4], 0), ("b", [], 0), ("b", [1] * 33, 0), ("b", [1, 2], 2)]:
        with pytest.raises(ValueError):
            states.add(args[0], args[1], args[2], GREEDY)
    assert (dict(states.index_of), list(states._free)) == before[:2] and np.array_equal(states.token_ids, before[2])
    b = states.add("b", [7, 8], 1, GREEDY)
    with pytest.raises(ValueError, match="request states are taken"):
        states.add("c", [1], 0, GREEDY)
    assert states.remove("a") == a and states.remove("a") is None
    assert states.add("c", [5], 0, GREEDY) == a != b                     # the row is reused
    assert states.pad_row == 2 and states.last_sampled.shape == (3,)


def test_request_states_refuse_bad_tokens_or_params_without_taking_a_row():
    states = RequestStates(3, 32, CPU)
    a = states.add("a", [1, 2, 3], 0, GREEDY)
    before = (dict(states.index_of), list(states._free), list(states.req_ids), states.prefill_len.copy())
    for ids, params, error in [([1, 2 ** 40], GREEDY, (OverflowError, ValueError)), ([1, None], GREEDY, TypeError),
                               ([1, 2], object(), AttributeError)]:
        with pytest.raises(error):
            states.add("b", ids, 0, params)
        assert (dict(states.index_of), list(states._free), list(states.req_ids)) == before[:3]
        assert np.array_equal(states.prefill_len, before[3])
    assert states.add("b", [7, 8], 1, GREEDY) != a and states.token_ids[states.index_of["b"], :2].tolist() == [7, 8]


def _new(rid: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(rid, tokens, GREEDY, (blocks,), computed, prefill_token_ids=tokens)


def test_a_mixed_batch_is_packed_as_the_kernels_need_it(model):
    """A decode (its token sampled last step, known only on the device) and a prefill chunk: the
    positions, the token ids (-1: from the device), the rows and the slots, checked by hand."""
    llm = LLM(model, num_gpu_blocks=32, block_size=4, max_num_seqs=4)
    runner = llm.engine.runner
    first = SchedulerOutput([_new("a", [5, 6, 7], [3])], CachedRequestData.make_empty(), {"a": 3}, 3, set())
    runner.execute_model(first).get_output()
    row_a = runner.states.index_of["a"]
    sampled = int(runner.states.last_sampled[row_a])
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.new_block_ids, cached.num_computed_tokens = ["a"], [None], [3]
    so = SchedulerOutput([_new("b", list(range(10, 16)), [9, 2])], cached, {"a": 1, "b": 5}, 6, set())
    runner.update_states(so)
    inputs = runner.prepare_inputs(so)
    row_b = runner.states.index_of["b"]
    assert inputs.idx_mapping.tolist() == [row_a, row_b]
    assert inputs.batch.query_start_loc.tolist() == [0, 1, 6]
    assert inputs.batch.seq_lens.tolist() == [4, 5]
    assert inputs.positions.tolist() == [3, 0, 1, 2, 3, 4]
    assert inputs.token_ids.tolist() == [-1, 10, 11, 12, 13, 14]          # a's token: the device's
    assert inputs.token_rows.tolist() == [row_a] + [row_b] * 5
    assert runner.input_ids(inputs.token_ids, inputs.token_rows).tolist() == [sampled, 10, 11, 12, 13, 14]
    # Slots: a's position 3 in block 3 (block size 4); b's positions 0..4 in blocks 9 then 2.
    assert inputs.batch.slot_mapping.tolist() == [15, 36, 37, 38, 39, 8]
    assert inputs.batch.block_tables[:, :2].tolist() == [[3, 0], [9, 2]]
    # b stops short of its 6 tokens: it samples nothing this step.
    assert inputs.samples.tolist() == [True, False]


class _EagerGraphs(StepGraphs):
    """``StepGraphs`` on a CPU: its keys (the same buckets and padding), each step run eagerly.
    Steps with prefills are padded too when ``mixed``."""

    def __init__(self, max_num_seqs: int, max_tokens: int, mixed: bool = False) -> None:
        super().__init__(max_num_seqs, max_tokens, 2048, torch.device("cpu"), max_mixed=32 if mixed else 0)
        self.seen = []

    def run(self, key, forward):
        self.seen.append(key)
        return forward()


def _generate_recording_slots(model: LlamaForCausalLM, llm: LLM, ps: list[list[int]], params=GREEDY):
    """``llm``'s tokens for ``ps`` (greedy by default), and the slot mapping of every layer call (copies)."""
    writes = []
    write = model.ops.rope_and_cache

    def spy(qkv, rope, kv_cache, slot_mapping):
        writes.append(slot_mapping.clone())
        return write(qkv, rope, kv_cache, slot_mapping)
    model.ops.rope_and_cache = spy
    try:
        return tokens(llm.generate(ps, params, use_tqdm=False)), writes
    finally:
        del model.ops.rope_and_cache


@pytest.mark.parametrize("block_tables", ["v1", "v2"])
def test_padded_decode_batches_change_no_token_and_write_nothing(model, block_tables):
    """Decode batches padded to a graph's bucket (rows of the padding state: one key read, no
    slot written): the same tokens as unpadded, and the padding leaves the caches untouched."""
    ps = prompts(5, seed=21)
    kw = dict(num_gpu_blocks=64, max_num_seqs=8, block_tables=block_tables, max_model_len=128,
              max_num_batched_tokens=256)
    plain = LLM(model, **kw)
    want = tokens(plain.generate(ps, GREEDY, use_tqdm=False))
    padded = LLM(model, **kw)
    padded.engine.runner.graphs = graphs = _EagerGraphs(8, 256)
    got, writes = _generate_recording_slots(model, padded, ps)
    assert got == want
    assert {k[0] for k in graphs.seen} == {8}                              # 5 requests in a batch of 8
    decode_slots = [s for s in writes if s.numel() == 8]
    assert decode_slots and all((s[5:] == PAD_SLOT_ID).all() and (s[:5] >= 0).all() for s in decode_slots)


@pytest.mark.parametrize("greedy", [True, False])
def test_decode_graphs_that_copy_and_gather_their_inputs_give_the_same_tokens(model, greedy):
    """On a GPU a decode graph copies its packed inputs, gathers the tables' rows over the padded
    batch (padding requests bring no token: no slot written) and, greedy, copies its tokens out,
    reading and writing the pinned buffers of the turns it was captured in (keys carry them).
    Here the same path runs eagerly, with two host buffers and a device buffer of their own:
    the same tokens as unpadded, whichever turn a step falls on, requests finishing mid-batch."""
    ps = prompts(5, seed=24)
    params = [SamplingParams(temperature=0 if greedy else 1.0, seed=i, max_tokens=8 + 2 * i, ignore_eos=True)
              for i in range(5)]
    kw = dict(num_gpu_blocks=64, max_num_seqs=8, block_tables="v2", max_model_len=128, max_num_batched_tokens=256)
    want = tokens(LLM(model, **kw).generate(ps, params, use_tqdm=False))
    padded = LLM(model, **kw)
    runner = padded.engine.runner
    runner.graphs = graphs = _EagerGraphs(8, 256)
    bufs = runner.buffers
    bufs.host = [bufs.host[0], torch.zeros_like(bufs.host[0])]
    bufs.host_np = [h.numpy() for h in bufs.host]
    bufs.device, bufs._views, bufs._copies, bufs._layouts = torch.zeros_like(bufs.host[0]), {}, {}, [None, None]
    runner._inputs_in_graph = True
    got, writes = _generate_recording_slots(model, padded, ps, params)
    assert got == want
    decode_keys = [k for k in graphs.seen if k[2] == 1]
    if greedy:
        assert {k[4:] for k in decode_keys} == {(0, "greedy", 0), (1, "greedy", 1)}
    else:
        assert {k[4:] for k in decode_keys} == {(0,), (1,)}
    per_step = writes[::model.config.num_hidden_layers]
    assert len(per_step) == len(padded.engine.step_stats)
    padding = set()
    for s, slots in zip(padded.engine.step_stats, per_step):
        if s.decode_only:
            assert (slots[:s.num_reqs] >= 0).all() and (slots[s.num_reqs:] == PAD_SLOT_ID).all()
            padding.add(slots.numel() - s.num_reqs)
    assert len(padding) > 1                 # batches of 5, 4, 3, ... requests: 3 padding rows, none, 1, ...


@pytest.mark.parametrize("block_tables", ["v1", "v2"])
def test_padded_steps_with_prefills_change_no_token_and_write_nothing(model, block_tables):
    """Steps with prefills padded as a CUDA graph runs them (requests with no token, tokens of
    no request; prompts of different lengths, chunked by a small step, prefix hits): the same
    tokens as unpadded, and the padding tokens write no slot."""
    ps = prompts(5, seed=23)
    ps = [p[:n] for p, n in zip(ps, (9, 23, 5, 17, 30))] + [ps[1][:23] + [7, 8, 9]]   # the last shares a prefix
    kw = dict(num_gpu_blocks=64, max_num_seqs=8, block_tables=block_tables, max_model_len=128,
              max_num_batched_tokens=40, block_size=4)
    want = tokens(LLM(model, **kw).generate(ps, GREEDY, use_tqdm=False))
    padded = LLM(model, **kw)
    padded.engine.runner.graphs = graphs = _EagerGraphs(8, 40, mixed=True)
    got, writes = _generate_recording_slots(model, padded, ps)
    assert got == want
    mixed = [k for k in graphs.seen if k[2] > 1]
    assert mixed and any(k[1] > 1 and k[0] > 1 for k in mixed)
    # Each step wrote every layer with its slot mapping: its real tokens' slots, then padding.
    per_step = writes[::model.config.num_hidden_layers]
    assert len(per_step) == len(padded.engine.step_stats)
    padded_steps = 0
    for s, slots in zip(padded.engine.step_stats, per_step):
        assert (slots[:s.num_tokens] >= 0).all() and (slots[s.num_tokens:] == PAD_SLOT_ID).all()
        padded_steps += not s.decode_only and slots.numel() > s.num_tokens
    assert padded_steps


def test_unseeded_and_seeded_sampling_through_the_runner(model):
    """Seeded requests keep their draws whatever the batch and whatever preemptions happen; the
    runner keeps each one's generator until it finishes."""
    ps = prompts(3, length=20, seed=22)
    params = [SamplingParams(temperature=1.5, max_tokens=16, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    roomy = tokens(LLM(model, num_gpu_blocks=64).generate(ps, params, use_tqdm=False))
    tight = LLM(model, num_gpu_blocks=10, block_size=8)
    assert tokens(tight.generate(ps, params, use_tqdm=False)) == roomy
    assert tight.engine.runner.num_preemptions > 0


def test_a_step_reads_nothing_back_to_the_host(model, monkeypatch):
    """What async scheduling rests on: launching a step (prefills, decodes, mixed batches; V1's
    chunks) reads no tensor back to the host, so the host can go on to the next step at once.
    Only ``get_output`` waits, for the tokens. Checked with the reference kernels (the
    interpreter's own copies would count as reads)."""
    from tests.test_model import _NoHostReads

    def write(key, value, key_cache, value_cache, slot_mapping, *args):
        # The reference write finds its tokens with nonzero (a read); a device-side stand-in.
        keep = slot_mapping >= 0
        slots = torch.where(keep, slot_mapping, 0)
        b, o = slots // key_cache.size(1), slots % key_cache.size(1)
        key_cache[b, o] = torch.where(keep[:, None, None], key, key_cache[b, o])
        value_cache[b, o] = torch.where(keep[:, None, None], value, value_cache[b, o])
    monkeypatch.setattr(model.attn, "_write", write)
    llm = LLM(model, num_gpu_blocks=64, max_num_batched_tokens=40, max_num_seqs=4)
    want = tokens(LLM(model, num_gpu_blocks=64).generate(prompts(3, seed=24, prefix=prompts(1, length=24, seed=23)[0]),
                                                         GREEDY, use_tqdm=False))
    runner = llm.engine.runner
    execute = runner.execute_model

    def watched(so):
        with _NoHostReads():
            return execute(so)
    monkeypatch.setattr(runner, "execute_model", watched)
    system = prompts(1, length=24, seed=23)[0]
    out = llm.generate(prompts(3, seed=24, prefix=system), GREEDY, use_tqdm=False)
    assert tokens(out) == want
    assert any(not s.decode_only for s in llm.engine.step_stats)            # prefill chunks ran too


def test_step_graph_keys_pad_each_shape_up_and_cap_prefill_shapes():
    """``StepGraphs``' keys (no GPU needed to ask them): a decode batch goes to its bucket; a step
    with prefills pads its requests the same way, its tokens to a power of two then a multiple of
    1024 (never past the step's budget), its longest query to a power of two; past ``max_mixed``
    shapes a new one gets no graph, and the shapes already seen keep theirs."""
    from paged_attention.engine.cuda_graphs import graph_batch_sizes, token_bucket

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert [token_bucket(n) for n in (1, 3, 1024, 1025, 5000)] == [1, 4, 1024, 2048, 5120]
    graphs = StepGraphs(40, 4000, 2048, torch.device("cpu"), max_mixed=2)
    assert graphs.key(3, 256) == (4, 4, 1, 256) and graphs.key(33, 512) == (40, 40, 1, 512)
    assert graphs.key(41, 256) is None
    assert graphs.mixed_key(3, 100, 37, 256) == (4, 128, 64, 256)
    assert graphs.mixed_key(17, 3900, 1000, 2048) == (32, 4000, 1024, 2048)     # tokens capped at the budget
    assert graphs.mixed_key(5, 100, 37, 256) is None                             # a third shape: eager
    assert graphs.mixed_key(4, 128, 64, 256) == (4, 128, 64, 256)                # a shape seen keeps its graph
    assert graphs.pool is None and not graphs.graphs                             # nothing captured by asking


def test_cached_batch_rows_and_index_follow_every_change():
    """The rows and the output index of the last batch serve again only while the batch and its
    requests' rows are the same: a request that leaves and comes back (a preemption) takes
    another row, and a list changed in place, or the same requests in another order, is a new
    batch."""
    states = RequestStates(4, 32, CPU)
    for rid in "abc":
        states.add(rid, [1, 2], 0, GREEDY)
    batch = ["a", "b"]
    assert states.rows(batch).tolist() == [states.index_of["a"], states.index_of["b"]]
    with pytest.raises(ValueError):
        states.rows(batch)[0] = 3                      # shared by the steps that reuse it: read-only
    states.remove("a")
    states.add("d", [1], 0, GREEDY)                    # takes a's row
    states.add("a", [1, 2], 0, GREEDY)                 # a comes back in another row
    assert states.rows(batch).tolist() == [states.index_of["a"], states.index_of["b"]]
    batch[1] = "c"                                     # the caller's list, changed in place
    assert states.rows(batch).tolist() == [states.index_of["a"], states.index_of["c"]]
    assert states.rows(["c", "a"]).tolist() == [states.index_of["c"], states.index_of["a"]]

    runner = LLM(LlamaForCausalLM(TINY, W), num_gpu_blocks=16, max_num_seqs=4).engine.runner
    ids, index = runner.batch_index(["a", "b", "c"])
    assert runner.batch_index(["a", "b", "c"]) == (ids, index) and index == {"a": 0, "b": 1, "c": 2}
    assert runner.batch_index(["c", "a", "b"])[1] == {"c": 0, "a": 1, "b": 2}
    assert runner.batch_index(["c", "a"]) == (["c", "a"], {"c": 0, "a": 1})


def test_cached_all_greedy_follows_a_row_taken_by_another_request():
    """Whether a batch is all greedy is remembered for its rows array, but a request added into
    one of its rows (a sampled one into a greedy one's) makes it be worked out again."""
    states = RequestStates(4, 32, CPU)
    for rid in "ab":
        states.add(rid, [1, 2], 0, GREEDY)
    rows = states.rows(["a", "b"])
    assert states.all_greedy(rows)
    states.remove("b")
    states.add("c", [1, 2], 0, SamplingParams(temperature=1.0, seed=0))     # takes b's row
    assert states.index_of["c"] == rows[1]
    assert not states.all_greedy(rows)
    assert not states.all_greedy(states.rows(["a", "c"])) and states.all_greedy(states.rows(["a"]))


def test_a_graphs_first_rows_view_is_made_once_per_output_tensor():
    """A replay returns the same output tensor, whose ``[:n]`` view serves again; the first,
    eager run of a key returns another tensor, whose rows must not be read through the old view."""
    runner = LLM(LlamaForCausalLM(TINY, W), num_gpu_blocks=16, max_num_seqs=4).engine.runner
    key = (4, 4, 1, 256, "greedy")
    eager, replayed = torch.arange(4), torch.arange(10, 14)
    assert runner._first_rows(key, eager, 3).tolist() == [0, 1, 2]
    view = runner._first_rows(key, replayed, 3)
    assert view.tolist() == [10, 11, 12] and runner._first_rows(key, replayed, 3) is view
    assert runner._first_rows(key, replayed, 2).tolist() == [10, 11]


@pytest.mark.parametrize("short", [2, 3])
def test_a_decode_step_refilling_only_lengths_packs_what_a_full_fill_packs(model, short):
    """A decode step of the rows its host buffer was last filled for writes only the lengths
    and positions; the buffer must then hold what filling all of it would. Two host buffers and
    a device buffer of their own, padded batches (as on a GPU: 3 and 4 requests both run as 4),
    requests that finish while others come in (the padded batch keeps its size but changes
    rows), each step packed twice: as the runner does, then with the buffer's layout forgotten
    (a full fill)."""
    llm = LLM(model, num_gpu_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    runner.graphs = _EagerGraphs(4, 256)
    bufs = runner.buffers
    bufs.host = [bufs.host[0], torch.zeros_like(bufs.host[0])]
    bufs.host_np = [h.numpy() for h in bufs.host]
    bufs.device, bufs._views, bufs._copies, bufs._layouts = torch.zeros_like(bufs.host[0]), {}, {}, [None, None]
    real, holds = runner.prepare_inputs, bufs.holds
    fast = []
    bufs.holds = lambda layout: fast.append(holds(layout)) or fast[-1]

    def packed_twice(so):
        inputs = real(so)
        turn = bufs._turn
        got = bufs.host_np[turn].copy()
        bufs._layouts[turn], bufs._turn = None, (turn + 1) % 2
        real(so)
        assert bufs._turn == turn and np.array_equal(got, bufs.host_np[turn])
        return inputs
    runner.prepare_inputs = packed_twice
    lens = [short, 30, short + 12, 24, 20, 10]
    ps = prompts(6, length=6)
    out = llm.generate(ps, [dataclasses.replace(GREEDY, max_tokens=k) for k in lens], use_tqdm=False)
    assert [len(t) for t in tokens(out)] == lens and sum(fast) >= 8


def test_the_step_stats_cover_every_moment_of_a_step(model, monkeypatch):
    """With a clock that moves one tick at each reading, a moment of ``step`` that no phase
    records shows as missing ticks: each call must take exactly its phases' ticks, plus the two
    readings around it. (Steps that ran no token record nothing and are left out.)"""
    from paged_attention.engine import llm_engine, model_runner

    ticks = iter(range(10**9))

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return float(next(ticks))

    for module in (llm_engine, model_runner):
        monkeypatch.setattr(module, "time", Clock)
    for kw in (dict(async_scheduling=True), dict(async_scheduling=False), dict(core="v0")):
        llm = LLM(model, num_gpu_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=32,
                  max_model_len=32, **kw)
        engine, step = llm.engine, llm.engine.step
        launched, checked = [], []

        class Recording(collections.deque):        # the steps launched, as the engine queues them
            def append(self, item):
                launched.append(item)
                super().append(item)

        def timed_step():
            first, in_flight = len(engine.step_stats), len(engine._in_flight)
            launched.clear()
            t = Clock.perf_counter()
            done = step()
            took = Clock.perf_counter() - t
            stats = engine.step_stats[first:]
            updated = in_flight + len(launched) - len(engine._in_flight)
            if all(p.num_tokens for _, p, _ in launched) and len(stats) == updated:
                recorded = sum(s.wait + s.update for s in stats)
                recorded += sum(sched + p.prepare + p.forward + p.sample for _, p, sched in launched)
                checked.append((took, recorded + 2))
            return done

        engine._in_flight, engine.step = Recording(), timed_step
        params = [dataclasses.replace(GREEDY, max_tokens=m) for m in (3, 9, 6, 12)]
        llm.generate(prompts(4, length=12), params, use_tqdm=False)
        assert len(checked) >= len(engine.step_stats) - 1
        assert [took for took, _ in checked] == [rec for _, rec in checked], kw


@pytest.mark.parametrize("block_tables", ["v2", "v2-vllm", "v1"])
def test_a_block_boundary_step_appends_what_one_row_at_a_time_appends(block_tables):
    # Every running request gains a block on the same step (one batch of appends), some gain
    # none; a resumed request makes the runner write one row at a time. The tables must end as
    # set_row one row at a time leaves them; a bad id in the batch raises set_row's error, and
    # with v2's tables no row changes.
    import types
    from paged_attention.engine.model_runner import ModelRunner
    from paged_attention.engine.tables import make_step_tables

    def runner():
        states = RequestStates(8, 64, CPU)
        tables = make_step_tables(block_tables, 4, 8, 64, 64, CPU)
        for i in range(6):
            tables.set_row(states.add(f"r{i}", [1, 2, 3], 0, GREEDY), [10 * i], overwrite=True)
        if block_tables != "v1":
            tables.tables.apply_staged_writes()
        return types.SimpleNamespace(states=states, tables=tables, _generators={}, num_preemptions=0)

    def counts(r):
        t = r.tables
        return (t.tables.num_blocks.np[0].tolist() if block_tables != "v1" else t.table.num_blocks_per_row.tolist())

    def step(new, resumed=frozenset()):
        ids = [f"r{i}" for i in range(6)]
        return SchedulerOutput([], CachedRequestData(ids, set(resumed), {}, new, [4] * 6, [1] * 6), {}, 0, set())

    new = [([61],), None, ([63],), ([],), ([65, 66],), ([67],)]
    batched, single = runner(), runner()
    ModelRunner.update_states(batched, step(new))
    for i, ids in enumerate(new):
        if ids and ids[0]:
            single.tables.set_row(single.states.index_of[f"r{i}"], ids[0], overwrite=False)
    assert counts(batched) == counts(single) == [2, 1, 2, 1, 3, 2, 0, 0]
    ModelRunner.update_states(batched, step([([70],), ([71],), None, None, None, None], resumed={"r1"}))
    assert counts(batched)[:2] == [3, 1]
    if block_tables != "v1":
        assert batched.tables.tables.block_tables[0].staged_writes() == [
            (0, 1, (61,)), (2, 1, (63,)), (4, 1, (65, 66)), (5, 1, (67,)), (0, 2, (70,)), (1, 0, (71,))]

    if block_tables != "v1":
        batched.tables.tables.apply_staged_writes()
    bad = [([80],), ([81],), ([-1],), ([83],), None, None]
    before = counts(batched)
    with pytest.raises(ValueError) as got:
        ModelRunner.update_states(batched, step(bad))
    with pytest.raises(ValueError) as want:
        single.tables.set_row(2, [-1], overwrite=False)
    assert str(got.value) == str(want.value)
    if block_tables != "v1":                # v1's rows are written one at a time
        assert counts(batched) == before


def _state_snapshot(states: RequestStates) -> tuple:
    """What the request states hold: the free rows in order, and each request's row and values
    (a free row's leftover values are never read)."""
    held = {rid: (row, states.req_ids[row], states.params[row], int(states.prefill_len[row]),
                  int(states.num_computed[row]), bool(states.greedy[row]),
                  states.token_ids[row, :states.prefill_len[row]].tolist())
            for rid, row in states.index_of.items()}
    return list(states._free), held, [r for r in states.req_ids if r is not None]


def test_add_many_takes_the_rows_one_by_one_adds_take_or_none():
    """A batch of requests gets the rows, tokens, counts and sampling that adding them one by one
    gives; a bad request anywhere in the batch (ids, lengths, tokens, params, too many) raises
    with no request of the batch added."""
    sampled = SamplingParams(temperature=1.0, seed=3)
    batch = [("a", [1, 2, 3], 0, GREEDY), ("b", [4, 5], 1, sampled), ("c", list(range(9)), 4, GREEDY)]
    one, many = RequestStates(5, 16, CPU), RequestStates(5, 16, CPU)
    for states in (one, many):
        states.add("x", [9], 0, GREEDY)
        states.remove("x")                               # a freed row: the free list's order matters
    rows = [one.add(*args) for args in batch]
    got = many.add_many(*map(list, zip(*batch)))
    assert got.tolist() == rows
    assert _state_snapshot(many) == _state_snapshot(one) and many.req_ids == one.req_ids
    assert many.add_many([], [], [], []).tolist() == []

    before = _state_snapshot(many)
    for bad, error in [
            ([("d", [1], 0, GREEDY), ("a", [1], 0, GREEDY)], ValueError),           # holds a row already
            ([("d", [1], 0, GREEDY), ("d", [2], 0, GREEDY)], ValueError),           # twice in the batch
            ([("d", [1], 0, GREEDY), ("e", [1] * 17, 0, GREEDY)], ValueError),      # past max_model_len
            ([("d", [1], 0, GREEDY), ("e", [1, 2], 2, GREEDY)], ValueError),        # nothing left to compute
            ([("d", [1], 0, GREEDY), ("e", [1, 2 ** 40], 0, GREEDY)], (OverflowError, ValueError)),
            ([("d", [1], 0, GREEDY), ("e", [1, None], 0, GREEDY)], TypeError),
            ([("d", [1], 0, GREEDY), ("e", [1], 0, object())], AttributeError),
            ([(r, [1], 0, GREEDY) for r in "defg"], ValueError)]:                   # 3 rows free
        with pytest.raises(error):
            many.add_many(*map(list, zip(*bad)))
        assert _state_snapshot(many) == before
    with pytest.raises(ValueError, match="token lists"):
        many.add_many(["d", "e"], [[1]], [0, 0], [GREEDY, GREEDY])
    assert _state_snapshot(many) == before


@pytest.mark.parametrize("block_tables", ["v2", "v1"])
def test_a_steps_new_requests_are_added_all_or_none(block_tables):
    """The runner adds a step's new requests as one batch: the same rows and table rows as one at
    a time, and when one of them cannot be added (here: more blocks than its table row holds)
    the error is the one-at-a-time error and no request of the step holds a row."""
    import types
    from paged_attention.engine.model_runner import ModelRunner
    from paged_attention.engine.tables import make_step_tables

    def runner():
        tables = make_step_tables(block_tables, 4, 8, 64, 16, CPU)    # rows of 4 blocks
        return types.SimpleNamespace(states=RequestStates(8, 16, CPU), tables=tables, _generators={},
                                     num_preemptions=0, _generator=lambda params: None,
                                     _add_requests=lambda new: ModelRunner._add_requests(r, new))

    def counts(r):
        t = r.tables
        return (t.tables.num_blocks.np[0].tolist() if block_tables != "v1" else t.table.num_blocks_per_row.tolist())

    def step(new):
        return SchedulerOutput(new, CachedRequestData.make_empty(), {n.req_id: 1 for n in new}, len(new), set())

    r = runner()
    ModelRunner.update_states(r, step([_new("a", [1, 2, 3], [7]), _new("b", [4] * 9, [3, 4, 5])]))
    single = make_step_tables(block_tables, 4, 8, 64, 16, CPU)
    for rid, ids in (("a", [7]), ("b", [3, 4, 5])):
        single.set_row(r.states.index_of[rid], ids, overwrite=True)
    assert r.states.index_of == {"a": 0, "b": 1} and counts(r)[:3] == [1, 3, 0]
    if block_tables != "v1":
        assert (r.tables.tables.block_tables[0].staged_writes() == single.tables.block_tables[0].staged_writes()
                == [(0, 0, (7,)), (1, 0, (3, 4, 5))])
        r.tables.tables.apply_staged_writes()
    before, before_counts = _state_snapshot(r.states), counts(r)
    bad = [_new("c", [1], [8]), _new("d", [1] * 16, [9, 10, 11, 12, 13])]
    with pytest.raises(ValueError) as got:
        ModelRunner.update_states(r, step(bad))
    with pytest.raises(ValueError) as want:
        single.set_row(3, [9, 10, 11, 12, 13], overwrite=True)
    assert str(got.value).replace("request state 3", "request state 2") == str(want.value).replace(
        "request state 3", "request state 2")
    assert _state_snapshot(r.states) == before
    if block_tables != "v1":                # v1's rows are written one at a time (no request holds them)
        assert counts(r) == before_counts and r.tables.tables.block_tables[0].num_staged_writes == 0
    ModelRunner.update_states(r, step(bad[:1]))     # then the good one alone takes the next row
    assert r.states.index_of["c"] == 2
