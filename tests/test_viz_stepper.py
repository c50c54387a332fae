"""Steppers and their static twin."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from paged_attention.viz.stepper import draw_steps, stepper  # noqa: E402


def test_stepper_builds_one_control_per_keyword_and_redraws():
    pytest.importorskip("ipywidgets")
    calls = []
    w = stepper(lambda step, who: calls.append((step, who)), step=range(2, 9, 2), who=["a", "b"])
    slider, menu = w.children[:2]
    assert (slider.min, slider.max, slider.step, slider.value) == (2, 8, 2, 2)
    assert list(menu.options) == ["a", "b"]
    w.update()                                   # what a reader's change does
    slider.value = 6
    w.update()
    assert calls[-1] == (6, "a") and (2, "a") in calls


@pytest.mark.parametrize("controls, error", [({}, ValueError), ({"step": range(0)}, ValueError),
                                             ({"step": [1, 2]}, TypeError), ({"step": "abc"}, TypeError)])
def test_stepper_refuses_bad_controls(controls, error):
    pytest.importorskip("ipywidgets")
    with pytest.raises(error):
        stepper(lambda **kw: None, **controls)


def test_draw_steps_calls_every_step_once_and_hides_spare_panels():
    seen = []
    fig = draw_steps(lambda i, ax: seen.append((i, ax)), 5, ncols=3, titles=list("abcde"))
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({id(ax) for _, ax in seen}) == 5 and len(fig.axes) == 6
    assert not fig.axes[5].axison and fig.axes[4].get_title(loc="left") == "e"
    plt.close(fig)
    with pytest.raises(ValueError):
        draw_steps(lambda i, ax: None, 0)
    with pytest.raises(ValueError):
        draw_steps(lambda i, ax: None, 2, titles=["only one"])


def test_the_stepper_output_carries_its_static_twin():
    """A reader who has not run the cell (JupyterLab, untrusted) or reads the static book sees the
    picture at the controls' first values: the output's PNG, next to the widget itself."""
    pytest.importorskip("ipywidgets")
    import base64

    calls = []

    def draw(step, who):
        calls.append((step, who))
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.set_title(f"{who} {step}")

    w = stepper(draw, step=range(3, 9), who=["a", "b"])
    open_figures = plt.get_fignums()
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert calls[-1] == (3, "a")                                   # the first values
    assert "step=3, who='a'" in bundle["text/plain"] and "interactive(" not in bundle["text/plain"]
    assert plt.get_fignums() == open_figures                       # the twin's figure is closed


def test_static_twin_refuses_a_draw_that_makes_no_figure():
    from paged_attention.viz.stepper import static_twin
    with pytest.raises(ValueError, match="no figure"):
        static_twin(lambda: None, {})
