"""Checkers for the notebooks' exercises, one module per notebook.

Each checker takes a student's answer, prints whether it is right (with a hint when it is not)
and returns True or False, so a class can work through the exercises without a teacher at every
desk. The answers are computed from the library, never stored.
"""
from __future__ import annotations

from typing import Sequence


def report(correct: bool, what: str, hint: str) -> bool:
    """Print a one-line verdict on an answer and return ``correct``."""
    print(f"correct: {what}" if correct else f"not yet: {hint}")
    return correct


def as_int_list(answer: Sequence[int], name: str) -> list[int]:
    """A student's list of ints as a plain list; a clear TypeError for anything else (a string
    would otherwise compare as a list of characters)."""
    if isinstance(answer, (str, bytes)):
        raise TypeError(f"{name} must be a list of ints, got the string {answer!r}")
    try:
        return [int(x) for x in answer]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a list of ints, got {answer!r}") from None


def as_int(answer: int, name: str) -> int:
    """A student's int (a numpy or torch integer is fine; a bool or a float is not)."""
    if isinstance(answer, bool) or not hasattr(answer, "__index__"):
        raise TypeError(f"{name} must be an int, got {answer!r}")
    return int(answer)
