"""The CUDA kernels' layout arithmetic (paged_attention.kernels.layout), and the drawings that show it."""
import math

import matplotlib

matplotlib.use("Agg")  # before pyplot: no window, same pixels everywhere

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from paged_attention.kernels import reference as ref  # noqa: E402
from paged_attention.kernels.layout import (  # noqa: E402
    v0_key_offset, v0_value_offset, v1_thread_mapping, v2_merge_weights, v2_partitions,
)
from paged_attention.viz import (  # noqa: E402
    IMPL_COLORS, draw_decode_times, draw_thread_mapping, draw_v0_key_layout, draw_v2_partitions, seq_color,
)


def texts(ax: Axes, gid: str | None = None) -> list[str]:
    return [t.get_text() for t in ax.texts if gid is None or t.get_gid() == gid]


def patches(ax: Axes, gid: str) -> list:
    return [p for p in ax.patches if p.get_gid() == gid]


def colors(items) -> list[str]:
    """Face colours as lower-case '#rrggbb', alpha dropped."""
    return [to_hex(p.get_facecolor(), keep_alpha=False) for p in items]


# --- the arithmetic --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offsets_match_the_v0_cache_written_by_the_reference(dtype):
    """Element d of token t lands where v0_key_offset / v0_value_offset say, in a real cache."""
    num_blocks, heads, head_size, block_size = 3, 2, 32, 8
    x = ref.v0_x(dtype)
    key = torch.arange(block_size * heads * head_size, dtype=dtype).reshape(block_size, heads, head_size)
    value = -key
    key_cache = torch.zeros(num_blocks, heads, head_size // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, heads, head_size, block_size, dtype=dtype)
    slots = torch.arange(block_size) + block_size  # the whole of block 1, token t at offset t
    one = torch.ones(1)
    ref.reshape_and_cache(key, value, key_cache, value_cache, slots, "auto", one, one)
    flat_k, flat_v = key_cache[1, 1].flatten(), value_cache[1, 1].flatten()
    for t in range(block_size):
        for d in range(head_size):
            assert flat_k[v0_key_offset(d, t, block_size, x)] == key[t, 1, d]
            assert flat_v[v0_value_offset(d, t, block_size)] == value[t, 1, d]


def test_v1_thread_mapping_numbers():
    m = v1_thread_mapping(16, 128, 2)          # bf16, head 128, block 16
    assert (m.x, m.thread_group_size, m.vec_size, m.groups_per_warp, m.vecs_per_lane) == (8, 2, 4, 16, 16)
    assert m.num_threads == 128
    assert [(b, v1_thread_mapping(b, 64, 4).thread_group_size, v1_thread_mapping(b, 64, 4).vec_size)
            for b in (8, 16, 32)] == [(8, 4, 1), (16, 2, 2), (32, 1, 4)]
    assert v1_thread_mapping(8, 128, 1).vec_size == 4  # fp8: x = 16


@pytest.mark.parametrize("block_size,dtype_bytes", [(8, 2), (16, 2), (32, 2), (16, 4), (8, 1)])
def test_a_warp_wide_load_is_one_contiguous_span(block_size, dtype_bytes):
    """For every chunk, the warp's 32 lanes read exactly block_size * x consecutive elements."""
    m = v1_thread_mapping(block_size, 128, dtype_bytes)
    for chunk in range(128 // m.x):
        offsets = []
        for lane in range(32):
            token, dims = m.lane_elements(lane, chunk)
            offsets += [v0_key_offset(d, token, block_size, m.x) for d in dims]
        assert sorted(offsets) == list(range(chunk * block_size * m.x, (chunk + 1) * block_size * m.x))


def test_v2_partitions_and_merge_weights():
    assert v2_partitions(1400) == [range(0, 512), range(512, 1024), range(1024, 1400)]
    assert v2_partitions(512) == [range(0, 512)]
    assert v2_partitions(1) == [range(0, 1)]
    assert [len(r) for r in v2_partitions(1025, 256)] == [256, 256, 256, 256, 1]
    w = v2_merge_weights([3.0, 5.0], [20.0, 8.0])
    assert w[1] == 8.0 and math.isclose(w[0], 20 * math.exp(-2))
    with pytest.raises(ValueError, match="same length"):
        v2_merge_weights([1.0], [1.0, 2.0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=12), "block_size"), (dict(block_size=16.0), "block_size"),
    (dict(dtype_bytes=3), "dtype_bytes"), (dict(dtype_bytes=True), "dtype_bytes"),
    (dict(head_size=100, dtype_bytes=2), "multiple of x = 8"), (dict(num_warps=0), "num_warps"),
])
def test_v1_thread_mapping_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        v1_thread_mapping(**kwargs)


