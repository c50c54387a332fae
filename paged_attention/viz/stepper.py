"""Steppers: a slider (or a menu) that redraws a picture for each value, in JupyterLab.

A notebook shows a static picture first (what nbval checks, what a static page and a reader
without widgets see), then a stepper over the same drawing for a reader who wants to move through
it. ``stepper`` builds the controls from plain values: a ``range`` becomes a slider, a list of
strings a menu. Without ``ipywidgets`` it says so and returns None: nothing else depends on it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

__all__ = ["stepper", "draw_steps"]


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

    return widgets.interactive(show, **built)


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
