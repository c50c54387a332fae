"""The engine's benchmark drawn: output tokens/s against the number of requests."""
from __future__ import annotations

from typing import Any, Mapping

from paged_attention.viz.style import new_axes

# name in the benchmark's JSON -> (label, colour)
ENGINE_SYSTEMS: dict[str, tuple[str, str]] = {
    "engine": ("this engine (paged, CUDA graphs)", "#4C78A8"),
    "hf_dynamic": ("transformers, dynamic cache", "#E45756"),
    "hf_static": ("transformers, static cache", "#F58518"),
}


def draw_engine_throughput(results: Mapping[str, Any], ax: Any = None) -> Any:
    """One line per system of ``benchmarks/bench_engine.py --json``'s results: output tokens/s
    (log scale) for each number of requests."""
    rows = results.get("rows") if isinstance(results, Mapping) else None
    if not rows:
        raise ValueError("results must be bench_engine's JSON: a dict with a non-empty 'rows' list")
    ax = new_axes(ax, (6.5, 4))
    for key, (label, color) in ENGINE_SYSTEMS.items():
        points = [(row["requests"], row[key]["tokens_per_s"]) for row in rows if key in row]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{results.get('device', '')}, {results.get('prompt_len')}-token prompts, "
                 f"{results.get('max_tokens')} new tokens", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax
