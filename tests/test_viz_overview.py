"""The whole-picture drawing of notebook 00 and the table it draws from."""
import matplotlib

matplotlib.use("Agg")

from paged_attention.viz.overview import GENERATIONS, PIPELINE, WHERE_COLORS, draw_pipeline  # noqa: E402


def test_every_generation_names_every_piece():
    for generation, parts in GENERATIONS.items():
        assert len(parts) == len(PIPELINE), generation
        assert all(part.where in WHERE_COLORS for part in parts)
    # Model runner v2 builds the table and the slot mapping on the GPU; v0 and v1 on the host.
    table, slots = 2, 3
    where = {g: (parts[table].where, parts[slots].where) for g, parts in GENERATIONS.items()}
    assert list(where.values()) == [("host", "host"), ("host", "host"), ("GPU", "GPU")]


def test_the_drawing_shows_every_piece_and_part():
    ax = draw_pipeline()
    texts = {t.get_text() for t in ax.texts}
    assert {p.name for p in PIPELINE} <= texts
    assert {part.what for parts in GENERATIONS.values() for part in parts} <= texts
    assert set(GENERATIONS) <= texts
    # One boundary line per generation, plus the legend's.
    assert len(ax.lines) == len(GENERATIONS) + 1
