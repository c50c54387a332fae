"""The engine benchmark's pieces: the script runs (a tiny CPU configuration) and writes its log and
every figure, the memory arithmetic, the GPU timeline from events, and the drawings."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paged_attention.bench.engine import ABLATION, gpu_timeline, kv_capacity, random_workload, step_breakdown
from paged_attention.model import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_prints_and_writes_every_figure(tmp_path):
    # One thread: a tiny run, and a busy shared CPU makes torch's thread pool wait for its threads.
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--smoke", "--repeats",
                           "3", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PAGED_ATTENTION_DEVICE": "cpu", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "bench_engine.json").read_text())
    assert [r["requests"] for r in results["rows"]] == [1, 2]
    for row in results["rows"]:
        e = row["engine"]
        assert e["tokens_per_s"] > 0 and row["hf_dynamic"]["tokens_per_s"] > 0
        # Three rounds of each side, taking turns; each side's median round reported.
        assert row["repeats"] == 3
        for side in ("engine", "hf_dynamic"):
            rounds = row[f"{side}_tokens_per_s"]
            assert len(rounds) == 3 and row[side]["tokens_per_s"] == sorted(rounds)[1]
        assert row["ratio_to_best_hf"] == e["tokens_per_s"] / row["hf_dynamic"]["tokens_per_s"]
        assert e["num_tokens"] == row["hf_dynamic"]["num_tokens"] == 4 * row["requests"]
        assert e["core"] == "v1" and e["async_scheduling"] and e["python_us_per_seq"] > 0
        # Outside the decode steps: at least the prefill step, and less than the whole call.
        assert 0 < e["other_ms"] < 1e3 * e["seconds"]
        assert e["other_ms"] + e["decode_steps"] * e["ms_per_decode_step"] == pytest.approx(1e3 * e["seconds"])
        # The host's speed, probed before each engine round.
        assert len(row["host_probe_us"]) == 3 and all(p > 0 for p in row["host_probe_us"])
    assert results["host"]["probe_us"] > 0 and results["host"]["cpu"]
    nano = results["nano"]["engine"]
    assert results["nano"]["requests"] == 3 and 12 <= nano["num_tokens"] <= 36
    abl = results["ablation"]["rows"]
    assert [r["name"] for r in abl] == [name for name, _ in ABLATION]
    assert all(r["num_tokens"] == 2 * 4 for r in abl)
    assert [(r["core"], r["async_scheduling"]) for r in abl] == [("v0", False), ("v1", False), ("v1", True),
                                                                  ("v1", True)]
    assert results["memory"]["paged"] > results["memory"]["contiguous"]
    log = (tmp_path / "bench_engine.log").read_text()
    assert "engine tok/s" in log and "nano-vllm workload" in log and "ablation" in log and "rounds, tok/s" in log
    assert "engine ms outside decode steps" in log and "host probe us" in log and "# host: " in log
    assert "engine tok/s" in done.stdout


def test_host_probe_times_its_work(monkeypatch):
    """The probe runs its fixed work (each object's count moves by the number of calls it timed)
    and reports microseconds per call of it."""
    from paged_attention.bench import timing

    calls = []
    real = timing.best_us

    def spy(fn, min_time=0.02, repeat=5):
        before = timing._PROBE_ITEMS[0].count
        us = real(fn, min_time=min_time, repeat=repeat)
        calls.append(timing._PROBE_ITEMS[0].count - before)
        return us

    monkeypatch.setattr(timing, "best_us", spy)
    us = timing.host_probe_us()
    assert len(calls) == 1 and calls[0] >= 5          # at least one call in each of five batches
    assert all(item.count == timing._PROBE_ITEMS[0].count for item in timing._PROBE_ITEMS)
    assert timing._PROBE_TABLE["req-255"] == timing._PROBE_ITEMS[255].count
    assert 0 < us < 1e5


def test_kv_capacity_by_hand():
    config = LlamaConfig.tiny()   # K and V, 2 layers, 2 KV heads of 16 floats: 2*2*2*16*4 = 512 bytes a token
    cap = kv_capacity(config, 16, torch.float32, budget_bytes=1 << 20, prompt_len=20, output_len=10, max_model_len=512)
    assert cap["bytes_per_token"] == 512 and cap["num_blocks"] == 128      # 1 MiB / (512 * 16)
    assert cap["paged"] == 64                 # 30 tokens: 2 blocks of 16 each
    assert cap["contiguous"] == 4             # 1 MiB / (512 * 512 reserved tokens)


def test_random_workload_draws_in_range_and_repeats():
    prompts, lens = random_workload(50, 100, 1024, 500, seed=3)
    assert len(prompts) == len(lens) == 50
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in lens)
    assert len({len(p) for p in prompts}) > 30                    # lengths do vary
    assert random_workload(50, 100, 1024, 500, seed=3) == (prompts, lens)


class _Event:
    """A CUDA event's stand-in: a time in milliseconds."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: "_Event") -> float:
        return other.t - self.t


def test_gpu_timeline_and_step_breakdown_by_hand():
    # Three steps: busy 0-2, 3-5, 5-8 ms: idle gaps of 1 and 0 ms over 6 ms from the first end to the last.
    steps = [SimpleNamespace(step=i, gpu_events=(_Event(a), _Event(b))) for i, (a, b) in enumerate(((0, 2), (3, 5),
                                                                                                    (5, 8)))]
    t = gpu_timeline(steps)
    assert t == {"gpu_busy_ms": pytest.approx(7 / 3), "gpu_idle_ms": 0.5, "gpu_idle_share": pytest.approx(1 / 6)}
    assert gpu_timeline(steps[:1]) is None
    # A step left out between two (a prefill) is not idle time: only adjacent steps pair up.
    gap = [steps[0], SimpleNamespace(step=5, gpu_events=(_Event(20), _Event(21)))]
    assert gpu_timeline(gap) is None
    assert gpu_timeline(steps[:2] + gap[1:])["gpu_idle_ms"] == 1.0
    parts = dict(schedule=1e-3, prepare=2e-3, forward=1e-3, sample=0, wait=4e-3, update=1e-3)
    stat = SimpleNamespace(num_reqs=4, total=sum(parts.values()), **parts)
    b = step_breakdown([stat])
    assert b["host_ms"] == pytest.approx(5.0) and b["wait_ms"] == pytest.approx(4.0)
    assert b["python_us_per_seq"] == pytest.approx(1250)           # 5 ms of host time over 4 requests


def test_throughput_drawing_has_a_line_per_system():
    from paged_attention.viz import draw_engine_throughput
    rows = [{"requests": n, "engine": {"tokens_per_s": 100.0 * n}, "hf_dynamic": {"tokens_per_s": 10.0 * n},
             "hf_static": {"tokens_per_s": 30.0 * n}} for n in (1, 16)]
    ax = draw_engine_throughput({"rows": rows, "device": "X", "prompt_len": 128, "max_tokens": 128})
    assert len(ax.get_lines()) == 3
    with pytest.raises(ValueError):
        draw_engine_throughput({"rows": []})


def test_ablation_drawing_has_a_bar_per_configuration_and_part():
    from paged_attention.viz.engine_ablation import draw_engine_ablation
    parts = dict(schedule_ms=1.0, prepare_ms=0.5, forward_ms=0.2, sample_ms=0.1, update_ms=0.4, wait_ms=2.0)
    rows = [{"name": name, "tokens_per_s": 1000.0 * (i + 1), **parts} for i, (name, _) in enumerate(ABLATION)]
    rows[-1].update(gpu_busy_ms=3.0, gpu_idle_ms=0.3)
    left, right = draw_engine_ablation({"requests": 256, "prompt_len": 128, "max_tokens": 128, "rows": rows})
    assert len(left.patches) == 4 and [p.get_width() for p in left.patches] == [4000, 3000, 2000, 1000]
    assert len(right.patches) == 4 * 6 + 2            # six host parts each; the GPU's two parts once
    gpu = right.patches[6:8]                          # the last configuration is drawn first, host then GPU
    assert gpu[0].get_width() == 3.0 and gpu[1].get_x() == 3.0 and gpu[1].get_width() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="ablation"):
        draw_engine_ablation({"rows": [{"tokens_per_s": 1.0}]})


