"""The V1 core's drawings (``viz.v1_core``): what they read and what they refuse."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from paged_attention.v1.core.block_pool import BlockPool  # noqa: E402
from paged_attention.viz.v1_core import (  # noqa: E402
    draw_free_queues,
    draw_group_tables,
    draw_token_budget,
    pool_row,
)


def test_pool_row_reads_queue_order_cache_state_and_holders():
    pool = BlockPool(6, enable_caching=True, hash_block_size=4)
    a = pool.get_new_blocks(2)
    a[0].set_block_hash(b"h\x00\x00\x00\x00", 4)
    pool.free_blocks([a[1], a[0]])
    b = pool.get_new_blocks(1)
    row = pool_row(pool, {"B": [[0, b[0].block_id]], "C": [[b[0].block_id]]})
    # a[1] went to the front (never cached) and was taken again; a[0] (cached) is at the back.
    assert row.free == ((3, False), (4, False), (5, False), (1, True))
    assert row.used == ((2, ("B", "C")),)               # the null block 0 is nobody's


def test_drawings_draw_one_box_per_block_and_refuse_mismatches():
    pool = BlockPool(4, enable_caching=True, hash_block_size=4)
    rows = [pool_row(pool, {})]
    ax = draw_free_queues(rows, ["start"], ["A"])
    assert len([p for p in ax.patches]) == 3
    plt.close("all")
    ax = draw_group_tables({"P": ([1, 2], [0, 3])}, ["full", "window"])
    assert len(ax.patches) == 4
    plt.close("all")
    ax = draw_token_budget([{"r0": 8}, {"r0": 2, "r1": 6}], 8, [[], ["r1"]], ["r0", "r1"])
    assert len(ax.patches) == 3
    plt.close("all")
    with pytest.raises(ValueError):
        draw_free_queues(rows, [], ["A"])
    with pytest.raises(ValueError):
        draw_group_tables({"P": ([1],)}, ["full", "window"])
    with pytest.raises(ValueError):
        draw_token_budget([{"r0": 1}], 8, [], ["r0"])
