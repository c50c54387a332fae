"""Classroom labs: implement-it exercises graded by the project's own checks.

``python -m paged_attention lab build OUT_DIR`` writes the student edition of the notebooks;
``python -m paged_attention lab grade SUBMISSION... [--csv FILE]`` grades notebooks or .py files,
one row per student and lab. In a notebook, ``check(lab_id, function)`` runs a lab's public checks.
"""
from __future__ import annotations

from typing import Any, Callable

from paged_attention.lab.labs import LABS, Check, Lab, LabCheckFailed

__all__ = ["LABS", "Check", "Lab", "LabCheckFailed", "check"]


def check(lab_id: str, fn: Callable[..., Any]) -> bool:
    """Run the public checks of ``lab_id`` on ``fn``; print a line per check; True if all pass."""
    if lab_id not in LABS:
        raise KeyError(f"unknown lab {lab_id!r}; the labs are {', '.join(LABS)}")
    if not callable(fn):
        raise TypeError(f"give the function you wrote, got {type(fn).__name__}")
    ok = True
    for c in LABS[lab_id].checks:
        if not c.public:
            continue
        try:
            c.run(fn)
            print(f"passed: {c.name}")
        except NotImplementedError:
            print(f"not yet: {c.name}: the function is still the stub")
            ok = False
        except Exception as e:
            print(f"not yet: {c.failure(e)}")
            ok = False
    return ok