def test_committed_results_are_read_where_present(tmp_path):
    from paged_attention.bench.engine import load_results
    assert load_results(tmp_path / "none.json") is None
    (tmp_path / "r.json").write_text(json.dumps({"ablation": {"rows": []}}))
    assert load_results(tmp_path / "r.json") == {"ablation": {"rows": []}}


def _profile_engine():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_engine.py"
    spec = importlib.util.spec_from_file_location("profile_engine_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_engine_overrides_tiles_and_the_decode_launch(monkeypatch):
    """``--tile`` and ``--decode-launch`` change the tuning tables for the run, and a malformed
    value changes nothing."""
    import copy

    from paged_attention.kernels.triton import decode, fused_linear

    monkeypatch.setattr(fused_linear, "TUNED", copy.deepcopy(fused_linear.TUNED))
    monkeypatch.setattr(decode, "choose_launch", decode.choose_launch)
    before = copy.deepcopy(fused_linear.TUNED)
    pe = _profile_engine()
    for tile, launch in [("960,576,0,64=16,16", ""), ("960,576,2,64=16,32,64,4,3", ""),
                         ("960,576,0,64=16,8,64,4,3", ""),      # tl.dot rows with 8 columns: unbuildable
                         ("960,576,0,64=16,32,512,4,1,8", ""),  # a second K chunk below 16
                         ("960,576,0,64=16,32,64,4,3", "64,4"), ("", "48,4,3")]:
        with pytest.raises(ValueError):
            pe.apply_overrides(tile, launch)
        assert fused_linear.TUNED == before
    general = decode.choose_launch
    lines = pe.apply_overrides("960,576,0,64=16,64,64,8,2; 1536,576,1,256=32,64,64,4,3; 576,576,0,16=16,16,512,4,1,64",
                               "32,2,3")
    assert len(lines) == 4
    assert fused_linear.default_config(64, 960, 576) == fused_linear.FusedLinearConfig(16, 64, 64, 8, 2)
    assert fused_linear.default_config(16, 576, 576) == fused_linear.FusedLinearConfig(16, 16, 512, 4, 1, 64)
    assert fused_linear.default_config(200, 1536, 576, True) == fused_linear.FusedLinearConfig(32, 64, 64, 4, 3)
    assert fused_linear.default_config(32, 576, 576) == before[(576, 576, False)][32]      # the others kept
    cuda = SimpleNamespace(type="cuda")
    assert decode.choose_launch(cuda, 192, 1, 768) == (32, 2, 3)
    cpu = torch.device("cpu")
    assert decode.choose_launch(cpu, 192) == general(cpu, 192)


def test_profile_engine_critical_path_splits_decode_steps_into_increments():
    """``--chain``'s arithmetic on a made-up trace: steps cut after each ``argmax_reduce``, the
    prefill, a step of another kernel count and the unfinished tail dropped, the kernels after
    the attention named by position, each kernel's increment its end minus its predecessor's (not
    its own duration: the kernels start early), the increments summing to the step."""
    pe = _profile_engine()
    # A decode step: (name, increment, lead), a kernel starting `lead` before its predecessor ends.
    # (A kernel starts after its predecessor has: the profile's start order is the launch order.)
    layer = [("paged_decode", 10.0, 1.5), ("fl", 3.0, 8.0), ("fl", 5.0, 3.0), ("fl", 4.0, 5.0)]
    step = [("fl", 3.0, 0.5), *layer, ("fl", 3.5, 4.0), *layer, ("head", 20.0, 0.0), ("argmax_reduce", 1.0, 1.0)]
    mixed = [("gemm", 30.0, 0.0), ("argmax_reduce", 1.0, 0.0)]
    events, t = [], 0.0
    for kernels in [mixed, step, step, mixed, step, step, [("fl", 2.0, 0.0)]]:
        for name, inc, lead in kernels:
            events.append((name, t - lead, t + inc))
            t += inc
    events.reverse()                                # any order
    rows = pe.critical_path(events, "argmax_reduce", "paged_decode", ("o_proj", "gate_up"))
    assert [r[0] for r in rows] == ["fl", "paged_decode", "o_proj", "gate_up", "fl +3", "fl +4", "head",
                                    "argmax_reduce"]
    by = {r[0]: r[1:] for r in rows}
    assert by["fl"] == (1.0, 3.0, 3.0, 3.5, 0.5)
    assert by["paged_decode"] == (2.0, 10.0, 20.0, 11.5, 1.5)
    assert by["o_proj"] == (2.0, 3.0, 6.0, 11.0, 8.0)
    assert by["fl +4"] == (1.0, 3.5, 3.5, 7.5, 4.0)
    assert by["head"] == (1.0, 20.0, 20.0, 20.0, 0.0)         # after the last layer: its own name
    assert sum(r[3] for r in rows) == sum(inc for _, inc, _ in step)       # a step's span
    assert pe.critical_path([("argmax_reduce", 0.0, 1.0)], "argmax_reduce", "paged_decode") == []
    # A layer's kernels after the anchor, without names: 'name +i'.
    assert [r[0] for r in pe.critical_path(events, "argmax_reduce", "paged_decode")][2:4] == ["fl +1", "fl +2"]


def test_profile_engine_leaves_parts_out_for_timing(monkeypatch):
    """``--leave-out``: an unknown part changes nothing; the parts named skip their launches (a
    projection's launcher is never made, the head gives zeros, a decode plan writes nothing) and
    the others still compute."""
    from paged_attention.kernels import workloads
    from paged_attention.kernels.triton import decode
    from paged_attention.model import LlamaForCausalLM, random_weights
    from paged_attention.model.layer_ops import ResidualStream

    monkeypatch.setattr(decode.DecodePlan, "_launch", decode.DecodePlan._launch)    # restored after
    pe = _profile_engine()
    config = LlamaConfig.tiny()
    model = LlamaForCausalLM(config, random_weights(config, seed=3), attention="reference", fused=True)
    model.ops.small_batch = 8
    with pytest.raises(ValueError, match="attn"):
        pe.leave_out("qkv,attn", model)
    assert "_fused" not in vars(model.ops) and "greedy_tokens" not in vars(model)
    assert pe.leave_out("down, head,attention", model) == [
        f"left out of decode steps, for timing only: {n}" for n in ("down", "head", "attention")]
    g = torch.Generator().manual_seed(0)
    layer = model.layers[0]
    act = torch.randn(3, config.intermediate_size, generator=g)
    residual = torch.randn(3, config.hidden_size, generator=g)
    stream = model.ops.linear_add(act, layer["down_proj"], residual)
    assert stream.hidden.shape == (3, config.hidden_size) and stream.sum_sq.size(0) == 3
    qkv, _ = model.ops.norm_linear(ResidualStream(residual), layer["input_layernorm"], layer["qkv_proj"])
    widths = {launcher.fixed["K"] for launcher in model.ops._linear_launchers.values()}
    assert widths == {config.hidden_size}                  # QKV's launcher made; down's never
    want = model.__class__(config, random_weights(config, seed=3), attention="reference").ops.norm_linear(
        ResidualStream(residual), layer["input_layernorm"], layer["qkv_proj"])[0]
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.greedy_tokens(torch.randn(4, config.hidden_size)), torch.zeros(4, dtype=torch.long))
    p = workloads.make_decode_problem([5, 9], num_heads=4, num_kv_heads=2, head_size=16, block_size=8)
    out = torch.full_like(p.query, 7.0)
    decode.paged_attention_decode(out, *p.decode_args())
    assert (out == 7.0).all()