def test_v2_partitions_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        v2_partitions(0)
    with pytest.raises(ValueError, match="partition_size"):
        v2_partitions(10, -512)


# --- draw_v0_key_layout ----------------------------------------------------------------------------

def test_key_strip_labels_follow_the_memory_order():
    head_size, block_size, x = 16, 4, 4
    ax = draw_v0_key_layout(head_size, block_size, x)
    assert isinstance(ax, Axes)
    # Memory order [D/x, B, x]: chunk, then token, then place in the chunk.
    expected = [str(c * x + j) for c in range(head_size // x) for _t in range(block_size) for j in range(x)]
    assert texts(ax, "key") == expected
    assert texts(ax, "key")[:8] == ["0", "1", "2", "3", "0", "1", "2", "3"]
    # Each key cell is coloured by its token: runs of x cells, token after token.
    assert colors(patches(ax, "key")) == [seq_color(t).lower() for _c in range(head_size // x)
                                          for t in range(block_size) for _j in range(x)]
    # Value strip: [D, B], so each dim repeats block_size times in a row.
    assert texts(ax, "value") == [str(d) for d in range(head_size) for _t in range(block_size)]
    assert len(patches(ax, "logical")) == len(patches(ax, "key")) == len(patches(ax, "value")) == 64
    labels = texts(ax)
    assert {"chunk 0: dims 0–3 of tokens 0–3", "chunk 3: dims 12–15 of tokens 0–3"} <= set(labels)
    assert {"+0", "+16", "+32", "+48"} <= set(labels)


def test_key_layout_with_the_fp16_chunk_and_a_given_axes():
    _, given = plt.subplots()
    ax = draw_v0_key_layout(head_size=16, block_size=4, x=8, ax=given)
    assert ax is given
    assert texts(ax, "key")[:9] == ["0", "1", "2", "3", "4", "5", "6", "7", "0"]
    assert "chunk 1: dims 8–15 of tokens 0–3" in texts(ax)


def test_key_layout_is_deterministic():
    a, b = draw_v0_key_layout(), draw_v0_key_layout()
    assert texts(a) == texts(b)
    assert [p.get_xy() for p in a.patches] == [p.get_xy() for p in b.patches]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(head_size=18, x=4), ValueError, "multiple of x"), (dict(block_size=0), ValueError, "block_size"),
    (dict(x=2.5), TypeError, "x must be an int"), (dict(head_size=128, block_size=16), ValueError, "too many"),
])
def test_key_layout_rejects_bad_arguments(kwargs, error, match):
    # A wrong type is a TypeError here too (utils.check_int), a wrong value a ValueError.
    with pytest.raises(error, match=match):
        draw_v0_key_layout(**kwargs)


# --- draw_thread_mapping ---------------------------------------------------------------------------

