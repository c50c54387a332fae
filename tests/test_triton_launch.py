"""The Launcher (``paged_attention.triton_launch``): Triton's own launch on the first call, a
direct call of the compiled kernel after it, only on the Triton releases that was checked on, and
Triton's own path everywhere else.

Checked on: Triton 3.9 (the CPU machines: the call Triton's own launch ends with, read from its
source, and the fallback) and Triton 3.6 (the GPU machine: the tests marked ``cuda`` run the direct
launch and compare it with Triton's).
"""
import inspect
import re

import pytest
import torch
import triton

from paged_attention import triton_launch
from paged_attention.kernels.triton import cache
from paged_attention.triton_launch import CHECKED_TRITON_VERSIONS, Launcher, _spec, direct_launch_api

INSTALLED = ".".join(triton.__version__.split(".")[:2])


def test_spec_separates_what_triton_specialises_on():
    x = torch.zeros(8, dtype=torch.int32)
    assert _spec(x) != _spec(x[1:])                        # 16-byte aligned or not
    assert _spec(x) != _spec(x.float())                    # dtype
    assert len({_spec(1), _spec(2), _spec(16), _spec(2**40)}) == 4
    assert _spec(3) == _spec(5) and _spec(32) == _spec(48)


def test_launcher_needs_every_argument():
    with pytest.raises(TypeError):
        Launcher(cache._reshape_and_cache_flash_kernel, ("key_ptr",), value_ptr=None)


# ---- Which Triton: the version check ----------------------------------------------------------
def test_checked_versions_are_named():
    # 3.6: the GPU machine; 3.9: the CPU machines (the pins in requirements.txt).
    assert CHECKED_TRITON_VERSIONS == ("3.6", "3.9")


def test_the_installed_triton_was_checked():
    assert INSTALLED in CHECKED_TRITON_VERSIONS, (
        f"Triton {triton.__version__} is not one the direct launch was checked on {CHECKED_TRITON_VERSIONS}: "
        f"it falls back to Triton's own launch. Check the call below against this release (and run the "
        f"cuda tests of this file on a GPU), then add it to CHECKED_TRITON_VERSIONS")


def test_tritons_own_launch_ends_with_the_call_the_launcher_makes():
    # The direct launch repeats the last call of Triton's JITFunction.run: the C launcher with the
    # grid, the stream, the function, the packed metadata, the launch metadata, the two hooks and
    # every bound argument. Read here from the installed Triton's own source.
    source = re.sub(r"\s+", " ", inspect.getsource(triton.runtime.jit.JITFunction.run))
    call = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())")
    assert call in source, f"Triton {triton.__version__} launches differently: see its JITFunction.run"


@pytest.mark.parametrize("version", ["2.3.1", "3.4.0", "3.5.1", "3.7.0", "3.10.0", "4.0.0"])
def test_unchecked_versions_get_no_direct_launch(version):
    assert direct_launch_api(version) is None


def test_no_direct_launch_without_a_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert direct_launch_api(INSTALLED + ".0") is None