def test_profile_engine_graph_time_summarises_decode_steps_by_hand():
    """``--graph-time`` times decode graphs only (one token a request, greedy or not; not a step
    with prefills), and sums its rows up as medians, the graph's over the first and last fifth
    too, naming whichever of the host's own time and the graph is the longer."""
    pe = _profile_engine()
    assert pe.is_decode_graph((256, 256, 1, 256, "greedy")) and pe.is_decode_graph((64, 64, 1, 512))
    assert not pe.is_decode_graph((256, 16384, 128, 512, "greedy")) and not pe.is_decode_graph((4, 8, 1, 16))
    # Ten steps: the graph grows with the contexts; one slow host step (an outlier) moves no median.
    rows = [(1.5, 1.2, 1.45, 1.3 + 0.02 * i) for i in range(10)]
    rows[4] = (9.0, 8.0, 1.45, 1.38)
    line = pe.graph_summary(256, rows)
    assert "(10, medians in ms): wall 1.500, the host's own 1.200, GPU busy 1.450, the graph 1.390" in line
    assert "(first fifth 1.310, last fifth 1.470)" in line and line.endswith("the GPU's work is the longer")
    slow_host = [(1.6, 1.5, 1.5, 1.4)] * 3
    assert pe.graph_summary(8, slow_host).endswith("the host's work is the longer")
    assert "no decode step of 4 requests" in pe.graph_summary(4, [])
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(graphs=None)))
    assert "no CUDA graphs" in pe.graph_time_table(llm, 4, 16, 8)


