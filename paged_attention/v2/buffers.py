"""Host/device buffers of the v2 model runner (``vllm/v1/worker/gpu/buffer_utils.py``).

v1 copies a whole batch-ordered table from the host to the GPU every step. v2 avoids both the
copy and the host-side table, with two ideas:

* **Unified virtual addressing (UVA).** Pinned (page-locked) host memory has an address the GPU
  can use too: a kernel that loads from it reads host memory over PCIe/NVLink, with no copy
  launched. ``UvaBuffer`` is a pinned host tensor plus a *device-typed* tensor over the same
  bytes; ``UvaBufferPool`` rotates between a few of them so that the CPU can fill the next one
  while the GPU may still read the last (double buffering); ``UvaBackedTensor`` is a small host
  tensor (the truth, edited through numpy) whose current contents the GPU reads through the
  pool after ``copy_to_uva``; ``kernel_copy`` moves a UVA view's contents to device memory, or
  back, by a kernel rather than a copy engine.
* **Staged writes.** A big device tensor (a block table) changes in a few cells per step. The
  CPU records the changes (``stage_write(row, start, values)``), and ``apply_write`` scatters
  all of them with one kernel launch: one program per staged write.

Without CUDA (a laptop, CI) there is no pinned memory and no device: host memory stands in for
every device-visible buffer, and the Triton kernels run in the interpreter. The semantics are
the same: ``.gpu`` and ``.uva`` are separate buffers from ``.cpu``/``.np`` wherever they are on a
GPU, edits to ``.np`` are invisible to them until the next copy, and ``UvaBackedTensor.gpu`` is
re-bound to the next pool buffer on every ``copy_to_uva``.

Bad input (a negative or too-large row, a write past the end of a row, an unsupported dtype, a
non-CPU source) raises ``ValueError``/``IndexError``/``TypeError`` before anything is staged or
copied, so the buffers are unchanged after a failed call. vLLM asserts some of these (``index >=
0``); here they are real exceptions, so that a wrong argument never passes silently.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import triton
import triton.language as tl

from paged_attention import runtime
from paged_attention.utils import check_device, check_int_array, check_int_list, is_int

Size = Union[int, Sequence[int]]

# The dtypes a StagedWriteTensor can hold, as in vLLM: what its kernel copies.
STAGED_WRITE_DTYPES = (torch.int32, torch.int64, torch.float32)

_NUMPY_INT_RANGE = {
    torch.int32: (int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)),
    torch.int64: (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)),
}


class UnsupportedDtypeError(ValueError):
    """A dtype a buffer cannot hold (a ValueError, as vLLM's ``ValueError("Unsupported dtype
    ...")``)."""


def _shape_of(size: Size, name: str = "size") -> tuple[int, ...]:
    """``size`` as a shape tuple: an int is a 1-D shape, a sequence of ints any shape."""
    dims = (size,) if is_int(size) else size
    if isinstance(dims, (str, bytes)) or not isinstance(dims, (Sequence, torch.Size)):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {size!r}")
    for n in dims:
        if not is_int(n):
            raise TypeError(f"{name} must hold ints, got {n!r} in {size!r}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {size!r}")
    if len(dims) == 0:
        raise ValueError("a 0-dimensional buffer has no rows: give at least one dimension")
    return tuple(int(n) for n in dims)


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if dtype == torch.bfloat16:
        # numpy has no bfloat16, so a buffer of it could not have its .np view.
        raise UnsupportedDtypeError("Unsupported dtype torch.bfloat16: numpy has no bfloat16, so the "
                                    "buffer could not have a .np view")
    return dtype


def check_kernel_device(device: Any, what: str) -> torch.device:
    """The device a buffer that Triton kernels touch may live on, on this machine.

    Compiled Triton (a GPU machine) needs CUDA tensors; the interpreter (no GPU, or
    ``PAGED_ATTENTION_DEVICE=cpu``) needs CPU tensors, since the pointers it follows are host
    addresses. Anything else is refused here rather than failing inside a kernel.
    """
    device = check_device(f"{what}: device", device)
    if device.type == "cuda":
        if runtime.TRITON_INTERPRET:
            raise ValueError(f"{what}: Triton runs in its interpreter here (TRITON_INTERPRET=1), which "
                             f"needs CPU tensors; use paged_attention.DEVICE ({runtime.DEVICE})")
    elif device.type == "cpu":
        if not runtime.TRITON_INTERPRET:
            raise ValueError(f"{what}: Triton compiles its kernels for the GPU on this machine, so the "
                             f"buffers must be on cuda, not cpu; use paged_attention.DEVICE ({runtime.DEVICE}) "
                             f"or set PAGED_ATTENTION_DEVICE=cpu before importing paged_attention")
    else:
        raise ValueError(f"{what}: device must be cuda or cpu, got {device}")
    return device


# ---- Copies ------------------------------------------------------------------------------------
def async_copy_to_gpu(x: Union[torch.Tensor, np.ndarray], out: Optional[torch.Tensor] = None,
                      device: Optional[Union[torch.device, str]] = None) -> torch.Tensor:
    """Copy a host tensor (or numpy array) to the device without waiting, and return the copy.

    ``out`` receives it if given; otherwise ``device`` must be given and a new tensor of the same
    shape and dtype is made there. As in vLLM the source is not pinned here: pass pinned memory
    if the copy must really overlap with the host (from pageable memory CUDA waits for it).
    On a CPU-only machine the "device" is the host and this is a plain copy.
    """
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or a numpy array, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"x must be on the CPU (this copies host to device), got {x.device}")
    if out is None:
        if device is None:
            raise ValueError("give out= (where to copy) or device= (where to make the copy)")
        out = torch.empty_like(x, device=check_device("device", device))
    elif not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    elif tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    return out.copy_(x, non_blocking=True)


