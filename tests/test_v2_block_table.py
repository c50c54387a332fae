"""v2 ``BlockTables``, method by method, for both kernel sets (``impl="vllm"`` and ``"triton"``).

Two KV-cache groups with block sizes 16 and 32 (as in a model mixing full attention and sliding
window layers) and small shapes, so that Triton's interpreter keeps up on a CPU. Every test reads
results back with ``.cpu()`` (on a GPU, that synchronises).
"""
import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.utils import PAD_SLOT_ID, cdiv
from paged_attention.v2 import BlockTables, FastBlockTables, StagedWriteTensor, UvaBackedTensor, make_block_tables
from paged_attention.v2 import block_table as v2bt
from paged_attention.v2 import block_table_fast as fast_bt

from test_v2_buffers import CountingKernel

DEV = runtime.DEVICE
IMPLS = ["vllm", "triton"]
BLOCK_SIZES = [16, 32]
MAX_REQS, MAX_TOKENS, MAX_LEN = 4, 16, 200      # widths: cdiv(200, 16) = 13, cdiv(200, 32) = 7


def make(impl="triton", block_sizes=BLOCK_SIZES, max_num_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_len=MAX_LEN):
    return make_block_tables(block_sizes, max_num_reqs, max_tokens, max_len, DEV, impl=impl)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def i64(values):
    return torch.tensor(values, dtype=torch.int64, device=DEV)


def host(t):
    return t.cpu().numpy()


def tables(bt):
    """The persistent device tables, on the host."""
    return [host(t.gpu) for t in bt.block_tables]


def snapshot(bt):
    """Everything a failed call must leave as it was."""
    return ([host(t.gpu).copy() for t in bt.block_tables], bt.num_blocks.np.copy(), host(bt.num_blocks.gpu).copy(),
            [host(t).copy() for t in bt.input_block_tables], host(bt.slot_mappings).copy(),
            [t.num_staged_writes for t in bt.block_tables])


def assert_same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, list):
            assert all(np.array_equal(p, q) if isinstance(p, np.ndarray) else p == q for p, q in zip(x, y))
        else:
            assert np.array_equal(x, y)


# ---- Construction -----------------------------------------------------------------------------

def test_construction_shapes_and_layout_tensors():
    bt = make()
    assert bt.num_kv_cache_groups == 2 and bt.max_num_blocks_per_group == [13, 7]
    for t, width in zip(bt.block_tables, [13, 7]):
        assert isinstance(t, StagedWriteTensor)
        assert tuple(t.gpu.shape) == (MAX_REQS, width) and t.gpu.dtype == torch.int32
        assert t.gpu.device.type == DEV.type and not host(t.gpu).any()
    assert isinstance(bt.num_blocks, UvaBackedTensor) and bt.num_blocks.np.shape == (2, MAX_REQS)
    assert bt.num_blocks.np.dtype == np.int32
    assert [tuple(t.shape) for t in bt.input_block_tables] == [(MAX_REQS, 13), (MAX_REQS, 7)]
    assert tuple(bt.slot_mappings.shape) == (2, MAX_TOKENS) and bt.slot_mappings.dtype == torch.int64
    assert bt.block_table_ptrs.dtype == torch.uint64
    assert host(bt.block_table_ptrs).tolist() == [t.gpu.data_ptr() for t in bt.block_tables]
    assert host(bt.input_block_table_ptrs).tolist() == [t.data_ptr() for t in bt.input_block_tables]
    assert host(bt.block_table_strides).tolist() == [13, 7]
    assert host(bt.block_sizes_tensor).tolist() == [16, 32]
    assert bt.impl == "triton" and type(bt) is FastBlockTables and isinstance(bt, BlockTables)
    assert type(make("vllm")) is BlockTables and make("vllm").impl == "vllm"
    # The two classes are the two kernel sets: no constructor turns one into the other.
    assert type(BlockTables(BLOCK_SIZES, MAX_REQS, MAX_TOKENS, MAX_LEN, DEV)) is BlockTables


@pytest.mark.parametrize("kwargs,error", [
    (dict(block_sizes=[]), ValueError),
    (dict(block_sizes=[16, 0]), ValueError),
    (dict(block_sizes=16), TypeError),
    (dict(block_sizes=[16.0]), TypeError),
    (dict(max_num_reqs=0), ValueError),
    (dict(max_tokens=True), TypeError),
    (dict(max_len=-1), ValueError),
    (dict(impl="fast"), ValueError),            # the old name of the Triton set: one vocabulary
    (dict(impl=["triton"]), ValueError),
])
def test_bad_construction(kwargs, error):
    with pytest.raises(error):
        make(**kwargs)


def test_v2_imports_no_other_vllm_version():
    # v2 stands alone: none of its modules imports v1, the legacy (v0) layer, the benchmarks or
    # the drawings.
    import ast
    from pathlib import Path
    for path in Path(v2bt.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("paged_attention.v1", "paged_attention.legacy", "paged_attention.bench",
                                             "paged_attention.viz")), f"{path.name} imports {name}"


def test_wrong_device_for_this_machine():
    other = "cpu" if runtime.HAS_CUDA else "cuda"
    with pytest.raises(ValueError, match="cpu|cuda"):
        FastBlockTables([16], 2, 8, 64, other)