def test_profile_engine_per_step_table_by_hand():
    """``--steps``: a line per step from ``first`` on, the host's own time (its total less the
    wait) and parts in ms, the GPU's busy time, and the idle gap before a step only where the step
    before it is the one numbered just before (a step without events has neither)."""
    pe = _profile_engine()

    def stat(i, events, wait=0.0):
        parts = dict(schedule=1e-4 * (i + 1), prepare=2e-4, forward=0.0, sample=0.0, wait=wait, update=3e-4)
        return SimpleNamespace(step=i, num_reqs=4, num_tokens=4, gpu_events=events, total=sum(parts.values()),
                               **parts)

    steps = [stat(0, None), stat(1, (_Event(0), _Event(2)), wait=5e-3), stat(2, (_Event(2.5), _Event(4))),
             stat(4, (_Event(9), _Event(10))), stat(5, None)]
    llm = SimpleNamespace(engine=SimpleNamespace(step_stats=[stat(99, None)] + steps))
    lines = pe.per_step_table(llm, 1).splitlines()
    assert len(lines) == 1 + len(steps) and "idle before" in lines[0]
    cells = [line.split() for line in lines[1:]]
    assert cells[0] == ["0", "4", "4", "0.600", "0.100", "0.200", "0.300"]          # no events
    assert cells[1][3] == "0.700" and cells[1][7:] == ["2.000"]                  # the wait left out; no step before with events
    assert cells[2][7:] == ["1.500", "0.500"]                                     # 2.5 - 2
    assert cells[3][7:] == ["1.000"]                                              # step 3 missing: no gap
    assert len(cells[4]) == 7
