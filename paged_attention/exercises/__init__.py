"""Checkers for the notebooks' exercises, one module per notebook.

Each checker takes a student's answer, prints whether it is right (with a hint when it is not)
and returns True or False, so a class can work through the exercises without a teacher at every
desk. The answers are computed from the library, never stored.
"""


def report(correct: bool, what: str, hint: str) -> bool:
    """Print a one-line verdict on an answer and return ``correct``."""
    print(f"correct: {what}" if correct else f"not yet: {hint}")
    return correct
