"""Launching a compiled Triton kernel again, for a few microseconds of host time.

``kernel[grid](**kwargs)`` does a lot of Python on every call before the GPU hears of it: it binds
every argument by name, works out each one's specialisation (a pointer's dtype and whether it is
16-byte aligned, an integer's width and whether it is 1 or a multiple of 16), hashes all of that
into a cache key, looks the compiled kernel up, and only then calls the C launcher. With thirty
arguments that is tens of microseconds, longer than a decode kernel on a small batch takes on the
GPU. A model calls the same kernel with the same constants thousands of times.

``Launcher`` keeps the constants bound once. Per call it takes only the arguments that change,
works out *their* specialisation (a few comparisons each), and hands the compiled kernel that
matches straight to the C launcher: the same call Triton makes at the end of its own path. The
first call with a new specialisation goes through Triton's path, which compiles if needed and
returns the compiled kernel kept for next time. So the launches are the ones Triton would make,
with the same compiled code; only the bookkeeping in between is cut.

That shortcut needs parts of Triton that are not its public API (the compiled kernel's ``run``,
``function`` and ``packed_metadata``, the order of the C launcher's arguments, the launch-hook
knobs). All of them are reached through one function, ``direct_launch_api``, which hands them
out only for the Triton releases they were checked on (``CHECKED_TRITON_VERSIONS``) and only when
they have the expected shape. Everywhere else (another Triton, Triton's interpreter on a CPU, a
launch hook set by a profiler that wants to see each launch) every call takes Triton's own path:
slower on the host, the same on the device.

This module sits beside ``utils`` and ``runtime``, below both the kernels and the v2 tables, which
launch through it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import triton

CHECKED_TRITON_VERSIONS = ("3.6", "3.9")
"""Triton releases (major.minor) whose internals the direct launch was checked against: the call
it makes is the one Triton's own ``JITFunction.run`` ends with (``tests/test_triton_launch.py``
reads it from Triton's source), and on a GPU it gives Triton's results (checked on 3.6 on an
NVIDIA H100/H200; 3.9 is what the CPU machines run, in the interpreter)."""


class DirectLaunchAPI(NamedTuple):
    """The pieces of Triton's internals a direct launch uses, gathered in one place."""
    current_device: Callable[[], int]
    current_stream: Callable[[int], Any]
    hooks_set: Callable[[], bool]
    is_jit: Callable[[Any], bool]
    constexpr_names: Callable[[Any], set]
    is_compiled: Callable[[Any], bool]
    launch: Callable[[Any, tuple, Any, list], None]


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@functools.lru_cache(maxsize=None)
def direct_launch_api(version: Optional[str] = None) -> Optional[DirectLaunchAPI]:
    """Triton's internals for a direct launch, or None where they are not known to work: a
    Triton release not in ``CHECKED_TRITON_VERSIONS`` (``version`` defaults to the installed
    one), no GPU, or internals of another shape. None means: launch through Triton's own path."""
    if _major_minor(version or triton.__version__) not in CHECKED_TRITON_VERSIONS:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        runtime_knobs = knobs.runtime
        driver = triton.runtime.driver.active
        # Launch hooks are kept as chains of callables, empty unless a tool added one.
        hook_names = ("launch_enter_hook", "launch_exit_hook")
        if not all(hasattr(getattr(runtime_knobs, name), "calls") for name in hook_names):
            return None
        current_device, current_stream = driver.get_current_device, driver.get_current_stream
    except (ImportError, AttributeError, RuntimeError):
        return None

    def hooks_set() -> bool:
        return any(getattr(runtime_knobs, name).calls for name in hook_names)

    def constexpr_names(kernel: Any) -> set:
        return {p.name for p in kernel.params if p.is_constexpr}

    def is_compiled(kernel: Any) -> bool:
        # What kernel[grid](...) returned: a compiled kernel, its binary loaded (reading .run
        # loads it and sets .function).
        if not isinstance(kernel, CompiledKernel) or not hasattr(kernel, "packed_metadata"):
            return False
        kernel.run
        return getattr(kernel, "function", None) is not None

    def launch(compiled: Any, grid: tuple, stream: Any, args: list) -> None:
        # The call Triton's own launch ends with: the C launcher, every argument in the kernel's
        # order (constants included), no launch metadata and no hooks (none is set).
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *args)

    return DirectLaunchAPI(current_device, current_stream, hooks_set, lambda kernel: isinstance(kernel, JITFunction),
                           constexpr_names, is_compiled, launch)