# ---- The Launcher on either path, with a stand-in kernel ------------------------------------------
class _Kernel:
    """Records ``kernel[grid](**kwargs)`` calls, as Triton's own path; returns a compiled stand-in."""
    arg_names = ["x_ptr", "n", "scale", "BLOCK"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.calls.append((grid, kwargs))
            return ("compiled", len(self.calls))
        return launch


class _API:
    """A stand-in for Triton's internals: every direct launch recorded."""

    def __init__(self, hooks=False):
        self.hooks = hooks
        self.launches = []
        self.current_device = lambda: 0
        self.current_stream = lambda device: "stream"
        self.hooks_set = lambda: self.hooks
        self.is_jit = lambda kernel: True
        self.constexpr_names = lambda kernel: {"BLOCK"}
        self.is_compiled = lambda compiled: True
        self.launch = lambda compiled, grid, stream, args: self.launches.append((compiled, grid, stream, args))


def test_without_the_internals_every_call_takes_tritons_path(monkeypatch):
    monkeypatch.setattr(triton_launch, "direct_launch_api", lambda: None)
    kernel = _Kernel()
    launch = Launcher(kernel, ("x_ptr", "n"), scale=0.5, BLOCK=64)
    assert not launch.direct
    for i in range(3):
        launch((2,), "x", 10 + i)
        launch.pinned((2,), "x", 10 + i)
    assert len(kernel.calls) == 6
    assert kernel.calls[-1] == ((2,), dict(x_ptr="x", n=12, scale=0.5, BLOCK=64))


def test_with_the_internals_later_calls_launch_directly(monkeypatch):
    api = _API()
    monkeypatch.setattr(triton_launch, "direct_launch_api", lambda: api)
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    kernel = _Kernel()
    launch = Launcher(kernel, ("x_ptr", "n"), scale=0.5, BLOCK=64)
    assert launch.direct
    launch((2,), "x", 10)                       # first: Triton's path, which compiles
    launch((3, 2), "x", 11)                     # same specialisation: direct, in the kernel's order
    assert len(kernel.calls) == 1
    assert api.launches == [(("compiled", 1), (3, 2), "stream", ["x", 11, 0.5, 64])]
    launch((2,), "x", 1)                        # n == 1 specialises differently: Triton's path again
    assert len(kernel.calls) == 2
    launch.pinned((4,), "y", 13)                # pinned: the first compiled kernel, no lookup
    assert api.launches[-1] == (("compiled", 1), (4,), "stream", ["y", 13, 0.5, 64])
    api.hooks = True                            # a profiler's launch hook: Triton's path, every call
    launch((2,), "x", 10)
    launch.pinned((2,), "x", 10)
    assert len(kernel.calls) == 4 and len(api.launches) == 2


# ---- On a GPU: the direct launch itself ---------------------------------------------------------
@pytest.mark.cuda
def test_launcher_fast_path_compiles_per_specialisation_and_replays():
    import triton.language as tl

    @triton.jit
    def _twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

    launch = Launcher(_twice, ("x_ptr", "y_ptr", "n"), BLOCK=64)
    assert launch.direct, f"Triton {triton.__version__}: no direct launch"
    x = torch.arange(64, dtype=torch.int32, device="cuda")
    for src, n in ((x, 33), (x, 40), (x[1:], 33), (x, 1), (x[3:], 16)):   # aligned, again, misaligned, n == 1, ...
        y = torch.zeros(64, dtype=torch.int32, device="cuda")
        launch((1,), src, y, n)
        assert torch.equal(y[:n], src[:n] * 2) and not y[n:].any(), (src.data_ptr() % 16, n)
    # (aligned, n odd), (misaligned, n odd), n == 1, (misaligned, n % 16 == 0)
    assert sum(key[0] == launch._fixed_key for key in triton_launch._COMPILED) == 4
    # Captured in a CUDA graph, the fast path replays.
    y = torch.zeros(64, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch((1,), x, y, 33)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y[:33], x[:33] * 2)


@pytest.mark.cuda
def test_direct_launches_are_direct_and_a_hook_sees_every_launch():
    import triton.language as tl
    from triton import knobs

    @triton.jit
    def _add(x_ptr, n, value, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + value, mask=i < n)

    launch = Launcher(_add, ("x_ptr", "value"), n=40, BLOCK=64)
    x = torch.zeros(64, dtype=torch.float32, device="cuda")
    calls = []
    original = _add.run
    _add.run = lambda *a, **k: calls.append(1) or original(*a, **k)      # Triton's own path, counted
    try:
        for _ in range(5):
            launch((1,), x, 1.0)
        assert len(calls) == 1                        # the first call only
        seen = []
        hook = seen.append
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            launch((1,), x, 1.0)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert len(calls) == 2 and len(seen) == 1     # with a hook: Triton's path, and the hook saw it
    finally:
        _add.run = original
    torch.cuda.synchronize()
    assert x[:40].tolist() == [6.0] * 40 and not x[40:].any()