def test_thread_mapping_draws_warps_groups_and_slices():
    ax = draw_thread_mapping(block_size=16, head_size=128, dtype_bytes=2, num_warps=4)
    blocks = patches(ax, "kv_block")
    assert len(blocks) == 9
    # Warp w takes blocks w, w + 4, ...: the colours and labels say so.
    assert colors(blocks) == [seq_color(j % 4).lower() for j in range(9)]
    assert texts(ax, "kv_block")[5] == "block 5\nwarp 1"
    assert len(patches(ax, "lane")) == 32
    assert len(patches(ax, "thread_group")) == 16 and texts(ax, "thread_group")[-1] == "t15"
    assert len(patches(ax, "slice")) == 16 * 2  # 16 chunks, 2 lanes' slices each
    numbers = texts(ax, "numbers")
    assert "THREAD_GROUP_SIZE = max(32 // 16, 1) = 2" in numbers
    assert "VEC_SIZE = x // THREAD_GROUP_SIZE = 4" in numbers
    assert "  = 256 contiguous bytes" in numbers


def test_thread_mapping_for_fp32_and_block_32():
    ax = draw_thread_mapping(block_size=32, head_size=64, dtype_bytes=4, num_warps=2)
    assert len(patches(ax, "kv_block")) == 5
    assert len(patches(ax, "thread_group")) == 32
    assert len(patches(ax, "slice")) == 16  # 64 / x=4 chunks, one lane each
    assert "  none to add (one lane per token)" in texts(ax, "numbers")


def test_thread_mapping_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        draw_thread_mapping(block_size=64)
    with pytest.raises(ValueError, match="multiple of x"):
        draw_thread_mapping(head_size=60, dtype_bytes=2)


# --- draw_v2_partitions ----------------------------------------------------------------------------

def test_v2_partitions_drawing():
    ax = draw_v2_partitions(seq_len=1400, partition_size=512, block_size=16)
    filled = patches(ax, "partition")
    assert len(filled) == 3
    widths = [p.get_width() for p in filled]
    assert widths[0] == widths[1] and math.isclose(widths[2], widths[0] * 376 / 512)
    assert texts(ax, "partition_label") == [
        "partition 0\ntokens 0–511 (32 blocks)", "partition 1\ntokens 512–1023 (32 blocks)",
        "partition 2\ntokens 1024–1399 (24 blocks)"]
    assert any("w_p = s_p · exp(m_p − M)" in t and "1e-6" in t for t in texts(ax))
    # 2 KV-block boundaries inside each full partition's 32 blocks, 23 in the last one's 24.
    assert len(ax.lines) == 31 + 31 + 23


def test_v2_one_partition_is_a_copy():
    ax = draw_v2_partitions(seq_len=100)
    assert len(patches(ax, "partition")) == 1
    assert "one partition: the reduce kernel copies o_0 to out" in texts(ax)


def test_v2_partitions_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of block_size"):
        draw_v2_partitions(partition_size=500, block_size=16)
    with pytest.raises(ValueError, match="seq_len"):
        draw_v2_partitions(seq_len=0)
    with pytest.raises(ValueError, match="too many"):
        draw_v2_partitions(seq_len=100_000)


# --- draw_decode_times -----------------------------------------------------------------------------

CONTEXTS = [512, 2048, 8192]
TIMES = {"CUDA v1": [10.0, 30.0, None], "CUDA v2": [12.0, 20.0, 50.0], "Triton": [9.0, 14.0, 30.0],
         "SDPA (contiguous)": [20.0, 25.0, 40.0], "mine": [5.0, 6.0, 7.0]}


def test_decode_times_draws_one_line_per_implementation():
    ax = draw_decode_times(CONTEXTS, TIMES, title="H200")
    assert [line.get_label() for line in ax.lines] == list(TIMES)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(TIMES)
    assert ax.get_xscale() == "log" and ax.get_title() == "H200"
    assert to_hex(ax.lines[2].get_color()) == IMPL_COLORS["Triton"].lower()
    assert math.isnan(ax.lines[0].get_ydata()[2])  # a missing time is a gap
    assert list(ax.lines[1].get_xdata()) == CONTEXTS and ax.lines[1].get_marker() == "o"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "2048", "8192"]