def _spec(value: Any) -> Any:
    """What Triton specialises a kernel on, for one argument value: a tensor's dtype and 16-byte
    alignment; an int's width and whether it is 1 or a multiple of 16 (at least as fine as
    Triton's own rule, so two values with the same ``_spec`` can share one compiled kernel)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() & 15 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value & 15 == 0, -2**31 <= value < 2**31, value < 2**63
    return type(value)                  # float: always fp32


# Compiled kernels by (fixed values' key, device, per-call values' specialisations).
_COMPILED: dict[tuple, Any] = {}


class Launcher:
    """Launches of one ``@triton.jit`` kernel with some arguments fixed.

    ``Launcher(kernel, names, num_warps=4, X=..., Y=...)``: ``names`` are the arguments given on
    every call, in that order; every other argument of the kernel is given here once, as a
    keyword, with the launch options (``num_warps``, ``num_stages``). Then
    ``launcher(grid, *values)`` launches ``kernel[grid](X=..., Y=..., **dict(zip(names, values)))``;
    ``launcher.pinned(grid, *values)`` does the same for a caller whose values always specialise
    as the first call's did.
    """

    def __init__(self, kernel: Any, names: Sequence[str], **fixed: Any) -> None:
        self.kernel = kernel
        self.names = tuple(names)
        self.fixed = fixed
        arg_names = list(getattr(kernel, "arg_names", ()))
        missing = [n for n in arg_names if n not in fixed and n not in self.names]
        unknown = [n for n in self.names if n not in arg_names]
        if arg_names and (missing or unknown):
            raise TypeError(f"{getattr(kernel, '__name__', kernel)}: arguments {missing} not given, "
                            f"{unknown} not the kernel's")
        # The launcher's argument list in the kernel's order, constants in place, and where each
        # per-call value goes. Launch options (num_warps, ...) are not arguments.
        self._template = [fixed.get(n) for n in arg_names]
        self._slots = [arg_names.index(n) for n in self.names] if arg_names else []
        # Compiled kernels only (the interpreter's stand-in is no JITFunction).
        api = direct_launch_api()
        self._api = api if api is not None and api.is_jit(kernel) else None
        if self._api is not None:
            # What the compiled code depends on among the fixed values: constexprs and launch
            # options exactly, other arguments by their specialisation. Launchers that agree on it
            # (two plans that differ in a stride, say) share their compiled kernels.
            constexprs = self._api.constexpr_names(kernel)
            self._fixed_key = (kernel, *sorted(
                (name, _spec(value) if name in arg_names and name not in constexprs else value)
                for name, value in fixed.items()))

    @property
    def direct(self) -> bool:
        """Whether calls after the first may skip Triton's own path (see the module docstring)."""
        return self._api is not None

    def __call__(self, grid: tuple[int, ...], *values: Any) -> None:
        """Launch on ``grid``; the per-call values' specialisation picks the compiled kernel."""
        api = self._api
        if api is not None:
            device = api.current_device()
            compiled = _COMPILED.get((self._fixed_key, device, *map(_spec, values)))
            if compiled is not None and not api.hooks_set():
                self._run(compiled, device, grid, values)
                return
        self._slow(grid, values)

    def pinned(self, grid: tuple[int, ...], *values: Any) -> None:
        """Launch on ``grid`` with the compiled kernel of the first call, for a caller that makes
        sure every call's values specialise as the first one's did (a plan that checks each
        tensor's dtype and alignment): no per-value work at all."""
        compiled = self._pinned
        if compiled is not None and not self._api.hooks_set():
            device = self._api.current_device()
            if device == self._pinned_device:
                self._run(compiled, device, grid, values)
                return
        self._slow(grid, values)

    _pinned = None

    def _run(self, compiled: Any, device: int, grid: tuple[int, ...], values: tuple) -> None:
        args = self._template.copy()
        for slot, value in zip(self._slots, values):
            args[slot] = value
        self._api.launch(compiled, grid, self._api.current_stream(device), args)

    def _slow(self, grid: tuple[int, ...], values: tuple) -> None:
        # Triton's own path: binds, compiles if needed, launches, and returns the compiled kernel.
        compiled = self.kernel[grid](**self.fixed, **dict(zip(self.names, values)))
        if self._api is not None and self._api.is_compiled(compiled):
            device = self._api.current_device()
            _COMPILED[(self._fixed_key, device, *map(_spec, values))] = compiled
            if self._pinned is None:
                self._pinned, self._pinned_device = compiled, device
