"""Steppers: a slider (or a menu) that redraws a picture for each value, in JupyterLab.

A notebook shows a static picture first (what nbval checks), then a stepper over the same drawing
for a reader who wants to move through it. ``stepper`` builds the controls from plain values: a
``range`` becomes a slider, a list of strings a menu. Without ``ipywidgets`` it says so and
returns None: nothing else depends on it.

A widget only shows where a kernel runs it. So the stepper's output also carries its *static
twin*, the picture at the controls' first values, as a PNG in the same output: JupyterLab shows
that picture for a notebook nobody has run yet (an untrusted output may not render a widget, and
PNG is the richest safe type), the static book shows it (it loads no widget script), and a live
kernel shows the widget.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["stepper", "draw_steps", "static_twin"]


def _control(name: str, values: Any) -> Any:
    import ipywidgets as widgets

    if isinstance(values, range):
        if len(values) == 0:
            raise ValueError(f"{name}: the range is empty")
        return widgets.IntSlider(value=values.start, min=values.start, max=values[-1], step=values.step,
                                 description=name, continuous_update=False)
    if isinstance(values, (list, tuple)) and values and all(isinstance(v, str) for v in values):
        return widgets.Dropdown(options=list(values), value=values[0], description=name)
    raise TypeError(f"{name}: give a range (a slider) or a non-empty list of str (a menu), got {values!r}")


def stepper(draw: Callable[..., Any], **controls: Any) -> Optional[Any]:
    """Controls for ``draw(**values)``, which draws one figure; each change redraws it. Returns the
    ``ipywidgets.interactive`` (show it as a cell's last value), or None where ipywidgets is not
    installed."""
    if not callable(draw):
        raise TypeError(f"draw must be callable, got {type(draw).__name__}")
    if not controls:
        raise ValueError("give at least one control, e.g. step=range(10)")
    try:
        import ipywidgets as widgets
    except ImportError:
        print("ipywidgets is not installed: the static picture above shows the same drawing")
        return None
    built = {name: _control(name, values) for name, values in controls.items()}

    def show(**values: Any) -> None:
        import matplotlib.pyplot as plt

        draw(**values)
        plt.show()

    class Stepper(widgets.interactive):
        """The controls and their output; displayed, the widget plus its static twin (a PNG)."""

        def _repr_mimebundle_(self, **kwargs: Any) -> dict:
            bundle = dict(super()._repr_mimebundle_(**kwargs) or {})
            first = {name: control.value for name, control in built.items()}
            bundle["image/png"] = static_twin(draw, first)
            bundle["text/plain"] = (f"A stepper over {', '.join(built)}; the picture shows "
                                    + ", ".join(f"{k}={v!r}" for k, v in first.items())
                                    + ". Run the cell in JupyterLab to move it.")
            return bundle

    return Stepper(show, **built)


def static_twin(draw: Callable[..., Any], values: dict[str, Any]) -> str:
    """``draw(**values)`` as a PNG, base64-encoded as a notebook stores it; the figure is closed,
    so nothing else shows it."""
    import base64
    import io

    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    draw(**values)
    new = [n for n in plt.get_fignums() if n not in before]
    if not new:
        raise ValueError("draw made no figure: it must draw on a new matplotlib figure")
    fig = plt.figure(new[-1])
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", bbox_inches="tight", dpi=fig.dpi)
    finally:
        for number in new:
            plt.close(number)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def draw_steps(draw_step: Callable[[int, Any], Any], num_steps: int, ncols: int = 3,
               panel_size: tuple[float, float] = (4.2, 2.6), titles: Sequence[str] | None = None) -> Any:
    """Small multiples: ``draw_step(i, ax)`` for every step, ``ncols`` panels a row. The static
    twin of a stepper. Returns the figure."""
    import matplotlib.pyplot as plt

    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if titles is not None and len(titles) != num_steps:
        raise ValueError(f"titles has {len(titles)} entries for {num_steps} steps")
    ncols = max(1, min(ncols, num_steps))
    nrows = -(-num_steps // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size[0] * ncols, panel_size[1] * nrows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < num_steps:
            draw_step(i, ax)
            if titles is not None:
                ax.set_title(titles[i], fontsize=9, loc="left")
        else:
            ax.set_axis_off()
    fig.tight_layout()
    return fig