# ---- append_block_ids / apply_staged_writes ---------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_append_counts_now_tables_at_apply(impl):
    bt = make(impl)
    bt.append_block_ids(2, ([5, 6, 7], [9, 10]), overwrite=True)
    assert bt.num_blocks.np[:, 2].tolist() == [3, 2]               # the host count at once
    assert not host(bt.num_blocks.gpu).any()                       # the published one not yet
    assert not any(t.any() for t in tables(bt))                   # nor the device tables
    bt.apply_staged_writes()
    t0, t1 = tables(bt)
    assert t0[2, :4].tolist() == [5, 6, 7, 0] and t1[2, :3].tolist() == [9, 10, 0]
    assert host(bt.num_blocks.gpu)[:, 2].tolist() == [3, 2]
    # Append after the current ones; a group with nothing new keeps its row and count.
    bt.append_block_ids(2, ([8], []), overwrite=False)
    bt.apply_staged_writes()
    t0, t1 = tables(bt)
    assert t0[2, :5].tolist() == [5, 6, 7, 8, 0] and t1[2, :3].tolist() == [9, 10, 0]
    assert bt.num_blocks.np[:, 2].tolist() == [4, 2]
    # Only row 2 was ever written.
    assert not np.delete(t0, 2, axis=0).any() and not np.delete(t1, 2, axis=0).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_overwrite_replaces_from_column_zero(impl):
    bt = make(impl)
    bt.append_block_ids(1, ([1, 2, 3, 4], [5, 6]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(1, ([7], [8, 9, 10]), overwrite=True)
    bt.apply_staged_writes()
    t0, t1 = tables(bt)
    assert bt.num_blocks.np[:, 1].tolist() == [1, 3]
    assert t0[1, :5].tolist() == [7, 2, 3, 4, 0]                   # columns past the count: stale
    assert t1[1, :4].tolist() == [8, 9, 10, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_overwrite_with_empty_lists_resets_the_count(impl):
    # As in vLLM: stage_write([]) stages nothing, but the count still becomes 0.
    bt = make(impl)
    bt.append_block_ids(0, ([3, 4], [5]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(0, ([], []), overwrite=True)
    assert all(t.num_staged_writes == 0 for t in bt.block_tables)
    bt.apply_staged_writes()
    assert bt.num_blocks.np[:, 0].tolist() == [0, 0] and host(bt.num_blocks.gpu)[:, 0].tolist() == [0, 0]
    assert tables(bt)[0][0, :2].tolist() == [3, 4]                 # the ids stay in the table


def test_append_accepts_numpy_and_tuples():
    bt = make()
    bt.append_block_ids(3, (np.array([4, 5], dtype=np.int64), (6,)), overwrite=True)
    bt.apply_staged_writes()
    assert tables(bt)[0][3, :2].tolist() == [4, 5] and tables(bt)[1][3, :1].tolist() == [6]
    # A list that mixes numpy and plain ints, for a numpy request state: staged as plain ints.
    bt.append_block_ids(np.int64(2), ([np.int64(7), 8], [np.int32(9)]), overwrite=True)
    assert [w[2] for w in bt.block_tables[0].staged_writes()] == [(7, 8)]
    assert all(type(v) is int for table in bt.block_tables for w in table.staged_writes() for v in w[2])
    bt.apply_staged_writes()
    assert tables(bt)[0][2, :2].tolist() == [7, 8] and tables(bt)[1][2, :1].tolist() == [9]


def test_fast_apply_is_one_launch_for_all_groups(monkeypatch):
    from paged_attention.v2 import buffers
    fused = CountingKernel(fast_bt._apply_block_table_writes_kernel)
    per_group = CountingKernel(buffers._apply_write_kernel)
    monkeypatch.setattr(fast_bt, "_apply_block_table_writes_kernel", fused)
    monkeypatch.setattr(buffers, "_apply_write_kernel", per_group)
    bt = make("triton", block_sizes=[16, 32, 8])
    for req in range(MAX_REQS):
        bt.append_block_ids(req, ([req + 1], [req + 20, req + 30], [req + 40]), overwrite=True)
    bt.apply_staged_writes()
    assert fused.launches == 1 and per_group.launches == 0
    assert [host(t.gpu)[:, 0].tolist() for t in bt.block_tables] == [[1, 2, 3, 4], [20, 21, 22, 23], [40, 41, 42, 43]]
    # Nothing staged: still one launch, which publishes the counts to device memory.
    bt.append_block_ids(2, ([], [], []), overwrite=True)
    bt.apply_staged_writes()
    assert fused.launches == 2 and fused.grids[1] == (1,)
    assert host(bt._num_blocks_device).tolist() == bt.num_blocks.np.tolist()
    assert bt.num_blocks.np[:, 2].tolist() == [0, 0, 0]


def test_fast_apply_skips_only_when_nothing_changed(monkeypatch):
    # An apply with no write staged and the counts as last published launches nothing; a staged
    # write that leaves the counts as they were, or counts edited by hand, still get applied.
    fused = CountingKernel(fast_bt._apply_block_table_writes_kernel)
    monkeypatch.setattr(fast_bt, "_apply_block_table_writes_kernel", fused)
    bt = make("triton")
    bt.append_block_ids(0, ([1, 2], [3]), overwrite=True)
    bt.append_block_ids(1, ([4], [5, 6]), overwrite=True)
    bt.apply_staged_writes()
    assert fused.launches == 1
    bt.apply_staged_writes()                                   # nothing new: no launch
    assert fused.launches == 1
    out = bt.gather_block_tables(i32([1, 0]))
    assert host(out[0])[:, :3].tolist() == [[4, 0, 0], [1, 2, 0]]
    bt.append_block_ids(0, ([7, 8], [9]), overwrite=True)      # same counts, new ids
    bt.apply_staged_writes()
    assert fused.launches == 2
    for t in bt.input_block_tables:
        t.fill_(0)                                             # (a gather leaves stale columns)
    out = bt.gather_block_tables(i32([0]))
    assert host(out[0])[0, :3].tolist() == [7, 8, 0] and host(out[1])[0, :2].tolist() == [9, 0]
    bt.num_blocks.np[0, 0] = 1                                 # counts edited by hand, nothing staged
    bt.apply_staged_writes()
    assert fused.launches == 3
    bt.input_block_tables[0].fill_(0)
    out = bt.gather_block_tables(i32([0]))
    assert host(out[0])[0, :3].tolist() == [7, 0, 0]
    bt.apply_staged_writes()
    assert fused.launches == 3


@pytest.mark.parametrize("apply_impl,gather_impl", [("vllm", "triton"), ("triton", "triton"), ("vllm", "vllm")])
def test_apply_and_gather_kernels_mix(apply_impl, gather_impl):
    # The fast gather reads the counts from device memory after a fast apply, and from the UVA
    # buffer after vLLM's apply (run here on the fast tables): either way the counts just published.
    apply = FastBlockTables.apply_staged_writes if apply_impl == "triton" else BlockTables.apply_staged_writes
    bt = make(gather_impl)
    bt.append_block_ids(1, ([4, 5, 6], [7, 8]), overwrite=True)
    bt.apply_staged_writes()
    bt.gather_block_tables(i32([1]))
    bt.append_block_ids(1, ([9], []), overwrite=True)            # counts 1 and 0
    bt.append_block_ids(0, ([3], [2]), overwrite=True)
    apply(bt)
    out = bt.gather_block_tables(i32([1, 0]))
    assert host(out[0])[:, :4].tolist() == [[9, 5, 6, 0], [3, 0, 0, 0]]
    assert host(out[1])[:, :3].tolist() == [[7, 8, 0], [2, 0, 0]]


def test_fast_gather_follows_counts_published_by_hand():
    # Counts edited on the host and published with num_blocks.copy_to_uva() (not through
    # apply_staged_writes) must reach the fast gather too.
    bt = filled("triton")
    bt.num_blocks.np[0, 3] = 1
    bt.num_blocks.copy_to_uva()
    bt.input_block_tables[0].fill_(0)
    out = bt.gather_block_tables(i32([3]))
    assert host(out[0])[0, :3].tolist() == [301, 0, 0] and host(out[1])[0, :3].tolist() == [350, 351, 0]


def test_vllm_apply_is_one_launch_per_group(monkeypatch):
    from paged_attention.v2 import buffers
    counter = CountingKernel(buffers._apply_write_kernel)
    monkeypatch.setattr(buffers, "_apply_write_kernel", counter)
    bt = make("vllm")
    bt.append_block_ids(0, ([1], [2]), overwrite=True)
    bt.append_block_ids(1, ([3], []), overwrite=True)
    bt.apply_staged_writes()
    assert counter.launches == 2 and counter.grids == [(2,), (1,)]


@pytest.mark.parametrize("impl", IMPLS)
def test_many_writes_and_long_rows(impl):
    # More writes than one program takes, rows longer than one tile of the fast kernel.
    bt = make(impl, block_sizes=[1, 2], max_num_reqs=70, max_len=150)
    model = [np.zeros((70, 150), np.int32), np.zeros((70, 75), np.int32)]
    rng = np.random.default_rng(1)
    for req in range(70):
        n = int(rng.integers(0, 150))
        ids = (rng.integers(1, 10 ** 6, size=n).tolist(), rng.integers(1, 10 ** 6, size=cdiv(n, 2)).tolist())
        bt.append_block_ids(req, ids, overwrite=True)
        model[0][req, :n] = ids[0]
        model[1][req, :len(ids[1])] = ids[1]
    bt.apply_staged_writes()
    assert all(np.array_equal(got, want) for got, want in zip(tables(bt), model))


@pytest.mark.parametrize("call,error,match", [
    (lambda bt: bt.append_block_ids(4, ([1], [1]), overwrite=True), IndexError, "request state"),
    (lambda bt: bt.append_block_ids(-1, ([1], [1]), overwrite=True), IndexError, "request state"),
    (lambda bt: bt.append_block_ids(0, ([1],), overwrite=True), ValueError, "2 KV-cache groups"),
    (lambda bt: bt.append_block_ids(0, [1, 2], overwrite=True), TypeError, "list"),
    (lambda bt: bt.append_block_ids(0, ([1], [-2]), overwrite=True), ValueError, ">= 0|between 0"),
    (lambda bt: bt.append_block_ids(0, ([1], [2 ** 31]), overwrite=True), ValueError, "int32|fit"),
    (lambda bt: bt.append_block_ids(0, ([1], ["x"]), overwrite=True), TypeError, "integers"),
    # A list of ints with one that is not a plain int: a bool or a float is refused.
    (lambda bt: bt.append_block_ids(0, ([1], [2, True]), overwrite=True), TypeError, "integers"),
    (lambda bt: bt.append_block_ids(0, ([1, 2.0], [2]), overwrite=True), TypeError, "integers"),
    (lambda bt: bt.append_block_ids(True, ([1], [1]), overwrite=True), TypeError, "req_index"),
    (lambda bt: bt.append_block_ids(4.0, ([1], [1]), overwrite=True), TypeError, "req_index"),
    (lambda bt: bt.append_block_ids(0, ([1], [1]), overwrite=1), TypeError, "bool"),
    # Group 1 (block size 32) has 7 columns; request 0 holds 2 of them.
    (lambda bt: bt.append_block_ids(0, ([1], list(range(6))), overwrite=False), ValueError, "max_model_len"),
    (lambda bt: bt.append_block_ids(1, (list(range(14)), [1]), overwrite=True), ValueError, "max_model_len"),
    # Request 0 has writes staged at columns 0..2 of group 0 since the last apply.
    (lambda bt: bt.append_block_ids(0, ([1, 2, 3], []), overwrite=True), ValueError, "overlap"),
])
def test_bad_appends_raise_and_change_nothing(call, error, match):
    bt = make()
    bt.append_block_ids(0, ([1, 2], [3]), overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(0, ([4], [5]), overwrite=False)            # staged, not applied
    before = snapshot(bt)
    with pytest.raises(error, match=match):
        call(bt)
    assert_same(snapshot(bt), before)
    bt.apply_staged_writes()                                       # the staged write still lands
    assert tables(bt)[0][0, :3].tolist() == [1, 2, 4] and tables(bt)[1][0, :2].tolist() == [3, 5]


@pytest.mark.parametrize("forget", ["clear", "apply_write", "pop"])
def test_overlap_record_goes_with_the_staged_writes(forget):
    # The overlap check reads the ranges each table has staged: staged writes cleared, applied
    # or popped straight on bt.block_tables[g] (not through apply_staged_writes) take their
    # ranges with them, so a later write to the same columns is fine.
    bt = FastBlockTables([4], 2, 8, 16, DEV)
    bt.append_block_ids(0, ([1, 2],), overwrite=True)
    table = bt.block_tables[0]
    assert table.overlaps_staged(0, 1, 2) == (0, 2) and table.overlaps_staged(1, 0, 2) is None
    getattr(table, {"clear": "clear_staged_writes", "apply_write": "apply_write",
                    "pop": "pop_staged_writes"}[forget])()
    assert table.overlaps_staged(0, 0, 2) is None
    bt.append_block_ids(0, ([3],), overwrite=True)               # refused before the fix
    with pytest.raises(ValueError, match="overlap"):
        bt.append_block_ids(0, ([4],), overwrite=True)           # still refused: staged since
    bt.apply_staged_writes()
    assert tables(bt)[0][0, 0] == 3 and bt.num_blocks.np[0, 0] == 1


def test_appends_right_up_to_the_width_are_fine():
    bt = make()
    bt.append_block_ids(0, (list(range(1, 14)), list(range(1, 8))), overwrite=True)
    bt.apply_staged_writes()
    assert bt.num_blocks.np[:, 0].tolist() == [13, 7]
    assert tables(bt)[1][0].tolist() == list(range(1, 8))


# ---- gather_block_tables ----------------------------------------------------------------------

def filled(impl):
    """Request states 0..3 with distinct ids; group 1 has fewer blocks (bigger blocks)."""
    bt = make(impl)
    for req in range(MAX_REQS):
        n = req + 1
        bt.append_block_ids(req, ([100 * req + k for k in range(1, n + 1)], [100 * req + 50 + k for k in range(cdiv(n, 2))]),
                            overwrite=True)
    bt.apply_staged_writes()
    return bt


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_in_batch_order(impl):
    bt = filled(impl)
    out = bt.gather_block_tables(i32([3, 0, 2]))
    assert len(out) == 2 and [tuple(t.shape) for t in out] == [(3, 13), (3, 7)]
    assert out[0].data_ptr() == bt.input_block_tables[0].data_ptr()   # views of the persistent tensors
    g0, g1 = host(out[0]), host(out[1])
    assert g0[0, :5].tolist() == [301, 302, 303, 304, 0]
    assert g0[1, :2].tolist() == [1, 0] and g0[2, :4].tolist() == [201, 202, 203, 0]
    assert g1[0, :3].tolist() == [350, 351, 0] and g1[1, :2].tolist() == [50, 0] and g1[2, :3].tolist() == [250, 251, 0]
    assert not host(bt.input_block_tables[0])[3].any()             # row 3 untouched


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_int64_mapping_and_repeats(impl):
    bt = filled(impl)
    g0 = host(bt.gather_block_tables(i64([1, 1]))[0])
    assert g0[:, :3].tolist() == [[101, 102, 0], [101, 102, 0]]


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_leaves_stale_columns(impl):
    # As in vLLM, only the first num_blocks columns of a row are copied (attention reads no more).
    bt = filled(impl)
    bt.gather_block_tables(i32([3]))
    bt.append_block_ids(0, ([7], [8]), overwrite=True)
    bt.apply_staged_writes()
    g0 = host(bt.gather_block_tables(i32([0]))[0])
    assert g0[0, :5].tolist() == [7, 302, 303, 304, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_reads_published_counts_only(impl):
    bt = filled(impl)
    bt.append_block_ids(1, ([9], [9]), overwrite=False)            # staged, not applied
    g0 = host(bt.gather_block_tables(i32([1]))[0])
    assert g0[0, :4].tolist() == [101, 102, 0, 0]
    bt.apply_staged_writes()
    assert host(bt.gather_block_tables(i32([1]))[0])[0, :4].tolist() == [101, 102, 9, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_pads_rows_with_zeros_over_each_groups_width(impl):
    bt = filled(impl)
    bt.gather_block_tables(i32([3, 2, 1, 0]))                      # every input row non-zero
    out = bt.gather_block_tables(i32([2]), num_reqs_padded=2)
    assert [tuple(t.shape) for t in out] == [(2, 13), (2, 7)]
    g0, g1 = host(bt.input_block_tables[0]), host(bt.input_block_tables[1])
    # Row 0 held request 3's four ids: the fourth stays (stale).
    assert g0[0, :5].tolist() == [201, 202, 203, 304, 0] and g1[0, :3].tolist() == [250, 251, 0]
    assert not g0[1].any() and not g1[1].any()                     # the padded row
    # Rows past the padding are untouched: vLLM zeroes group 1's padded row with group 0's
    # width (13 > 7), running into row 2.
    assert g0[2, :3].tolist() == [101, 102, 0] and g1[2, :2].tolist() == [150, 0]
    assert g0[3, :2].tolist() == [1, 0] and g1[3, :2].tolist() == [50, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_of_an_empty_batch(impl):
    bt = filled(impl)
    out = bt.gather_block_tables(i32([]))
    assert [tuple(t.shape) for t in out] == [(0, 13), (0, 7)]
    out = bt.gather_block_tables(i32([]), num_reqs_padded=1)
    assert not host(out[0]).any() and not host(out[1]).any()


@pytest.mark.parametrize("call,error,match", [
    (lambda bt: bt.gather_block_tables(i32([0, 4])), IndexError, r"idx_mapping\[1\] = 4"),
    (lambda bt: bt.gather_block_tables(i32([-1])), IndexError, "request state"),
    (lambda bt: bt.gather_block_tables(i32([0] * 5)), ValueError, "max_num_reqs"),
    (lambda bt: bt.gather_block_tables(torch.tensor([0.0], device=DEV)), TypeError, "int32 or int64"),
    (lambda bt: bt.gather_block_tables(i32([[0]])), ValueError, "1-D"),
    (lambda bt: bt.gather_block_tables([0, 1]), TypeError, "Tensor"),
    (lambda bt: bt.gather_block_tables(i32([0, 1]), num_reqs_padded=1), ValueError, "num_reqs_padded"),
    (lambda bt: bt.gather_block_tables(i32([0, 1]), num_reqs_padded=5), ValueError, "max_num_reqs"),
    (lambda bt: bt.gather_block_tables(i32([0, 1, 2, 3])[::2]), ValueError, "contiguous"),
])
def test_bad_gathers_raise_before_launching(call, error, match):
    bt = filled("triton")
    bt.gather_block_tables(i32([3, 2]))
    before = snapshot(bt)
    with pytest.raises(error, match=match):
        call(bt)
    assert_same(snapshot(bt), before)


@pytest.mark.cuda
def test_gather_refuses_a_host_mapping():
    bt = filled("triton")
    with pytest.raises(ValueError, match="must be on"):
        bt.gather_block_tables(torch.tensor([0], dtype=torch.int32))


def test_dummy_block_tables_are_the_persistent_views():
    bt = filled("triton")
    bt.gather_block_tables(i32([1, 0]))
    before = [host(t).copy() for t in bt.input_block_tables]
    out = bt.get_dummy_block_tables(3)
    assert [t.data_ptr() for t in out] == [t.data_ptr() for t in bt.input_block_tables]
    assert [tuple(t.shape) for t in out] == [(3, 13), (3, 7)]
    assert all(np.array_equal(host(t), b) for t, b in zip(bt.input_block_tables, before))
    with pytest.raises(ValueError):
        bt.get_dummy_block_tables(5)


# ---- compute_slot_mappings --------------------------------------------------------------------

def worked_example(impl):
    """Request state 5 holds [7, 9], state 2 holds [3]; one group of blocks of 16."""
    bt = make_block_tables([16], 8, 16, 64, DEV, impl=impl)
    bt.append_block_ids(5, ([7, 9],), overwrite=True)
    bt.append_block_ids(2, ([3],), overwrite=True)
    bt.apply_staged_writes()
    return bt


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("via", ["gather", "idx_mapping"])
def test_worked_example(impl, via):
    bt = worked_example(impl)
    idx = i32([5, 2])
    qsl, pos = i32([0, 3, 5]), i64([16, 17, 18, 0, 1])
    if via == "gather":
        bt.gather_block_tables(idx)
        out = bt.compute_slot_mappings(qsl, pos)
    else:
        out = bt.compute_slot_mappings(qsl, pos, idx_mapping=idx)
    assert tuple(out.shape) == (1, 5) and out.data_ptr() == bt.slot_mappings.data_ptr()
    assert host(bt.slot_mappings)[0].tolist() == [144, 145, 146, 48, 49] + [PAD_SLOT_ID] * 11
    padded = bt.compute_slot_mappings(qsl, pos, idx_mapping=idx, num_tokens_padded=8)
    assert host(padded).tolist() == [[144, 145, 146, 48, 49, -1, -1, -1]]


@pytest.mark.parametrize("impl", IMPLS)
def test_two_groups_each_in_its_own_block_size(impl):
    bt = filled(impl)
    bt.gather_block_tables(i32([3, 1]))
    # Request state 3: group 0 blocks [301..304] (16 tokens each), group 1 blocks [350, 351] (32).
    # Request state 1: group 0 [101, 102], group 1 [150].
    qsl, pos = i32([0, 3, 5]), i64([15, 16, 40, 0, 31])
    out = host(bt.compute_slot_mappings(qsl, pos))
    assert out[0].tolist() == [301 * 16 + 15, 302 * 16, 303 * 16 + 8, 101 * 16, 102 * 16 + 15]
    assert out[1].tolist() == [350 * 32 + 15, 350 * 32 + 16, 351 * 32 + 8, 150 * 32, 150 * 32 + 31]


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_starts_at_the_real_token_count(impl):
    # vLLM's fix in PR #36580: tokens between query_start_loc[-1] and len(positions) are padding
    # too (before it, padding began at len(positions), leaving the previous step's slots there).
    bt = filled(impl)
    bt.gather_block_tables(i32([3, 2]))
    bt.compute_slot_mappings(i32([0, 4, 8]), i64([0, 1, 2, 3, 0, 1, 2, 3]))
    assert (host(bt.slot_mappings)[:, :8] >= 0).all()
    out = bt.compute_slot_mappings(i32([0, 2, 3]), i64([0, 1, 5, 0, 0, 0, 0, 0]))
    assert tuple(out.shape) == (2, 8)
    full = host(bt.slot_mappings)
    assert full[0, :3].tolist() == [301 * 16, 301 * 16 + 1, 201 * 16 + 5]
    assert (full[:, 3:] == PAD_SLOT_ID).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_requests_and_an_empty_batch(impl):
    bt = filled(impl)
    idx = i32([0, 1, 2, 3])
    out = host(bt.compute_slot_mappings(i32([0, 0, 2, 2, 3]), i64([17, 18, 5]), idx_mapping=idx))
    assert out[0].tolist() == [102 * 16 + 1, 102 * 16 + 2, 301 * 16 + 5]
    bt.compute_slot_mappings(i32([0]), i64([]))
    assert (host(bt.slot_mappings) == PAD_SLOT_ID).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_slots_are_64_bit(impl):
    # A block id times the block size past 2**31: an int32 product would wrap.
    bt = make_block_tables([16, 32], 2, 4, 64, DEV, impl=impl)
    big = 2 ** 31 - 5
    bt.append_block_ids(1, ([3, big], [big]), overwrite=True)
    bt.apply_staged_writes()
    out = host(bt.compute_slot_mappings(i32([0, 2]), i64([17, 20]), idx_mapping=i32([1])))
    assert out[0].tolist() == [big * 16 + 1, big * 16 + 4] and out[1].tolist() == [big * 32 + 17, big * 32 + 20]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_full_batch_of_tokens(impl):
    bt = filled(impl)
    bt.gather_block_tables(i32([3, 0, 1, 2]))
    pos = list(range(0, 50, 5)) + [0, 3, 7] + [20, 21, 22]
    out = host(bt.compute_slot_mappings(i32([0, 10, 11, 13, 16]), i64(pos)))
    table = {3: [301, 302, 303, 304], 0: [1], 1: [101, 102], 2: [201, 202, 203]}
    owners = [3] * 10 + [0] + [1] * 2 + [2] * 3
    assert out[0].tolist() == [table[r][p // 16] * 16 + p % 16 for r, p in zip(owners, pos)]


def bad_slot_calls():
    q, p = i32([0, 2, 3]), i64([0, 1, 2])
    return [
        (lambda bt: bt.compute_slot_mappings(i32([1, 2, 3]), p), ValueError, "rise from 0"),
        (lambda bt: bt.compute_slot_mappings(i32([0, 2, 1]), p), ValueError, "rise from 0"),
        (lambda bt: bt.compute_slot_mappings(i32([0, 2, 4]), p), ValueError, "rise from 0"),
        (lambda bt: bt.compute_slot_mappings(q, i64(list(range(17)))), ValueError, "max_num_batched_tokens"),
        (lambda bt: bt.compute_slot_mappings(i32([0, 1, 2, 3, 4, 5, 6]), i64([0] * 6)), ValueError, "max_num_reqs"),
        (lambda bt: bt.compute_slot_mappings(q, i64([0, 1, 208])), ValueError, "max_model_len"),
        (lambda bt: bt.compute_slot_mappings(q, i64([0, -1, 2])), ValueError, ">= 0"),
        (lambda bt: bt.compute_slot_mappings(q, p.float()), TypeError, "int32 or int64"),
        (lambda bt: bt.compute_slot_mappings(q.tolist(), p), TypeError, "Tensor"),
        (lambda bt: bt.compute_slot_mappings(i32([]), p), ValueError, "entries"),
        (lambda bt: bt.compute_slot_mappings(q, p, num_tokens_padded=17), ValueError, "num_tokens_padded"),
        (lambda bt: bt.compute_slot_mappings(q, p, idx_mapping=i32([0])), ValueError, "2 requests"),
        (lambda bt: bt.compute_slot_mappings(q, p, idx_mapping=i32([0, 9])), IndexError, "request state"),
        # Three requests, but the last gather wrote two rows.
        (lambda bt: bt.compute_slot_mappings(i32([0, 1, 2, 3]), p), ValueError, "gather"),
    ]


@pytest.mark.parametrize("case", range(len(bad_slot_calls())))
def test_bad_slot_mappings_raise_before_launching(case):
    call, error, match = bad_slot_calls()[case]
    bt = filled("triton")
    bt.gather_block_tables(i32([3, 2]))
    bt.compute_slot_mappings(i32([0, 2, 3]), i64([0, 1, 2]))
    before = snapshot(bt)
    with pytest.raises(error, match=match):
        call(bt)
    assert_same(snapshot(bt), before)


@pytest.mark.cuda
def test_slot_mappings_refuse_host_tensors():
    bt = filled("triton")
    with pytest.raises(ValueError, match="must be on"):
        bt.compute_slot_mappings(torch.tensor([0, 1], dtype=torch.int32), i64([0]), idx_mapping=i32([0]))


@pytest.mark.parametrize("impl", IMPLS)
def test_unchecked_fast_path_gives_the_same_slots(impl):
    bt = filled(impl)
    idx, qsl, pos = i32([2, 3]), i32([0, 2, 4]), i64([0, 40, 1, 63])
    checked = host(bt.compute_slot_mappings(qsl, pos, idx_mapping=idx)).copy()
    unchecked = host(bt.compute_slot_mappings(qsl, pos, idx_mapping=idx, check=False))
    assert np.array_equal(checked, unchecked) and checked[0, 1] == 203 * 16 + 8


def test_dummy_slot_mappings_fill_everything():
    bt = filled("triton")
    bt.gather_block_tables(i32([3]))
    bt.compute_slot_mappings(i32([0, 4]), i64([0, 1, 2, 3]))
    out = bt.get_dummy_slot_mappings(6)
    assert tuple(out.shape) == (2, 6) and out.data_ptr() == bt.slot_mappings.data_ptr()
    assert (host(bt.slot_mappings) == PAD_SLOT_ID).all()
    with pytest.raises(ValueError):
        bt.get_dummy_slot_mappings(17)


def test_impl_is_chosen_by_the_constructor(monkeypatch):
    vllm = CountingKernel(v2bt._compute_slot_mappings_kernel)
    fast = CountingKernel(fast_bt._compute_slot_mappings_fast_kernel)
    monkeypatch.setattr(v2bt, "_compute_slot_mappings_kernel", vllm)
    monkeypatch.setattr(fast_bt, "_compute_slot_mappings_fast_kernel", fast)
    args = (i32([0, 1, 3]), i64([0, 1, 2]))
    filled("triton").compute_slot_mappings(*args, idx_mapping=i32([1, 2]))
    assert vllm.launches == 0 and fast.grids == [(1,)]           # ours: tiles of tokens
    filled("vllm").compute_slot_mappings(*args, idx_mapping=i32([1, 2]))
    assert vllm.grids == [(2, 3)] and fast.launches == 1         # vLLM's: (groups, requests + 1)
    with pytest.raises(TypeError, match="impl"):
        FastBlockTables(BLOCK_SIZES, MAX_REQS, MAX_TOKENS, MAX_LEN, DEV, impl="vllm")


@pytest.mark.cuda
def test_fast_kernels_replay_from_a_cuda_graph():
    # Capture gather + slots once; later steps change the tables, the counts and the batch in
    # place (fixed buffers), and each replay must equal an eager call.
    bt = filled("triton")
    idx, qsl, pos = i32([3, 1, 0]), i32([0, 2, 3, 5]), i64([0, 17, 20, 5, 6])
    run = lambda: (bt.gather_block_tables(idx, check=False),
                   bt.compute_slot_mappings(qsl, pos, idx_mapping=idx, check=False))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in range(3):
        for req in range(MAX_REQS):
            bt.append_block_ids(req, ([500 + 10 * step + req], [600 + 10 * step + req]), overwrite=False)
        bt.apply_staged_writes()
        idx.copy_(idx.roll(1))
        graph.replay()
        torch.cuda.synchronize()
        replayed = [host(t).copy() for t in bt.input_block_tables] + [host(bt.slot_mappings).copy()]
        run()
        eager = [host(t) for t in bt.input_block_tables] + [host(bt.slot_mappings)]
        assert all(np.array_equal(a, b) for a, b in zip(replayed, eager))
        counts = bt.num_blocks.np[0, host(idx)]
        assert [int(replayed[0][b, n - 1]) for b, n in enumerate(counts)] == [
            500 + 10 * step + int(r) for r in host(idx)]


# ---- Ours: the fused gather + slots, the split apply ----------------------------------------

@pytest.mark.parametrize("padded", [None, 4])
def test_fused_gather_and_slots_equal_the_two_calls(padded, monkeypatch):
    fused = CountingKernel(fast_bt._gather_and_slots_fast_kernel)
    monkeypatch.setattr(fast_bt, "_gather_and_slots_fast_kernel", fused)
    bt = filled("triton")
    idx, qsl, pos = i32([3, 1, 0]), i32([0, 2, 3, 5]), i64([0, 17, 20, 5, 6])
    tables_out, slots = bt.gather_and_compute_slot_mappings(idx, qsl, pos, num_reqs_padded=padded)
    assert fused.launches == 1
    got = [host(t).copy() for t in bt.input_block_tables] + [host(bt.slot_mappings).copy()]
    assert [tuple(t.shape) for t in tables_out] == [(padded or 3, 13), (padded or 3, 7)]
    assert tuple(slots.shape) == (2, 5)
    for impl in IMPLS:
        two = filled(impl)                                        # the same tables, the two calls
        for t in two.input_block_tables:
            t.fill_(-7)
        two.slot_mappings.fill_(-9)
        two.gather_block_tables(idx, padded)
        two.compute_slot_mappings(qsl, pos)
        want = [host(t) for t in two.input_block_tables] + [host(two.slot_mappings)]
        # Columns past a row's count are stale (-7 here, whatever the fused call left there).
        for g, (a, b) in enumerate(zip(got[:2], want[:2])):
            counts = bt.num_blocks.np[g, host(idx)]
            for r, n in enumerate(counts):
                assert a[r, :n].tolist() == b[r, :n].tolist()
            if padded:
                assert (a[3:padded] == 0).all() and (b[3:padded] == 0).all()
        assert np.array_equal(got[2], want[2])


def test_fused_gather_and_slots_check_their_inputs():
    bt = filled("triton")
    with pytest.raises(IndexError):
        bt.gather_and_compute_slot_mappings(i32([3, 9]), i32([0, 1, 2]), i64([0, 1]))
    with pytest.raises(ValueError, match="entries"):
        bt.gather_and_compute_slot_mappings(i32([3]), i32([0, 1, 2]), i64([0, 1]))


def test_split_apply_can_be_launched_again():
    # pack_staged_writes (host) + launch_staged_writes (device) = apply_staged_writes; a
    # second launch of the same pack writes the same ids again (what the benchmark times).
    bt = filled("triton")
    bt.append_block_ids(2, ([77], [78]), overwrite=False)
    bt.num_blocks.copy_to_uva()
    packed = bt.pack_staged_writes()
    assert packed[1] == 2 and bt.block_tables[0].num_staged_writes == 0
    bt.launch_staged_writes(packed)
    assert tables(bt)[0][2, 3] == 77 and tables(bt)[1][2, 2] == 78
    bt.block_tables[0].gpu[2, 3] = 0
    bt.launch_staged_writes(packed)
    assert tables(bt)[0][2, 3] == 77
    assert host(bt._num_blocks_device).tolist() == bt.num_blocks.np.tolist()


@pytest.mark.cuda
def test_fast_apply_replays_from_a_cuda_graph():
    # A captured launch_staged_writes reads the write count from its buffer: replays apply
    # each step's writes, however many, as long as the graph's pool buffer is the one packed.
    bt = filled("triton")
    bt.num_blocks.copy_to_uva()
    packed = bt.pack_staged_writes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bt.launch_staged_writes(packed)
    for step in range(3):
        for req in range(step + 1):
            bt.append_block_ids(req, ([900 + 10 * step + req], []), overwrite=False)
        bt.num_blocks.copy_to_uva()
        pool = bt._write_pool
        pool._curr = (pool._curr - 1) % pool.max_concurrency      # refill the captured buffer
        again = bt.pack_staged_writes()
        assert again[0].data_ptr() == packed[0].data_ptr() and again[1] == step + 1
        graph.replay()
        torch.cuda.synchronize()
        for req in range(step + 1):
            n = bt.num_blocks.np[0, req]
            assert tables(bt)[0][req, n - 1] == 900 + 10 * step + req
        assert host(bt._num_blocks_device).tolist() == bt.num_blocks.np.tolist()


@pytest.mark.parametrize("rows, programs", [(64, 2), (1, 1), (1, 2), (2, 2)])
def test_apply_launched_as_under_capture_uses_the_count_in_the_buffer(rows, programs, monkeypatch):
    # Under capture a few programs (capture_write_programs, tiles of capture_write_rows writes)
    # loop over the tiles up to the count read from the buffer (STRIDED); the interpreter can
    # run that launch too. Tiles of one or two writes make the programs loop (4 writes); the
    # three-block write takes its first id from firsts, the other two from the values region.
    apply = CountingKernel(fast_bt._apply_block_table_writes_kernel)
    monkeypatch.setattr(fast_bt, "_apply_block_table_writes_kernel", apply)
    monkeypatch.setattr(fast_bt, "capturing", lambda device: True)
    bt = filled("triton")
    bt.capture_write_rows, bt.capture_write_programs = rows, programs
    bt.append_block_ids(1, ([41], [42]), overwrite=False)
    bt.append_block_ids(3, ([43], []), overwrite=False)
    bt.append_block_ids(2, ([], [44, 45, 46]), overwrite=False)
    before = [t.copy() for t in tables(bt)]
    bt.apply_staged_writes()
    assert apply.grids[-1] == (min(programs, cdiv(2 * MAX_REQS, rows)) + 1,)
    after = tables(bt)
    assert after[0][1, 2] == 41 and after[1][1, 1] == 42 and after[0][3, 4] == 43
    assert after[1][2, 2:5].tolist() == [44, 45, 46]
    after[0][1, 2] = after[1][1, 1] = after[0][3, 4] = 0
    after[1][2, 2:5] = 0
    assert all(np.array_equal(a, b) for a, b in zip(after, before))
    assert host(bt._num_blocks_device).tolist() == bt.num_blocks.np.tolist()


@pytest.mark.parametrize("ids,overwrite,error,match", [
    (([1], [-2]), True, ValueError, "between 0"),
    (([2 ** 31], [1]), True, ValueError, "int32"),
    (([1, True], [1]), True, TypeError, "integers"),
    (([1], [2.0]), True, TypeError, "integers"),
    (([1], list(range(1, 9))), True, ValueError, "max_model_len"),       # group 1 has 7 columns
    (([1], [1]), np.bool_(True), None, None),                         # a numpy bool is a bool
])
def test_appends_to_a_row_with_nothing_staged(ids, overwrite, error, match):
    """A row with no write staged since the last apply (the model runner's usual append) is
    checked as thoroughly as any: the same errors, nothing changed."""
    bt = make()
    bt.append_block_ids(1, ([1, 2], [3]), overwrite=True)
    bt.apply_staged_writes()
    before = snapshot(bt)
    if error is None:
        bt.append_block_ids(1, ids, overwrite=overwrite)
        bt.apply_staged_writes()
        assert tables(bt)[0][1, :1].tolist() == ids[0] and bt.num_blocks.np[:, 1].tolist() == [1, 1]
        return
    with pytest.raises(error, match=match):
        bt.append_block_ids(1, ids, overwrite=overwrite)
    assert_same(snapshot(bt), before)


def test_the_staged_write_limit_holds_for_a_row_with_nothing_staged():
    bt = make()
    bt.append_block_ids(0, ([1], []), overwrite=True)
    bt.append_block_ids(0, ([2], []), overwrite=False)                # a second write to row 0
    for req in range(1, MAX_REQS - 1):
        bt.append_block_ids(req, ([req + 10], []), overwrite=True)
    assert bt.block_tables[0].num_staged_writes == MAX_REQS
    before = snapshot(bt)
    with pytest.raises(ValueError, match="staged writes already"):
        bt.append_block_ids(MAX_REQS - 1, ([7], []), overwrite=True)   # a row with nothing staged
    assert_same(snapshot(bt), before)
