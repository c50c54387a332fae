"""The engine's ablation drawn: tokens/s of each configuration, and where a decode step's time goes
on the host and on the GPU (``benchmarks/bench_engine.py``'s ``ablation`` results)."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from paged_attention.viz.style import MUTED_COLOR

# A step's host parts (bench.engine.HOST_PARTS) and the GPU's: (label, colour); "wait" and "idle"
# are time spent doing nothing, drawn hatched.
HOST_PARTS: dict[str, tuple[str, str]] = {
    "schedule": ("schedule", "#4C78A8"),
    "prepare": ("prepare inputs", "#72B7B2"),
    "forward": ("the model (launched; on a CPU, computed)", "#F58518"),
    "sample": ("the sampler", "#E45756"),
    "update": ("update (stops, outputs)", "#B279A2"),
    "wait": ("host waits for the GPU", "white"),
}
GPU_PARTS: dict[str, tuple[str, str]] = {
    "gpu_busy": ("GPU busy", "#54A24B"),
    "gpu_idle": ("GPU idle", "white"),
}


def draw_engine_ablation(ablation: Mapping[str, Any], axes: Optional[tuple[Any, Any]] = None) -> tuple[Any, Any]:
    """Two panels for ``results["ablation"]``: output tokens/s per configuration (left), and the
    milliseconds of a decode step (right), each configuration a host bar (its parts in the order
    a step runs them) above a GPU bar (busy, then idle until the next step's work arrives), when
    the run recorded the GPU's events. The host and the GPU work at once (with async scheduling
    the host prepares the next step while the GPU runs this one): the bars are each one's time
    per step, not one timeline. Returns the two Axes."""
    rows = ablation.get("rows") if isinstance(ablation, Mapping) else None
    if not rows or not all(isinstance(r, Mapping) and "name" in r and "tokens_per_s" in r for r in rows):
        raise ValueError("ablation must be bench_engine's results['ablation']: a dict with a non-empty 'rows' "
                         "list of configurations (name, tokens_per_s, <part>_ms)")
    if axes is None:
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 0.9 * len(rows)), gridspec_kw={"width_ratios": [1, 2]},
                                 layout="constrained")
    left, right = axes
    names = [r["name"] for r in rows][::-1]
    speeds = [r["tokens_per_s"] for r in rows][::-1]
    bars = left.barh(range(len(rows)), speeds, color="#4C78A8")
    for bar, v in zip(bars, speeds):
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:,.0f}", va="center", fontsize=8)
    left.set_yticks(range(len(rows)), names)
    left.set_xlabel("output tokens / s")
    left.set_xlim(0, 1.25 * max(speeds))

    # Right: per configuration a host bar, and a GPU bar where the run recorded events.
    with_gpu = any(r.get("gpu_busy_ms") is not None for r in rows)
    pitch = 3 if with_gpu else 2
    ticks, labels, seen = [], [], set()
    for i, r in enumerate(rows[::-1]):
        y = pitch * i
        bars = [(y + 1, HOST_PARTS, "host")] + ([(y, GPU_PARTS, "GPU")] if with_gpu else [])
        for row_y, parts, label_of_row in bars:
            x = 0.0
            for part, (label, color) in parts.items():
                width = r.get(f"{part}_ms")
                if width is None or width != width:
                    continue
                right.barh(row_y, width, left=x, color=color, edgecolor=MUTED_COLOR,
                           hatch="//" if color == "white" else None, label=None if label in seen else label)
                seen.add(label)
                x += width
            ticks.append(row_y)
            labels.append(label_of_row)
        right.text(0, y + 1.55, r["name"], fontsize=8, va="center")
    right.set_yticks(ticks, labels, fontsize=8)
    right.set_ylim(-0.7, pitch * (len(rows) - 1) + 2.1)
    right.set_xlabel("milliseconds per decode step")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, frameon=False)
    right.set_title(f"{ablation.get('requests', '?')} requests of {ablation.get('prompt_len', '?')} + "
                    f"{ablation.get('max_tokens', '?')} tokens", fontsize=9)
    return left, right


__all__ = ["draw_engine_ablation", "HOST_PARTS", "GPU_PARTS"]
