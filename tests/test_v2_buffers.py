"""v2 host/device buffers (vLLM's ``vllm/v1/worker/gpu/buffer_utils.py``): UvaBuffer, UvaBufferPool, UvaBackedTensor, StagedWriteTensor.

On a CPU-only machine the device-visible buffers are host memory and the write kernel runs in
Triton's interpreter; on a GPU the same tests run against pinned memory read through UVA and the
compiled kernel (every test reads results back with ``.cpu()``, which synchronises).
"""
import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.v2 import buffers
from paged_attention.v2.buffers import (StagedWriteTensor, UnsupportedDtypeError, UvaBackedTensor, UvaBuffer,
                                        UvaBufferPool, async_copy_to_gpu)

DEV = runtime.DEVICE


def host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


class CountingKernel:
    """Wraps a Triton kernel object and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        self.launches += 1
        self.grids.append(grid)
        return self.kernel[grid]


# ---- UvaBuffer / UvaBufferPool ------------------------------------------------------------------

def test_uva_buffer_views_share_memory():
    buf = UvaBuffer((2, 3), torch.int32)
    assert buf.cpu.shape == (2, 3) and buf.cpu.dtype == torch.int32 and not buf.cpu.any()
    assert buf.uva.device.type == DEV.type
    buf.np[1, 2] = 7                      # a host write, seen through the device view at once
    assert host(buf.uva)[1, 2] == 7
    assert buf.cpu.data_ptr() == buf.uva.data_ptr()
    if runtime.HAS_CUDA:
        assert buf.cpu.is_pinned()


def test_pool_advances_the_cursor_before_use():
    pool = UvaBufferPool(4, torch.int32, max_concurrency=3)
    first = pool.copy_to_uva([1, 2])
    assert pool.current_index == 1                                  # the first call uses buffer 1
    assert pool.index_of(first) == 1
    contents = pool.host_contents()
    assert contents[1][:2].tolist() == [1, 2] and not contents[0].any() and len(contents) == 3
    assert first.shape == (2,) and host(first).tolist() == [1, 2]
    second = pool.copy_to_uva(np.array([5, 6, 7], dtype=np.int32))
    assert pool.current_index == 2 and host(second).tolist() == [5, 6, 7]
    contents[1][0] = 99                                             # a copy: the buffer is untouched
    assert host(first).tolist() == [1, 2] and pool.index_of(torch.zeros(1, device=DEV)) is None
    assert host(first).tolist() == [1, 2]                           # the earlier view kept its data
    pool.copy_to_uva(torch.tensor([9], dtype=torch.int32))          # buffer 0
    pool.copy_to_uva([4])                                           # buffer 1 again: reused
    assert host(first).tolist() == [4, 2]


def test_pool_copy_to_gpu_is_a_device_copy():
    pool = UvaBufferPool((3, 2), torch.float32)
    out = pool.copy_to_gpu([[1.0, 2.0], [3.0, 4.0]])
    assert out.device.type == DEV.type and host(out).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    pool._uva_bufs[pool._curr].np[0, 0] = -1.0                      # not aliased
    assert host(out)[0, 0] == 1.0
    target = torch.zeros(1, 2, device=DEV)
    pool.copy_to_gpu(np.array([[8.0, 9.0]], dtype=np.float32), out=target)
    assert host(target).tolist() == [[8.0, 9.0]]


def test_pool_rejects_bad_sources():
    pool = UvaBufferPool((3, 2), torch.int32)
    with pytest.raises(ValueError, match="rows"):
        pool.copy_to_uva([[1, 2]] * 4)                              # more rows than the buffers
    with pytest.raises(ValueError, match="shape"):
        pool.copy_to_uva([[1, 2, 3]])
    with pytest.raises(TypeError):
        pool.copy_to_uva("12")
    assert pool._curr == 0                                          # failed calls moved nothing
    with pytest.raises(ValueError, match="max_concurrency"):
        UvaBufferPool(2, torch.int32, max_concurrency=0)
    with pytest.raises(UnsupportedDtypeError):
        UvaBufferPool(2, torch.bfloat16)


@pytest.mark.cuda
def test_pool_rejects_a_device_tensor():
    pool = UvaBufferPool(3, torch.int32)
    with pytest.raises(ValueError, match="CPU"):
        pool.copy_to_uva(torch.zeros(2, dtype=torch.int32, device="cuda"))


# ---- UvaBackedTensor -----------------------------------------------------------------------------

def test_kernel_copy_moves_host_memory_both_ways(monkeypatch):
    """``kernel_copy`` between a UVA view and device memory, both ways, over several programs
    (a block of 4 here: a copy that dropped the last, partial block, or wrote past the end, fails)."""
    monkeypatch.setattr(buffers, "KERNEL_COPY_BLOCK", 4)
    monkeypatch.setattr(buffers, "_kernel_copy_launcher", None)
    up = UvaBuffer(11, torch.int32)
    up.np[:] = np.arange(11) * 3 - 7
    dst = torch.full((12,), -1, dtype=torch.int32, device=DEV)
    assert buffers.kernel_copy(dst[:10], up.uva[:10]) is not None
    assert host(dst).tolist() == (np.arange(10) * 3 - 7).tolist() + [-1, -1]
    down = UvaBuffer(9, torch.int64)
    src = torch.arange(9, dtype=torch.int64, device=DEV) * 1000003
    buffers.kernel_copy(down.uva, src)
    if runtime.HAS_CUDA:
        torch.cuda.synchronize()
    assert down.np.tolist() == [i * 1000003 for i in range(9)]        # read on the host, no copy back
    buffers.kernel_copy(down.uva[:0], src[:0])                         # nothing to copy: no launch


def test_kernel_copy_refuses_what_it_cannot_copy_flat():
    a = torch.zeros(6, dtype=torch.int32, device=DEV)
    before = host(a).tolist()
    with pytest.raises(TypeError):
        buffers.kernel_copy(a, a.to(torch.int64))
    with pytest.raises(TypeError):
        buffers.kernel_copy(a, [1, 2, 3])
    with pytest.raises(ValueError, match="shape"):
        buffers.kernel_copy(a, torch.ones(5, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        buffers.kernel_copy(a[::2], torch.ones(3, dtype=torch.int32, device=DEV))
    if runtime.HAS_CUDA:
        with pytest.raises(ValueError, match="one device"):
            buffers.kernel_copy(a, torch.ones(6, dtype=torch.int32))
    assert host(a).tolist() == before


def test_uva_backed_tensor_publishes_only_on_copy():
    t = UvaBackedTensor((2, 4), torch.int32)
    assert t.gpu.shape == (2, 4) and not host(t.gpu).any()
    first_gpu = t.gpu
    t.np[1, 3] = 5
    assert host(t.gpu)[1, 3] == 0                                  # invisible until copy_to_uva
    returned = t.copy_to_uva()
    assert returned is t.gpu and t.gpu is not first_gpu           # re-bound to the next buffer
    assert t.gpu.data_ptr() != first_gpu.data_ptr()
    assert host(t.gpu)[1, 3] == 5 and host(first_gpu)[1, 3] == 0   # the old view keeps the old data
    t.np[0, 0] = 9
    t.copy_to_uva(1)                                               # one row; back to the first buffer
    assert t.gpu.shape == (1, 4) and host(t.gpu).tolist() == [[9, 0, 0, 0]]
    assert t.gpu.data_ptr() == first_gpu.data_ptr()
    assert t.cpu.data_ptr() not in (t.gpu.data_ptr(), first_gpu.data_ptr())   # .cpu is separate


def test_uva_backed_tensor_checks_n():
    t = UvaBackedTensor(3, torch.int64)
    before = t.gpu
    with pytest.raises(ValueError, match="between 0 and 3"):
        t.copy_to_uva(4)
    with pytest.raises(TypeError):
        t.copy_to_uva(1.5)
    assert t.gpu is before


def test_async_copy_to_gpu():
    out = async_copy_to_gpu(np.arange(3, dtype=np.int64), device=DEV)
    assert out.device.type == DEV.type and host(out).tolist() == [0, 1, 2]
    dst = torch.zeros(3, dtype=torch.int64, device=DEV)
    assert async_copy_to_gpu(torch.tensor([4, 5, 6]), out=dst) is dst and host(dst).tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="device"):
        async_copy_to_gpu(torch.zeros(2))
    with pytest.raises(TypeError):
        async_copy_to_gpu([1, 2], device=DEV)


# ---- StagedWriteTensor ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int16, torch.float16, torch.bool, torch.bfloat16])
def test_unsupported_dtypes(dtype):
    with pytest.raises(ValueError, match="Unsupported dtype"):
        StagedWriteTensor((2, 2), dtype, DEV)


def test_wrong_device_is_refused():
    other = "cpu" if runtime.HAS_CUDA else "cuda"
    with pytest.raises(ValueError, match="cpu|cuda"):
        StagedWriteTensor((2, 2), torch.int32, other)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_staged_writes_land_where_staged(dtype):
    t = StagedWriteTensor((4, 6), dtype, DEV)
    assert t.num_rows == 4 and t.gpu.dtype == dtype and not host(t.gpu).any()
    model = np.zeros((4, 6))
    for row, start, values in [(0, 0, [1, 2, 3]), (2, 4, [7, 8]), (3, 1, [5]), (1, 0, list(range(10, 16)))]:
        t.stage_write(row, start, values)
        model[row, start:start + len(values)] = values
    assert t.num_staged_writes == 4
    assert not host(t.gpu).any()                    # nothing applied yet
    t.apply_write()
    assert t.num_staged_writes == 0
    assert np.array_equal(host(t.gpu), model)
    # A second round: cells not written keep their values.
    t.stage_write(2, 0, [9])
    t.stage_write(0, 2, np.array([4, 4]))
    model[2, 0] = 9
    model[0, 2:4] = 4
    t.apply_write()
    assert np.array_equal(host(t.gpu), model)


def test_long_write_crosses_tiles():
    t = StagedWriteTensor((2, 2500), torch.int32, DEV)
    values = list(range(1, 2301))
    t.stage_write(1, 150, values)
    t.stage_write(0, 2499, [42])
    t.apply_write()
    got = host(t.gpu)
    assert got[1, 150:2450].tolist() == values
    assert not got[1, :150].any() and not got[1, 2450:].any()
    assert got[0, 2499] == 42 and not got[0, :2499].any()


def test_empty_write_is_a_no_op_and_apply_without_writes_too():
    t = StagedWriteTensor((2, 3), torch.int32, DEV)
    t.stage_write(1, 0, [])
    t.stage_write(0, 3, [])                         # even at the row's end
    assert t.num_staged_writes == 0
    t.apply_write()
    assert not host(t.gpu).any()


def test_stage_write_elem_one_and_two_dimensional():
    flat = StagedWriteTensor(5, torch.int64, DEV)
    flat.stage_write_elem(3, 11)
    flat.stage_write_elem(0, -4)
    flat.apply_write()
    assert host(flat.gpu).tolist() == [-4, 0, 0, 11, 0]
    table = StagedWriteTensor((3, 4), torch.float32, DEV)
    table.stage_write_elem(2, 1.5)
    table.apply_write()
    assert host(table.gpu)[2].tolist() == [1.5, 0.0, 0.0, 0.0] and not host(table.gpu)[:2].any()


def test_staged_writes_are_listed_in_order_as_copies():
    t = StagedWriteTensor((3, 4), torch.int32, DEV)
    t.stage_write(2, 1, [5, 6])
    t.stage_write_elem(0, 7)
    t.stage_write(1, 0, [])                                         # stages nothing
    writes = t.staged_writes()
    assert writes == [(2, 1, (5, 6)), (0, 0, (7,))]
    writes.clear()
    assert t.num_staged_writes == 2 and len(t.staged_writes()) == 2
    t.apply_write()
    assert t.staged_writes() == []


def test_clear_staged_writes_drops_them():
    t = StagedWriteTensor((2, 2), torch.int32, DEV)
    t.stage_write(0, 0, [1, 2])
    t.clear_staged_writes()
    assert t.num_staged_writes == 0
    t.apply_write()
    assert not host(t.gpu).any()


def test_apply_write_is_one_launch_for_all_writes(monkeypatch):
    counter = CountingKernel(buffers._apply_write_kernel)
    monkeypatch.setattr(buffers, "_apply_write_kernel", counter)
    t = StagedWriteTensor((4, 4), torch.int32, DEV)
    for row in range(4):
        t.stage_write(row, 0, [row + 1])
    t.apply_write()
    assert counter.launches == 1 and counter.grids == [(4,)]
    t.apply_write()                                  # nothing staged: no launch
    assert counter.launches == 1


@pytest.mark.parametrize("call,error,match", [
    (lambda t: t.stage_write(-1, 0, [1]), IndexError, "outside the rows"),
    (lambda t: t.stage_write(3, 0, [1]), IndexError, "outside the rows"),
    (lambda t: t.stage_write(0, -1, [1]), ValueError, "start"),
    (lambda t: t.stage_write(0, 2, [1, 2, 3]), ValueError, "past the end"),
    (lambda t: t.stage_write(0, 0, [1.5]), TypeError, "integers"),
    (lambda t: t.stage_write(0, 0, [2 ** 31]), ValueError, "fit"),
    (lambda t: t.stage_write(0, 0, "ab"), TypeError, "list"),
    (lambda t: t.stage_write(1.0, 0, [1]), TypeError, "index"),
    (lambda t: t.stage_write(0, 0, np.zeros((1, 1), dtype=np.int32)), TypeError, "1-D"),
])
def test_bad_writes_raise_and_stage_nothing(call, error, match):
    t = StagedWriteTensor((3, 4), torch.int32, DEV)
    t.stage_write(2, 0, [7])
    with pytest.raises(error, match=match):
        call(t)
    assert t.num_staged_writes == 1
    t.apply_write()
    assert host(t.gpu).tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [7, 0, 0, 0]]


def test_one_dimensional_write_past_the_end():
    t = StagedWriteTensor(4, torch.int32, DEV)
    with pytest.raises(ValueError, match="past the end"):
        t.stage_write(2, 1, [1, 2])                 # elements 3 and 4 of a 4-element tensor
    t.stage_write(2, 1, [5])
    t.apply_write()
    assert host(t.gpu).tolist() == [0, 0, 0, 5]


def test_at_most_num_rows_writes_between_applies():
    t = StagedWriteTensor((2, 8), torch.int32, DEV)
    t.stage_write(0, 0, [1])
    t.stage_write(0, 1, [2])
    with pytest.raises(ValueError, match="apply_write"):
        t.stage_write(1, 0, [3])
    t.apply_write()
    t.stage_write(1, 0, [3])                        # fine again after the apply
    t.apply_write()
    assert host(t.gpu)[:, :2].tolist() == [[1, 2], [3, 0]]


def test_uva_instead_of_gpu_writes_host_memory():
    t = StagedWriteTensor((2, 3), torch.int32, DEV, uva_instead_of_gpu=True)
    t.stage_write(1, 1, [4, 5])
    t.apply_write()
    if runtime.HAS_CUDA:
        torch.cuda.synchronize()
    assert t._uva_buf.np.tolist() == [[0, 0, 0], [0, 4, 5]]        # the pinned host copy itself


def test_random_writes_match_a_numpy_model():
    rng = np.random.default_rng(0)
    t = StagedWriteTensor((6, 40), torch.int64, DEV)
    model = np.zeros((6, 40), dtype=np.int64)
    for _ in range(3):
        for row in rng.permutation(6)[:4]:          # one write per row: no overlaps
            start = int(rng.integers(0, 40))
            values = rng.integers(-2 ** 40, 2 ** 40, size=int(rng.integers(0, 40 - start + 1))).tolist()
            t.stage_write(int(row), start, values)
            model[row, start:start + len(values)] = values
        t.apply_write()
        assert np.array_equal(host(t.gpu), model)
