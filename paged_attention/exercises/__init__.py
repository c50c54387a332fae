"""Checkers for the notebooks' exercises, one module per notebook.

Each checker takes a student's answer, prints whether it is right (with a hint when it is not)
and returns True or False, so a class can work through the exercises without a teacher at every
desk. The answers are computed from the library, never stored. An answer of the wrong type (a
string or a float where an int is asked, None) raises TypeError in every checker: the readers
below are the one place that decides what a checker accepts.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Sequence

import numpy as np
import torch

from paged_attention.utils import check_int

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def report(correct: bool, what: str, hint: str) -> bool:
    """Print a one-line verdict on an answer and return ``correct``."""
    print(f"correct: {what}" if correct else f"not yet: {hint}")
    return correct


# ---- Reading answers --------------------------------------------------------------------------
# Every checker reads its answer through these, so that all of them treat a wrong-typed answer
# the same way: a TypeError naming the answer, never a silent "not yet" (a string or None that
# can never equal a number) nor a silent "correct" (32.0 == 32, or "32" read as an int).


def as_int(answer: object, name: str) -> int:
    """A student's int: a Python, numpy or 0-d integer torch value (``utils.check_int``, a tensor
    read first). TypeError for anything else (a bool, a float even if whole, a string, None)."""
    if isinstance(answer, torch.Tensor) and answer.ndim == 0 and answer.dtype in _INT_DTYPES:
        answer = answer.item()
    return check_int(name, answer)


def as_int_list(answer: Sequence[int], name: str) -> list[int]:
    """A student's list of ints (a list, tuple, range or 1-D array) as a plain list; TypeError
    for a string (it would compare as a list of characters) or any element ``as_int`` refuses."""
    return [as_int(x, f"{name}[{i}]") for i, x in enumerate(_items(answer, name, "ints"))]


def as_float_list(answer: Sequence[float], name: str) -> list[float]:
    """A student's list of real numbers (ints or floats) as a list of floats; TypeError for a
    string, a bool, None or anything else that is not a number."""
    values = []
    for i, x in enumerate(_items(answer, name, "numbers")):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.number)) \
                or isinstance(x, np.complexfloating):
            raise TypeError(f"{name}[{i}] must be a number, got {x!r}")
        values.append(float(x))
    return values


def as_choice(answer: object, name: str, choices: Sequence[str]) -> str:
    """A student's one-word answer, matched to ``choices`` ignoring case and surrounding
    spaces. TypeError if it is not a string or is none of them: like every answer a checker
    cannot read."""
    if not isinstance(answer, str):
        raise TypeError(f"{name} must be one of the strings {list(choices)}, got {answer!r}")
    for choice in choices:
        if answer.strip().lower() == choice.lower():
            return choice
    raise TypeError(f"{name} must be one of {list(choices)}, got {answer!r}")


def _items(answer: object, name: str, kind: str) -> list:
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Iterable) or \
            isinstance(answer, (dict, set, frozenset)):
        raise TypeError(f"{name} must be a list of {kind}, got {answer!r}")
    return list(answer)
