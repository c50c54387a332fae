"""The whole-picture drawing of notebooks 00 and 08 and the tables it draws from."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from paged_attention.viz.overview import (  # noqa: E402
    BOUNDARY_COLOR, GENERATIONS, PIPELINE, WHERE_COLORS, Part, draw_pipeline, engine_row,
)


def test_every_generation_names_every_piece():
    for generation, parts in GENERATIONS.items():
        assert len(parts) == len(PIPELINE), generation
        assert all(part.where in WHERE_COLORS for part in parts)
    # Model runner v2 builds the table and the slot mapping on the GPU; v0 and v1 on the host.
    table, slots = 2, 3
    where = {g: (parts[table].where, parts[slots].where) for g, parts in GENERATIONS.items()}
    assert list(where.values()) == [("host", "host"), ("host", "host"), ("GPU", "GPU")]
    # The model and the sampler close the loop, on the GPU, shown by notebook 08.
    assert [p.name for p in PIPELINE[-2:]] == ["model", "sampler"]
    assert all(parts[-1].notebook == "08" and parts[-1].where == "GPU" for parts in GENERATIONS.values())


def test_the_engine_row_follows_the_device():
    (gpu,), (cpu,) = engine_row("cuda").values(), engine_row("cpu").values()
    assert len(gpu) == len(cpu) == len(PIPELINE)
    assert all(p.where == "host" for p in cpu)                 # a CPU machine: nothing is on a GPU
    assert [p.where for p in gpu][:2] == ["host", "host"] and all(p.where == "GPU" for p in gpu[2:])
    with pytest.raises(ValueError):
        engine_row("tpu")
    # The scheduler and the block manager are the core's: V1's by default, the legacy ones for V0.
    (v1,), (v0,) = engine_row("cpu").values(), engine_row("cpu", core="v0").values()
    assert "KVCacheManager" in v1[1].what and "SpaceManager" in v0[1].what and v1[2:] == v0[2:]
    with pytest.raises(ValueError):
        engine_row("cpu", core="v2")


def _boundaries(ax):
    return [line for line in ax.lines if line.get_color() == BOUNDARY_COLOR]


def test_the_drawing_shows_every_piece_and_part():
    ax = draw_pipeline()
    texts = {t.get_text() for t in ax.texts}
    assert {p.name for p in PIPELINE} <= texts
    assert {part.what for parts in GENERATIONS.values() for part in parts} <= texts
    assert set(GENERATIONS) <= texts
    assert "inside every layer of the model" in texts and any("notebook 08" in t for t in texts)
    # One boundary line per generation, plus the legend's.
    assert len(_boundaries(ax)) == len(GENERATIONS) + 1
    plt.close(ax.figure)
    # A row all on the host has no boundary; notes go under the last row.
    ax = draw_pipeline(engine_row("cpu"), notes={"slot mapping": "slots 144..153"})
    assert len(_boundaries(ax)) == 1 and "slots 144..153" in {t.get_text() for t in ax.texts}
    plt.close(ax.figure)


@pytest.mark.parametrize("rows", [None, engine_row("cuda"), engine_row("cpu"), engine_row("cuda", core="v0")])
def test_no_label_overflows_its_box(rows):
    """Every piece's and part's label lies inside its box, and the rows' names inside the figure."""
    ax = draw_pipeline(rows, notes={"block manager": "blocks [9]"})
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = {gid: [p.get_window_extent(renderer) for p in ax.patches if p.get_gid() == gid] for gid in ("piece", "part")}
    checked = 0
    for text in ax.texts:
        gid = text.get_gid()
        extent = text.get_window_extent(renderer)
        if gid in boxes:
            (cx, cy) = (extent.x0 + extent.x1) / 2, (extent.y0 + extent.y1) / 2
            box = next(b for b in boxes[gid] if b.contains(cx, cy))
            assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, text.get_text()
            assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, text.get_text()
            checked += 1
        figure = fig.bbox
        assert figure.x0 <= extent.x0 and extent.x1 <= figure.x1, text.get_text()
    assert checked >= 2 * len(PIPELINE)
    plt.close(fig)


def test_the_overflow_check_would_catch_a_long_label():
    """A label too long for its box is caught by the same measurement (the check can fail)."""
    long_row = {"too long": tuple(Part("a label much too long for one box", "host", "") for _ in PIPELINE)}
    ax = draw_pipeline(long_row)
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = next(p for p in ax.patches if p.get_gid() == "part").get_window_extent(renderer)
    label = next(t for t in ax.texts if t.get_text() == "a label much too long for one box")
    assert label.get_window_extent(renderer).width > box.width
    plt.close(fig)


def test_bad_rows_and_notes_are_refused():
    with pytest.raises(ValueError, match="one Part per piece"):
        draw_pipeline({"short": (Part("x", "host", ""),)})
    with pytest.raises(ValueError, match="where"):
        draw_pipeline({"bad": tuple(Part("x", "TPU", "") for _ in PIPELINE)})
    with pytest.raises(ValueError, match="unknown piece"):
        draw_pipeline(notes={"kv cache": "?"})
    with pytest.raises(ValueError):
        draw_pipeline({})
