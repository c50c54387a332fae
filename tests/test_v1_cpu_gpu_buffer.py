"""CpuGpuBuffer (``vllm/v1/utils.py``): a host tensor (with a numpy view of the same memory) and a device
tensor that only meet when copied."""
import numpy as np
import pytest
import torch

from paged_attention import runtime
from paged_attention.v1.cpu_gpu_buffer import CpuGpuBuffer


def _buf(*size, dtype=torch.int32, **kw):
    kw.setdefault("pin_memory", False)
    return CpuGpuBuffer(*size, dtype=dtype, device=runtime.DEVICE, **kw)


def test_three_views_start_at_zero_with_the_same_shape_and_dtype():
    b = _buf(3, 5, dtype=torch.int64)
    assert b.cpu.device.type == "cpu" and b.gpu.device.type == runtime.DEVICE.type
    assert b.cpu.shape == b.gpu.shape == (3, 5) and b.np.shape == (3, 5)
    assert b.cpu.dtype == b.gpu.dtype == torch.int64 and b.np.dtype == np.int64
    assert not b.cpu.any() and not b.gpu.any() and not b.np.any()


def test_numpy_view_shares_memory_with_the_cpu_tensor_but_not_the_gpu_one():
    b = _buf(4, 2)
    b.np[1, 0] = 7                     # through numpy ...
    assert b.cpu[1, 0].item() == 7     # ... the torch tensor sees it
    b.cpu[2, 1] = 9                    # and the other way round
    assert b.np[2, 1] == 9
    assert np.shares_memory(b.np, b.cpu.numpy())
    assert not b.gpu.any()             # the device copy is untouched until a copy
    assert b.gpu.data_ptr() != b.cpu.data_ptr()


def test_copy_to_gpu_copies_only_the_first_n_rows_and_returns_that_slice():
    b = _buf(4, 3)
    b.np[:] = np.arange(12).reshape(4, 3)
    out = b.copy_to_gpu(2)
    assert out.shape == (2, 3)
    assert out.data_ptr() == b.gpu.data_ptr()           # a view of .gpu, not a new tensor
    assert b.gpu.cpu().tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 0], [0, 0, 0]]
    out = b.copy_to_gpu()
    assert out.shape == (4, 3) and torch.equal(b.gpu.cpu(), b.cpu)
    assert b.copy_to_gpu(0).shape == (0, 3)             # zero rows: nothing to do, no error


def test_copy_to_cpu_copies_back_only_the_first_n_rows():
    b = _buf(5)
    b.gpu.copy_(torch.arange(10, 15, dtype=torch.int32))
    out = b.copy_to_cpu(3)
    if runtime.HAS_CUDA:
        torch.cuda.synchronize()                        # non-blocking on a GPU
    assert out.shape == (3,) and b.np.tolist() == [10, 11, 12, 0, 0]
    b.copy_to_cpu()
    if runtime.HAS_CUDA:
        torch.cuda.synchronize()
    assert b.np.tolist() == [10, 11, 12, 13, 14]


def test_a_copy_is_a_snapshot_later_cpu_writes_do_not_reach_the_gpu():
    b = _buf(3)
    b.np[:] = [1, 2, 3]
    b.copy_to_gpu()
    b.np[:] = [4, 5, 6]
    assert b.gpu.cpu().tolist() == [1, 2, 3]


def test_bfloat16_needs_with_numpy_false():
    with pytest.raises(ValueError, match="with_numpy=False"):
        _buf(4, dtype=torch.bfloat16)
    b = _buf(4, dtype=torch.bfloat16, with_numpy=False)
    assert b.cpu.dtype == b.gpu.dtype == torch.bfloat16
    with pytest.raises(AttributeError):
        b.np                                            # noqa: B018  (absent, as in vLLM)


def test_pin_memory_is_honoured_with_cuda_and_turned_off_without():
    b = CpuGpuBuffer(8, dtype=torch.float32, device=runtime.DEVICE, pin_memory=True)
    assert b.pin_memory is torch.cuda.is_available()
    assert b.cpu.is_pinned() is torch.cuda.is_available()
    b.np[:] = 1.5
    b.copy_to_gpu()
    assert b.gpu.sum().item() == 12.0


def test_a_shape_may_be_given_as_one_tuple():
    assert _buf((2, 3)).cpu.shape == (2, 3)
    assert _buf(np.int64(4)).cpu.shape == (4,)


@pytest.mark.parametrize("call,error,match", [
    (lambda b: b.copy_to_gpu(5), ValueError, "between 0 and 4"),
    (lambda b: b.copy_to_gpu(-1), ValueError, "between 0 and 4"),
    (lambda b: b.copy_to_gpu(2.0), TypeError, "n must be an int"),
    (lambda b: b.copy_to_cpu(True), TypeError, "n must be an int"),
    (lambda b: b.copy_to_cpu(9), ValueError, "between 0 and 4"),
])
def test_bad_row_counts_are_refused_and_nothing_is_copied(call, error, match):
    b = _buf(4, 2)
    b.np[:] = 3
    b.gpu.fill_(5)
    with pytest.raises(error, match=match):
        call(b)
    assert (b.np == 3).all() and (b.gpu == 5).all()


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((2.5,), {}, TypeError, "sizes must be ints"),
    ((-1,), {}, ValueError, "sizes must be >= 0"),
    ((3,), {"dtype": "int32"}, TypeError, "torch.dtype"),
])
def test_bad_constructor_arguments(args, kwargs, error, match):
    kw = dict(dtype=torch.int32, device="cpu", pin_memory=False)
    kw.update(kwargs)
    with pytest.raises(error, match=match):
        CpuGpuBuffer(*args, **kw)


def test_zero_dimensional_buffer_copies_whole_only():
    b = CpuGpuBuffer(dtype=torch.int64, device="cpu", pin_memory=False)
    b.np[...] = 4
    assert b.copy_to_gpu().item() == 4
    with pytest.raises(ValueError, match="no rows"):
        b.copy_to_gpu(1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_asking_for_cuda_without_it_says_so():
    with pytest.raises(ValueError, match="no CUDA device"):
        CpuGpuBuffer(4, dtype=torch.int32, device="cuda", pin_memory=True)