@pytest.mark.parametrize("contexts,times,match", [
    ([], TIMES, "contexts"), ([0, 2], {"a": [1, 2]}, "contexts"), (CONTEXTS, {}, "times_us"),
    (CONTEXTS, {"a": [1.0, 2.0]}, "2 times for 3 contexts"), (CONTEXTS, {"a": [1.0, -2.0, 3.0]}, "positive"),
])
def test_decode_times_rejects_bad_arguments(contexts, times, match):
    with pytest.raises(ValueError, match=match):
        draw_decode_times(contexts, times)


def test_draw_decode_bandwidth_turns_times_into_read_rates_under_the_copy_ceiling():
    from paged_attention.viz import draw_decode_bandwidth

    contexts, kv = [512, 1024], [10**9, 2 * 10**9]                 # bytes read per step
    times = {"CUDA v1": [1000.0, 2500.0], "Triton": [500.0, 1000.0]}   # µs
    ax = draw_decode_bandwidth(contexts, times, kv, 3e12)
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["Triton"].get_ydata()) == pytest.approx([2.0, 2.0])       # 1e9 B / 500 µs = 2 TB/s
    assert list(lines["CUDA v1"].get_ydata()) == pytest.approx([1.0, 0.8])
    ceiling = [line for name, line in lines.items() if name.startswith("device copy")]
    assert len(ceiling) == 1 and list(ceiling[0].get_ydata()) == pytest.approx([3.0, 3.0])
    assert lines["Triton"].get_zorder() > lines["CUDA v1"].get_zorder()          # drawn on top
    for bad in (dict(kv_bytes=[1]), dict(copy_bytes_per_s=0)):
        args = dict(kv_bytes=kv, copy_bytes_per_s=3e12) | bad
        with pytest.raises(ValueError):
            draw_decode_bandwidth(contexts, times, **args)


# --- v1_launch: what shared memory lets v1 launch ---------------------------------------------------
H100 = dict(shared_per_block=227 * 1024, shared_per_sm=228 * 1024, num_sms=132)


def test_v1_launch_falls_back_to_one_head_when_four_heads_scores_do_not_fit():
    from paged_attention.kernels.layout import v1_launch
    # 32 query heads over 8 KV heads: four heads a block while 4 x context floats fit in 227 KiB.
    short = v1_launch(8, 32, 8, 128, 8192, 16, **H100)
    assert (short.heads_per_block, short.num_blocks, short.blocks_per_sm, short.waves) == (4, 64, 1, 1)
    assert short.shared_bytes == 4 * (4 * 8192 + 4 * 128 + 4 * 4)
    long = v1_launch(8, 32, 8, 128, 16384, 16, **H100)
    assert (long.heads_per_block, long.num_blocks, long.blocks_per_sm, long.waves) == (1, 256, 3, 1)
    # Twice the context: one block of 128 KiB scores per multiprocessor, so 256 blocks take 2 waves.
    longer = v1_launch(8, 32, 8, 128, 32768, 16, **H100)
    assert (longer.blocks_per_sm, longer.waves) == (1, 2)
    # Scores are kept for whole blocks; a group of 3 query heads per KV head is never batched by 4.
    assert v1_launch(1, 4, 4, 64, 17, 16, **H100).shared_bytes == 4 * (32 + 64 + 4)
    assert v1_launch(1, 12, 4, 64, 100, 16, **H100).heads_per_block == 1
    # Short contexts: the threads' limit (16 blocks of 128 threads), not shared memory.
    assert v1_launch(1, 32, 8, 128, 16, 16, **H100).blocks_per_sm == 16


def test_v1_launch_refuses_what_v1_cannot_run():
    from paged_attention.kernels.layout import v1_launch
    with pytest.raises(ValueError, match="shared memory"):
        v1_launch(1, 8, 8, 128, 65536, 16, **H100)        # 256 KiB of scores for one head
    with pytest.raises(ValueError, match="multiple"):
        v1_launch(1, 6, 4, 128, 64, 16, **H100)
    with pytest.raises(ValueError):
        v1_launch(0, 8, 8, 128, 64, 16, **H100)