# ---- UVA -----------------------------------------------------------------------------------------
def uva_available() -> bool:
    """Whether real UVA buffers can be made: pinned memory needs a CUDA driver. Without one,
    host memory stands in (same semantics, no GPU)."""
    return torch.cuda.is_available() and not runtime.TRITON_INTERPRET


def _device_view_of_host(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same bytes as the pinned host tensor ``host``.

    Under UVA (every 64-bit CUDA platform) page-locked host memory is mapped into the GPU's
    address space at the same address, so a CUDA tensor whose storage points there makes GPU
    kernels read and write host memory directly. vLLM builds this view in C++
    (``get_cuda_view_from_cpu_tensor``); torch can do the same from Python: a CUDA storage around
    an existing address that it does not own (``host`` keeps the memory alive; the view is only
    valid as long as ``host`` is).
    """
    if not host.is_pinned():
        raise RuntimeError("UVA is not available: the host tensor is not pinned")
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        nbytes = host.untyped_storage().nbytes()
        storage = torch._C._construct_storage_from_data_pointer(host.data_ptr(), device, nbytes)
        view = torch.empty(0, dtype=host.dtype, device=device)
        return view.set_(storage, 0, host.shape, host.stride())
    except (AttributeError, RuntimeError) as e:   # an older/newer torch without this helper
        raise RuntimeError(f"UVA is not available: cannot make a device view of pinned memory ({e})") from e


class UvaBuffer:
    """Pinned host memory that the GPU reads and writes directly.

    ``UvaBuffer(size, dtype)``: ``.cpu`` is a zero host tensor, ``.np`` its numpy view, and
    ``.uva`` a device tensor over the *same* bytes: a write to ``.np`` is seen by the next kernel
    that reads ``.uva``, with no copy. On a GPU ``.cpu`` is pinned (vLLM raises
    ``RuntimeError("UVA is not available")`` when it cannot be; so does this class). On a
    CPU-only machine all three are the same host memory.
    """

    def __init__(self, size: Size, dtype: torch.dtype) -> None:
        shape = _shape_of(size)
        dtype = _check_dtype(dtype)
        if uva_available():
            self.cpu = torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=True)
            self.uva = _device_view_of_host(self.cpu)
        else:
            self.cpu = torch.zeros(shape, dtype=dtype, device="cpu")
            self.uva = self.cpu          # host memory stands in for the device-visible view
        self.np: np.ndarray = self.cpu.numpy()

    def __repr__(self) -> str:
        return f"UvaBuffer(shape={tuple(self.cpu.shape)}, dtype={self.cpu.dtype})"


@triton.jit
def _kernel_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    # Program p copies elements [p * BLOCK, (p + 1) * BLOCK) of two contiguous tensors.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


KERNEL_COPY_BLOCK = 1024
"""Elements one program of ``kernel_copy`` moves."""

_kernel_copy_launcher = None


def kernel_copy(dst: torch.Tensor, src: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """``dst.copy_(src)`` done by a kernel's programs, not by a copy engine; returns ``dst``.

    Meant for a few kilobytes between a UVA view (``UvaBuffer.uva``: pinned host memory) and
    device memory, in a stream of kernels. ``Tensor.copy_`` hands a host copy to one of the GPU's
    copy engines, and on a stream the engine and the SMs wait for each other at each hand-over;
    here the copy is a kernel like its neighbours, and the host memory is read or written over
    the bus by its loads and stores (the model runner's two copies a step this way: an H100's
    decode step of one request 0.491 against 0.498 ms of GPU time, alternating, four rounds;
    at 16 and 64 requests within the noise). Both tensors contiguous, of one dtype and size, on one
    device (a UVA view is a GPU tensor; on a CPU machine both are host tensors and the kernel runs
    in Triton's interpreter). ``check=False`` skips the checks, for a caller that made both
    tensors itself."""
    global _kernel_copy_launcher
    if check:
        for name, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (the kernel copies flat), got strides {list(t.stride())}")
        if dst.dtype != src.dtype:
            raise TypeError(f"dst and src must have one dtype, got {dst.dtype} and {src.dtype}")
        if dst.shape != src.shape:
            raise ValueError(f"dst and src must have one shape, got {tuple(dst.shape)} and {tuple(src.shape)}")
        if dst.device != src.device:
            raise ValueError(f"dst and src must be on one device, got {dst.device} and {src.device}")
        check_kernel_device(dst.device, "kernel_copy")
    n = src.numel()
    if n:
        if _kernel_copy_launcher is None:
            from paged_attention.triton_launch import Launcher
            _kernel_copy_launcher = Launcher(_kernel_copy_kernel, ("src_ptr", "dst_ptr", "n"), BLOCK=KERNEL_COPY_BLOCK,
                                             num_warps=4)
        _kernel_copy_launcher((triton.cdiv(n, KERNEL_COPY_BLOCK),), src, dst, n)
    return dst


class UvaBufferPool:
    """A few ``UvaBuffer``s used in turn, so the host never rewrites the buffer the GPU was last
    given.

    ``UvaBufferPool(size, dtype, max_concurrency=2)``. ``copy_to_uva(x)`` first moves the cursor
    to the next buffer (so the first call uses buffer 1), copies ``x`` (a tensor, numpy array or
    list) into its first ``len(x)`` rows on the host, and returns the device view of those rows.
    With two buffers the CPU can prepare step k+1 while the GPU reads step k; it must not get
    more than ``max_concurrency - 1`` steps ahead (vLLM's model runner synchronises every step).
    """

    def __init__(self, size: Size, dtype: torch.dtype, max_concurrency: int = 2) -> None:
        if not is_int(max_concurrency):
            raise TypeError(f"max_concurrency must be an int, got {max_concurrency!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.size = _shape_of(size)
        self.dtype = _check_dtype(dtype)
        self.max_concurrency = int(max_concurrency)
        self._uva_bufs = [UvaBuffer(self.size, dtype) for _ in range(self.max_concurrency)]
        self._curr = 0

    def copy_to_uva(self, x: Union[torch.Tensor, np.ndarray, Sequence]) -> torch.Tensor:
        """Copy ``x`` into the next buffer's first rows; return the device view of them.

        ``x`` is checked in full (rows, row shape, values that fit the dtype) before the cursor
        moves, so a refused call leaves the cursor and every buffer as they were."""
        src = self._check_source(x)
        n = src.shape[0]
        # The cursor moves before the copy: the buffer handed out last time is left alone.
        self._curr = (self._curr + 1) % self.max_concurrency
        buf = self._uva_bufs[self._curr]
        if n:
            buf.np[:n] = src
        return buf.uva[:n]

    # ---- Read-only views, for drawings and tests ------------------------------------------------
    @property
    def current_index(self) -> int:
        """The buffer the last ``copy_to_uva`` (or ``next_buffer``) used; the next uses the one after."""
        return self._curr

    def index_of(self, view: torch.Tensor) -> Optional[int]:
        """Which buffer ``view`` (a device view ``copy_to_uva`` returned) starts at, or None."""
        return next((k for k, b in enumerate(self._uva_bufs) if b.uva.data_ptr() == view.data_ptr()), None)

    def host_contents(self) -> tuple[np.ndarray, ...]:
        """A copy of every buffer's contents, buffer 0 first."""
        return tuple(b.np.copy() for b in self._uva_bufs)

    def next_buffer(self) -> UvaBuffer:
        """Move the cursor (as ``copy_to_uva`` does) and return that whole buffer, for a caller
        that fills it in place through ``.np`` (``FastBlockTables`` packs a step into one)."""
        self._curr = (self._curr + 1) % self.max_concurrency
        return self._uva_bufs[self._curr]

    def copy_to_gpu(self, x: Union[torch.Tensor, np.ndarray, Sequence],
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``copy_to_uva(x)``, then a device copy of it: a new tensor (``out=None``) or into ``out``."""
        if out is not None:
            # Checked before copy_to_uva moves the cursor: a refused call changes nothing.
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
            rows = self._check_source(x).shape[0]
            if tuple(out.shape) != (rows, *self.size[1:]):
                raise ValueError(f"out must have shape {(rows, *self.size[1:])} (x's rows), "
                                 f"got {tuple(out.shape)}")
        uva = self.copy_to_uva(x)
        if out is None:
            return uva.clone()
        return out.copy_(uva, non_blocking=True)

    def _check_source(self, x: Any) -> np.ndarray:
        """``x`` as a numpy array that fits the buffers: at most ``size[0]`` rows of the buffers'
        row shape, holding values of this pool's kind (integers for an integer pool, in its
        range; numbers for a float pool). TypeError/ValueError otherwise; nothing is written."""
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise ValueError(f"x must be on the CPU (it is copied into host memory), got {x.device}")
            if x.dtype == torch.bfloat16:
                raise TypeError("x must not be bfloat16: numpy, through which it is copied, has no bfloat16")
            src = x.detach().numpy()
        elif isinstance(x, np.ndarray):
            src = x
        elif isinstance(x, (Sequence, range)) and not isinstance(x, (str, bytes)):
            try:
                src = np.asarray(x)
            except ValueError:
                raise ValueError(f"x must be rectangular (every row the same length), got {x!r}") from None
        else:
            raise TypeError(f"x must be a tensor, numpy array or list, got {type(x).__name__}")
        if src.ndim == 0:
            raise ValueError("x must have at least one dimension (rows)")
        n = src.shape[0]
        if n > self.size[0]:
            raise ValueError(f"x has {n} rows but the pool's buffers have {self.size[0]}")
        rest = tuple(src.shape[1:]) if (n or isinstance(x, torch.Tensor)) else self.size[1:]
        if rest != self.size[1:]:
            raise ValueError(f"x's rows have shape {rest}, the buffers' rows {self.size[1:]}")
        if src.size:
            self._check_values(src)
        return src

    def _check_values(self, src: np.ndarray) -> None:
        """Refuse values the buffers' dtype cannot hold exactly: non-numbers, fractions for an
        integer dtype, integers outside its range (numpy would truncate or wrap them)."""
        target = self._uva_bufs[0].np.dtype
        kind = src.dtype.kind
        if target.kind == "b":
            ok = kind == "b"
        elif target.kind in "iu":
            ok = kind in "iu"
        else:
            ok = kind in "iuf" or (target.kind == "c" and kind == "c")
        if not ok:
            what = {"b": "bools", "i": "integers", "u": "integers"}.get(target.kind, "numbers")
            raise TypeError(f"x must hold {what} (the buffers are {self.dtype}), got {src.dtype} "
                            "values")
        if target.kind in "iu" and not np.can_cast(src.dtype, target, "safe"):
            info = np.iinfo(target)
            lo, hi = src.min(), src.max()
            if lo < info.min or hi > info.max:
                raise ValueError(f"x's values must fit {self.dtype} ({info.min} .. {info.max}), "
                                 f"got {lo} .. {hi}")


class UvaBackedTensor:
    """A host tensor that GPU kernels read, refreshed by ``copy_to_uva``.

    ``UvaBackedTensor(size, dtype, max_concurrency=2)``. The truth is ``.cpu`` (a plain host
    tensor) and its numpy view ``.np``, which Python edits freely. ``.gpu`` is what kernels get:
    the device view of a pool buffer holding the contents as of the last ``copy_to_uva``.

    * Edits to ``.np`` are invisible to ``.gpu`` until ``copy_to_uva``.
    * ``copy_to_uva(n=None)`` copies ``np[:n]`` (all rows by default) into the *next* pool buffer
      and **re-binds** ``.gpu`` to it (then ``.gpu`` has ``n`` rows). A kernel launched earlier
      keeps the tensor it was given, so it still reads the old contents: that is the point.
      Anyone who kept the old ``.gpu`` object keeps the old buffer, which the pool reuses
      ``max_concurrency`` copies later.

    On a CPU-only machine the pool's buffers are host memory: same behaviour, no GPU.
    """

    def __init__(self, size: Size, dtype: torch.dtype, max_concurrency: int = 2) -> None:
        shape = _shape_of(size)
        dtype = _check_dtype(dtype)
        self.dtype = dtype
        self.cpu = torch.zeros(shape, dtype=dtype, device="cpu")
        self.np: np.ndarray = self.cpu.numpy()
        self.pool = UvaBufferPool(shape, dtype, max_concurrency)
        self.gpu: torch.Tensor = self.pool.copy_to_uva(self.np)

    def copy_to_uva(self, n: Optional[int] = None) -> torch.Tensor:
        """Publish ``np[:n]`` (everything if ``n`` is None) to the next buffer; ``.gpu`` becomes
        its device view, which is also returned."""
        if n is None:
            src = self.np
        else:
            if not is_int(n):
                raise TypeError(f"n must be an int or None, got {n!r}")
            if not 0 <= n <= self.np.shape[0]:
                raise ValueError(f"n must be between 0 and {self.np.shape[0]} (the rows), got {n}")
            src = self.np[:int(n)]
        self.gpu = self.pool.copy_to_uva(src)
        return self.gpu

    def __repr__(self) -> str:
        return f"UvaBackedTensor(shape={tuple(self.cpu.shape)}, dtype={self.dtype})"


# ---- Staged writes -------------------------------------------------------------------------------
class StagedWriteTensor:
    """A device tensor changed by staged writes, all applied with one kernel launch.

    ``StagedWriteTensor(size, dtype, device, max_concurrency=2, uva_instead_of_gpu=False)``:

    * ``dtype`` must be int32, int64 or float32 (else ``UnsupportedDtypeError``, a ValueError);
    * ``.gpu`` is a zero tensor on ``device`` (or, with ``uva_instead_of_gpu``, the device view
      of a pinned host buffer); ``num_rows`` is ``size`` (an int) or ``size[0]``;
    * ``stage_write(index, start, x)`` records "row ``index``, from element ``start`` on,
      becomes ``x``" (an empty ``x`` records nothing); ``stage_write_elem(index, x)`` records
      one value at element 0 of row ``index`` (for a 1-D tensor: element ``index``);
    * ``apply_write()`` applies every recorded write, one Triton program each, then forgets
      them; ``clear_staged_writes()`` forgets them without applying.

    A "row" is ``gpu.stride(0)`` elements from ``index * stride(0)`` on: for a 2-D tensor a row
    as usual; for a 1-D tensor (stride 1) a write lands on elements ``index + start`` onwards.

    The writes are independent programs with **no order** among them: two staged writes to the
    same cell leave either value (on a GPU; the interpreter happens to run them in order). Don't
    stage overlapping writes between two ``apply_write`` calls. Cells not written keep their
    values. At most ``num_rows`` writes may be staged between applies (the index buffers have
    ``num_rows`` entries, as in vLLM); one more raises ValueError.

    Checks that vLLM leaves to assertions or to luck are real exceptions here, before anything is
    staged: a row outside ``0 .. num_rows-1`` (IndexError), a negative start or a write past the
    row's end (ValueError), values that are not numbers or do not fit an integer dtype
    (TypeError/ValueError).
    """

    def __init__(self, size: Size, dtype: torch.dtype, device: Union[torch.device, str],
                 max_concurrency: int = 2, uva_instead_of_gpu: bool = False) -> None:
        shape = _shape_of(size)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if dtype not in STAGED_WRITE_DTYPES:
            raise UnsupportedDtypeError(f"Unsupported dtype {dtype}: a StagedWriteTensor holds int32, "
                                        f"int64 or float32")
        self.device = check_kernel_device(device, "StagedWriteTensor")
        self.dtype = dtype
        self.num_rows = shape[0]
        self.max_concurrency = max_concurrency
        self._uva_buf: Optional[UvaBuffer] = None
        if uva_instead_of_gpu:
            self._uva_buf = UvaBuffer(shape, dtype)
            self.gpu = self._uva_buf.uva
        else:
            self.gpu = torch.zeros(shape, dtype=dtype, device=self.device)
        # How many elements one row write may cover, from element 0 of its row.
        self._row_numel = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        self._numel = int(np.prod(shape))

        # What has been staged since the last apply: the rows, the first element written in
        # each row, every write's values one after the other, and where each write's values end.
        self._staged_write_indices: list[int] = []
        self._staged_write_starts: list[int] = []
        self._staged_write_contents: list = []
        self._staged_write_cu_lens: list[int] = []
        # Ours: the element ranges staged per row, ``{row: [(start, end), ...]}``, so that a
        # caller can refuse overlapping writes (``overlaps_staged``). It lives with the staged
        # writes: whatever applies, pops or clears them clears it too.
        self._staged_ranges: dict[int, list[tuple[int, int]]] = {}

        # Where those lists go at apply time: host memory the kernel reads directly.
        self.write_indices = UvaBufferPool(self.num_rows, torch.int32, max_concurrency)
        self.write_starts = UvaBufferPool(self.num_rows, torch.int32, max_concurrency)
        self.write_cu_lens = UvaBufferPool(self.num_rows, torch.int32, max_concurrency)

    # ---- Staging -------------------------------------------------------------------------------
    def stage_write(self, index: int, start: int, x: Any) -> None:
        """Record: row ``index`` from element ``start`` on becomes ``x`` (a list, tuple, range or
        1-D numpy array of numbers). Nothing reaches ``.gpu`` before ``apply_write``."""
        values = self._check_write(index, start, x)
        if not values:
            return           # an empty write stages nothing (as in vLLM)
        self._stage(int(index), int(start), values)

    def stage_write_elem(self, index: int, x: Union[int, float]) -> None:
        """Record one value at element 0 of row ``index`` (element ``index`` of a 1-D tensor)."""
        self.stage_write(index, 0, [x])

    def _stage(self, index: int, start: int, values: list) -> None:
        """Record a write already checked (``BlockTables`` checks its writes itself)."""
        self._staged_write_indices.append(index)
        self._staged_write_starts.append(start)
        self._staged_write_contents.extend(values)
        self._staged_write_cu_lens.append(len(self._staged_write_contents))
        self._staged_ranges.setdefault(index, []).append((start, start + len(values)))

    def _stage_many(self, indices: list[int], starts: list[int], values: list, lens: np.ndarray) -> None:
        """``_stage`` for several writes, already checked and none empty: write ``k`` covers
        ``lens[k]`` values of ``values``, after those of the writes before it."""
        base = len(self._staged_write_contents)
        ends = (np.cumsum(lens) + base).tolist()
        self._staged_write_indices += indices
        self._staged_write_starts += starts
        self._staged_write_contents += values
        self._staged_write_cu_lens += ends
        ranges = self._staged_ranges
        for index, start, end, begin in zip(indices, starts, ends, [base] + ends):
            ranges.setdefault(index, []).append((start, start + end - begin))

    def staged_mark(self) -> tuple[int, int]:
        """Where the staged writes end now: ``rollback_staged(mark)`` forgets those staged after."""
        return len(self._staged_write_indices), len(self._staged_write_contents)

    def rollback_staged(self, mark: tuple[int, int]) -> None:
        """Forget the writes staged since ``staged_mark()`` returned ``mark`` (a batch of
        writes that failed part-way); those staged before stay, as they were."""
        num_writes, num_values = mark
        del self._staged_write_indices[num_writes:], self._staged_write_starts[num_writes:]
        del self._staged_write_cu_lens[num_writes:], self._staged_write_contents[num_values:]
        self._staged_ranges = {}
        begin = 0
        for index, start, end in zip(self._staged_write_indices, self._staged_write_starts,
                                     self._staged_write_cu_lens):
            self._staged_ranges.setdefault(index, []).append((start, start + end - begin))
            begin = end

    def overlaps_staged(self, index: int, start: int, end: int) -> Optional[tuple[int, int]]:
        """The first range ``(s, e)`` staged in row ``index`` since the last apply/clear that
        overlaps elements ``start .. end-1``, or None."""
        for s, e in self._staged_ranges.get(index, ()):
            if start < e and s < end:
                return s, e
        return None

    def staged_writes(self) -> list[tuple[int, int, tuple]]:
        """The writes staged since the last apply/clear, in order, as ``(index, start, values)``
        (copies: what the next ``apply_write`` hands to the kernel, one program each)."""
        writes, begin = [], 0
        for index, start, end in zip(self._staged_write_indices, self._staged_write_starts,
                                     self._staged_write_cu_lens):
            writes.append((index, start, tuple(self._staged_write_contents[begin:end])))
            begin = end
        return writes

    @property
    def num_staged_writes(self) -> int:
        """How many writes wait for ``apply_write``."""
        return len(self._staged_write_indices)

    def pop_staged_writes(self) -> tuple[list[int], list[int], list, list[int]]:
        """Take the staged writes out without applying them: ``(indices, starts, contents,
        cu_lens)``. ``FastBlockTables`` uses this to apply the writes of all its tables at once."""
        staged = (self._staged_write_indices, self._staged_write_starts, self._staged_write_contents,
                  self._staged_write_cu_lens)
        self.clear_staged_writes()
        return staged

    def clear_staged_writes(self) -> None:
        """Forget every staged write without applying it."""
        self._staged_write_indices = []
        self._staged_write_starts = []
        self._staged_write_contents = []
        self._staged_write_cu_lens = []
        self._staged_ranges = {}

    # ---- Applying ------------------------------------------------------------------------------
    def apply_write(self) -> None:
        """Apply every staged write with one kernel launch, then forget them."""
        prepared = self.prepare_write()
        if prepared is not None:
            self.launch_write(prepared)

    def prepare_write(self) -> Optional[tuple]:
        """The host half of ``apply_write``: copy the staged rows, starts and lengths into the
        UVA pools and the values into pinned memory, forget the staged writes, and return what
        ``launch_write`` needs (None if nothing was staged). Split out so that a benchmark can
        time the device half (``launch_write``, which may be repeated) on its own."""
        n = len(self._staged_write_indices)
        if n == 0:
            return None
        # The values themselves: any number of them, so an (asynchronous) copy to the device,
        # from pinned memory (vLLM's async_tensor_h2d); on a CPU-only machine a host tensor.
        # Made first: if it fails, no pool cursor has moved and the writes stay staged.
        if self.device.type == "cpu":
            contents_host = torch.tensor(self._staged_write_contents, dtype=self.dtype)
        else:
            contents_host = torch.tensor(self._staged_write_contents, dtype=self.dtype).pin_memory()
        # Rows, starts and cumulative lengths: host memory the kernel reads through UVA.
        indices = self.write_indices.copy_to_uva(self._staged_write_indices)
        starts = self.write_starts.copy_to_uva(self._staged_write_starts)
        cu_lens = self.write_cu_lens.copy_to_uva(self._staged_write_cu_lens)
        self.clear_staged_writes()
        return n, indices, starts, cu_lens, contents_host

    def launch_write(self, prepared: tuple) -> None:
        """The device half of ``apply_write``: the values' host-to-device copy, then the kernel
        (one program per write)."""
        n, indices, starts, cu_lens, contents_host = prepared
        contents = contents_host if self.device.type == "cpu" else contents_host.to(self.device, non_blocking=True)
        _apply_write_kernel[(n,)](
            self.gpu, self.gpu.stride(0), indices, starts, contents, cu_lens,
            BLOCK_SIZE=1024,
        )

    # ---- Checks --------------------------------------------------------------------------------
    def _check_write(self, index: Any, start: Any, x: Any) -> list:
        """Check one write and return its values as a list (nothing is recorded here)."""
        if not is_int(index):
            raise TypeError(f"index must be an int, got {index!r}")
        if not is_int(start):
            raise TypeError(f"start must be an int, got {start!r}")
        if not 0 <= index < self.num_rows:
            raise IndexError(f"index={index} is outside the rows 0..{self.num_rows - 1}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        values = self.as_values(x)
        if not values:
            return values
        end = start + len(values)
        if self.gpu.dim() == 1:
            if index + end > self._numel:
                raise ValueError(f"a write of {len(values)} values at element {index} + {start} runs past "
                                 f"the end of the {self._numel}-element tensor")
        elif end > self._row_numel:
            raise ValueError(f"a write of {len(values)} values from element {start} runs past the end of "
                             f"row {index} ({self._row_numel} elements)")
        if len(self._staged_write_indices) >= self.num_rows:
            raise ValueError(f"{self.num_rows} writes are staged already, as many as the index buffers "
                             f"hold (num_rows): call apply_write() first")
        return values

    def as_values(self, x: Any) -> list:
        """``x`` as a list of Python numbers of this tensor's kind, or TypeError/ValueError."""
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        if isinstance(x, np.ndarray):
            if x.ndim != 1:
                raise TypeError(f"x must be 1-D, got shape {x.shape}")
            if x.size and x.dtype.kind not in ("iu" if self.dtype != torch.float32 else "iuf"):
                raise TypeError(f"x must hold {'numbers' if self.dtype == torch.float32 else 'integers'}, "
                                f"got dtype {x.dtype}")
            values = x.tolist()
        elif isinstance(x, (list, tuple, range)):
            values = list(x)
            for v in values:
                if not is_int(v) and not (self.dtype == torch.float32 and isinstance(v, (float, np.floating))):
                    kind = "numbers" if self.dtype == torch.float32 else "integers"
                    raise TypeError(f"x must hold {kind}, got {v!r}")
        else:
            raise TypeError(f"x must be a list, tuple, range or 1-D array of values, got {type(x).__name__}")
        if values and self.dtype in _NUMPY_INT_RANGE:
            lo, hi = _NUMPY_INT_RANGE[self.dtype]
            if min(values) < lo or max(values) > hi:
                raise ValueError(f"values must fit {self.dtype} ({lo} .. {hi}), got {min(values)} .. {max(values)}")
            values = [int(v) for v in values]
        return values

    def __repr__(self) -> str:
        return (f"StagedWriteTensor(shape={tuple(self.gpu.shape)}, dtype={self.dtype}, "
                f"staged={self.num_staged_writes})")


# ---- The apply, as numpy computes it ------------------------------------------------------------
class StagedWrite(NamedTuple):
    """One staged write: row ``row`` from element ``start`` on becomes ``ids``."""
    row: int
    start: int
    ids: tuple


def check_staged_writes(writes: Any, shape: tuple[int, int]) -> list[StagedWrite]:
    """``writes`` (a list of ``(row, start, ids)``) checked against a table of ``shape``, as
    ``StagedWrite``s: TypeError for a malformed write, IndexError for a row outside the table,
    ValueError for ids past a row's end or overlapping writes (the kernel applies writes in no
    order, so overlapping ones would have no defined result)."""
    if isinstance(writes, (str, bytes)) or not isinstance(writes, (list, tuple)):
        raise TypeError(f"writes must be a list of (row, start, ids), got {writes!r}")
    rows, cols = shape
    out: list[StagedWrite] = []
    taken: dict[int, list[tuple[int, int]]] = {}
    for k, w in enumerate(writes):
        if not isinstance(w, (tuple, list)) or len(w) != 3:
            raise TypeError(f"writes[{k}] must be (row, start, ids), got {w!r}")
        row, start, ids = w
        if not is_int(row) or not is_int(start):
            raise TypeError(f"writes[{k}]: row and start must be ints, got {row!r}, {start!r}")
        ids = tuple(check_int_list(f"writes[{k}].ids", ids))
        if not 0 <= row < rows:
            raise IndexError(f"writes[{k}]: row {row} is outside the rows 0..{rows - 1}")
        if start < 0 or start + len(ids) > cols:
            raise ValueError(f"writes[{k}]: {len(ids)} ids from column {start} do not fit a row of {cols} columns")
        end = start + len(ids)
        for s, e in taken.get(row, ()):
            if ids and start < e and s < end:
                raise ValueError(f"writes[{k}] overlaps an earlier write to row {row} (columns {s}..{e - 1}): the "
                                 f"kernel runs writes in no order, so the result would be undefined")
        if ids:
            taken.setdefault(int(row), []).append((int(start), end))
        out.append(StagedWrite(int(row), int(start), ids))
    return out


def apply_writes(table: Any, writes: Any) -> np.ndarray:
    """What ``apply_write()`` makes of ``table`` (a 2-D array), computed with numpy: a copy with
    every write applied. Cells no write covers keep their values. Overlapping writes raise
    ValueError (the kernel applies them in no order, so their result is undefined)."""
    out = check_int_array("table", table, 2).copy()
    for row, start, ids in check_staged_writes(writes, out.shape):
        out[row, start:start + len(ids)] = ids
    return out


@triton.jit
def _apply_write_kernel(
    output_ptr,            # the tensor written: row r starts at output_ptr + r * output_stride
    output_stride,         # elements from one row to the next (stride(0))
    write_indices_ptr,     # [num_writes] int32: the row of each write
    write_starts_ptr,      # [num_writes] int32: the first element written in that row
    write_contents_ptr,    # [total values]: every write's values, one write after the other
    write_cu_lens_ptr,     # [num_writes] int32: where each write's values end in write_contents
    BLOCK_SIZE: tl.constexpr,
):
    # One program per staged write; programs run in no particular order.
    pid = tl.program_id(0)
    row = tl.load(write_indices_ptr + pid)
    start = tl.load(write_starts_ptr + pid)
    # Write pid's values are contents[cu_lens[pid-1] : cu_lens[pid]] (the first begins at 0).
    end = tl.load(write_cu_lens_ptr + pid)
    begin = tl.load(write_cu_lens_ptr + pid - 1, mask=pid > 0, other=0)
    length = end - begin
    # Element `start` of row `row` (64-bit: rows * stride can pass 2**31 in a large tensor).
    dst = output_ptr + row.to(tl.int64) * output_stride + start
    src = write_contents_ptr + begin
    # Copy in tiles of BLOCK_SIZE values; lanes past the write's end are masked off.
    for i in range(0, length, BLOCK_SIZE):
        offs = i + tl.arange(0, BLOCK_SIZE)
        mask = offs < length
        values = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, values, mask=mask)
