"""What the kernels' plans share: a plan (``DecodePlan``, ``CacheWritePlan``) checks a call once
and launches it many times, so it must refuse, before any launch, tensors unlike the ones it was
made for (``check_planned``, by ``tensor_signature``); an unchecked front-end call keeps the plans
it made in a small bounded cache (``cached_plan``). The launches themselves go through
``paged_attention.triton_launch.Launcher``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


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
