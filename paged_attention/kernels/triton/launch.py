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

Where that shortcut does not apply, every call takes Triton's own path: in Triton's interpreter
(a CPU), and while a launch hook is set (a profiler that wants to see each launch).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import triton

try:                                    # where Triton keeps its launch hooks (3.4 and later)
    from triton import knobs as _knobs
except ImportError:                     # pragma: no cover - older Triton
    _knobs = None


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


def tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """What a planned launch depends on in a tensor: its shape, strides, dtype, device and whether
    its data is 16-byte aligned (what Triton specialises on), not its contents. Two tensors with
    the same signature can take each other's place in a plan. (The device itself, not its
    index: a meta tensor's index is the CPU's.)"""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0)


def _describe(sig: tuple | None) -> str:
    if sig is None:
        return "None"
    shape, strides, dtype, device, aligned = sig
    return (f"shape {tuple(shape)}, strides {strides}, {dtype}, {device}, "
            f"{'' if aligned else 'not '}16-byte aligned")


def check_planned(plan: str, names: Sequence[str], tensors: tuple, planned: tuple,
                  optional: Sequence[str] = ()) -> None:
    """Refuse, before any launch, tensors unlike the ones a plan was made for: ``TypeError`` for
    something that is no tensor (``None`` allowed for the ``optional`` names), ``ValueError``
    naming the first tensor whose signature differs from ``planned``. The usual case, everything
    as planned, costs one tuple comparison."""
    try:
        if tuple(map(tensor_signature, tensors)) == planned:
            return
    except (AttributeError, RuntimeError):  # not a tensor, or one without strides or data: said below
        pass
    for name, t, sig in zip(names, tensors, planned):
        if t is None and name in optional:
            pass
        elif not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        elif t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if tensor_signature(t) != sig:
            raise ValueError(f"{name} does not match the plan: planned {_describe(sig)}, got "
                             f"{_describe(tensor_signature(t))}; make a new {plan} for it")


def cached_plan(plans: dict, limit: int, key: Callable[[], tuple], make: Callable[[], Any]) -> Any:
    """The plan kept in ``plans`` under ``key()``, else ``make()``'s, kept (at most ``limit``
    plans, the oldest dropped): an unchecked call is checked once per combination of what its
    checks depend on. Where the key cannot be made or hashed (an argument that is no tensor, an
    unhashable option), nothing is kept and ``make()``'s checks say what is wrong."""
    try:
        k = key()
        plan = plans.get(k)
    except (AttributeError, TypeError, RuntimeError):   # RuntimeError: a tensor without strides
        return make()
    if plan is None:
        plan = make()
        if len(plans) >= limit:
            del plans[next(iter(plans))]
        plans[k] = plan
    return plan


def _active(hook: Any) -> bool:
    # Triton 3.4+ keeps each hook as a chain of callables, empty unless a tool added one.
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    if _knobs is None:                  # pragma: no cover - older Triton
        return True                     # unknown: let Triton handle every launch
    runtime = _knobs.runtime
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


# Compiled kernels by (fixed values' key, device, per-call values' specialisations).
_COMPILED: dict[tuple, Any] = {}


class Launcher:
    """Launches of one ``@triton.jit`` kernel with some arguments fixed.

    ``Launcher(kernel, names, num_warps=4, X=..., Y=...)``: ``names`` are the arguments given on
    every call, in that order; every other argument of the kernel is given here once, as a
    keyword, with the launch options (``num_warps``, ``num_stages``). Then
    ``launcher(grid, *values)`` launches ``kernel[grid](X=..., Y=..., **dict(zip(names, values)))``.
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
        self._fast = isinstance(kernel, triton.runtime.jit.JITFunction) and torch.cuda.is_available()
        if self._fast:
            # What the compiled code depends on among the fixed values: constexprs and launch
            # options exactly, other arguments by their specialisation. Launchers that agree on it
            # (two plans that differ in a stride, say) share their compiled kernels.
            constexprs = {p.name for p in kernel.params if p.is_constexpr}
            self._fixed_key = (kernel, *sorted(
                (name, _spec(value) if name in arg_names and name not in constexprs else value)
                for name, value in fixed.items()))
            driver = triton.runtime.driver.active
            self._current_device = driver.get_current_device
            self._current_stream = driver.get_current_stream

    def __call__(self, grid: tuple[int, ...], *values: Any) -> None:
        """Launch on ``grid``; the per-call values' specialisation picks the compiled kernel."""
        if self._fast:
            device = self._current_device()
            compiled = _COMPILED.get((self._fixed_key, device, *map(_spec, values)))
            if compiled is not None and not _hooks_set():
                self._run(compiled, device, grid, values)
                return
        self._slow(grid, values)

    def pinned(self, grid: tuple[int, ...], *values: Any) -> None:
        """Launch on ``grid`` with the compiled kernel of the first call, for a caller that makes
        sure every call's values specialise as the first one's did (a plan that checks each
        tensor's dtype and alignment): no per-value work at all."""
        compiled = self._pinned
        if compiled is not None and not _hooks_set():
            device = self._current_device()
            if device == self._pinned_device:
                self._run(compiled, device, grid, values)
                return
        self._slow(grid, values)

    _pinned = None

    def _run(self, compiled: Any, device: int, grid: tuple[int, ...], values: tuple) -> None:
        # The call Triton's own launch ends with: the C launcher, all arguments in order.
        args = self._template.copy()
        for slot, value in zip(self._slots, values):
            args[slot] = value
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     self._current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args)

    def _slow(self, grid: tuple[int, ...], values: tuple) -> None:
        # Triton's own path: binds, compiles if needed, launches, and returns the compiled kernel.
        compiled = self.kernel[grid](**self.fixed, **dict(zip(self.names, values)))
        if self._fast and hasattr(compiled, "packed_metadata"):
            compiled.run                # loads the binary, so .function is set
            device = self._current_device()
            _COMPILED[(self._fixed_key, device, *map(_spec, values))] = compiled
            if self._pinned is None:
                self._pinned, self._pinned_device = compiled, device
