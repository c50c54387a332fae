"""The engine benchmark's pieces: the script runs (a tiny CPU configuration), the memory
arithmetic, and its drawing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_attention.bench.engine import kv_capacity
from paged_attention.model import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_prints_and_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PAGED_ATTENTION_DEVICE": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert [r["requests"] for r in results["rows"]] == [1, 2]
    for row in results["rows"]:
        assert row["engine"]["tokens_per_s"] > 0 and row["hf_dynamic"]["tokens_per_s"] > 0
        assert row["engine"]["num_tokens"] == row["hf_dynamic"]["num_tokens"] == 4 * row["requests"]
    assert results["memory"]["paged"] > results["memory"]["contiguous"]
    assert "engine tok/s" in done.stdout


def test_kv_capacity_by_hand():
    config = LlamaConfig.tiny()   # K and V, 2 layers, 2 KV heads of 16 floats: 2*2*2*16*4 = 512 bytes a token
    cap = kv_capacity(config, 16, torch.float32, budget_bytes=1 << 20, prompt_len=20, output_len=10, max_model_len=512)
    assert cap["bytes_per_token"] == 512 and cap["num_blocks"] == 128      # 1 MiB / (512 * 16)
    assert cap["paged"] == 64                 # 30 tokens: 2 blocks of 16 each
    assert cap["contiguous"] == 4             # 1 MiB / (512 * 512 reserved tokens)


def test_throughput_drawing_has_a_line_per_system():
    from paged_attention.viz import draw_engine_throughput
    rows = [{"requests": n, "engine": {"tokens_per_s": 100.0 * n}, "hf_dynamic": {"tokens_per_s": 10.0 * n},
             "hf_static": {"tokens_per_s": 30.0 * n}} for n in (1, 16)]
    ax = draw_engine_throughput({"rows": rows, "device": "X", "prompt_len": 128, "max_tokens": 128})
    assert len(ax.get_lines()) == 3
    with pytest.raises(ValueError):
        draw_engine_throughput({"rows": []})
