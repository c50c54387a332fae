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
    "forward": ("launch the model", "#F58518"),
    "sample": ("launch the sampler", "#E45756"),
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
    the run recorded the GPU's events. Returns the two Axes."""
    rows = ablation.get("rows") if isinstance(ablation, Mapping) else None
    if not rows or not all(isinstance(r, Mapping) and "name" in r and "tokens_per_s" in r for r in rows):
        raise ValueError("ablation must be bench_engine's results['ablation']: a dict with a non-empty 'rows' "
                         "list of configurations (name, tokens_per_s, <part>_ms)")
    if axes is None:
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 + 0.9 * len(rows)), gridspec_kw={"width_ratios": [1, 2]})
    left, right = axes
    names = [r["name"] for r in rows][::-1]
    speeds = [r["tokens_per_s"] for r in rows][::-1]
    bars = left.barh(range(len(rows)), speeds, color="#4C78A8")
    for bar, v in zip(bars, speeds):
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:,.0f}", va="center", fontsize=8)
    left.set_yticks(range(len(rows)), names)
    left.set_xlabel("output tokens / s")
    left.set_xlim(0, 1.25 * max(speeds))

    ticks, labels, seen = [], [], set()
    for i, r in enumerate(rows[::-1]):
        y = 3 * i
        for row_y, parts, key_of in ((y + 1, HOST_PARTS, "{}_ms"), (y, GPU_PARTS, "{}_ms")):
            x = 0.0
            for part, (label, color) in parts.items():
                width = r.get(key_of.format(part))
                if width is None or width != width:
                    continue
                hatch = "//" if color == "white" else None
                right.barh(row_y, width, left=x, color=color, edgecolor=MUTED_COLOR, hatch=hatch,
                           label=None if label in seen else label)
                seen.add(label)
                x += width
        ticks += [y + 1, y]
        labels += [f"{r['name']}: host", "GPU" if r.get("gpu_busy_ms") is not None else "GPU (no events)"]
    right.set_yticks(ticks, labels, fontsize=8)
    right.set_xlabel("milliseconds per decode step")
    right.legend(fontsize=7, loc="lower right", ncol=2)
    right.set_title(f"{ablation.get('requests', '?')} requests of {ablation.get('prompt_len', '?')} + "
                    f"{ablation.get('max_tokens', '?')} tokens", fontsize=9)
    return left, right


__all__ = ["draw_engine_ablation", "HOST_PARTS", "GPU_PARTS"]
