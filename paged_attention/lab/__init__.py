"""Classroom labs: implement-it exercises graded by the project's own checks.

``python -m paged_attention lab build OUT_DIR`` writes the student edition of the notebooks;
``python -m paged_attention lab grade SUBMISSION... [--csv FILE]`` grades notebooks or .py files,
one row per student and lab. In a notebook, ``check(lab_id)`` runs a lab's public checks on the
lab cell exactly as the grader will (same program, same contained process, same comparison).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from paged_attention.lab.labs import LABS, Check, Lab

__all__ = ["LABS", "Check", "Lab", "check"]


def _history() -> list[str] | None:
    """The cells this IPython kernel ran, oldest first (None outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None or getattr(ip, "history_manager", None) is None:
        return None
    return [src for src in ip.history_manager.input_hist_raw if src]


def _notebook_cells(lab: Lab) -> list[str] | None:
    """The saved notebook's code cells, to say where a missing name is defined (None if not found)."""
    from paged_attention.lab.submission import notebook_cells
    candidates = [os.environ.get("JPY_SESSION_NAME", "")]
    try:
        from IPython import get_ipython
        ip = get_ipython()
        candidates.insert(0, str((ip.user_ns if ip else {}).get("__session__", "")))
    except ImportError:
        pass
    candidates.append(str(Path.cwd() / f"{lab.notebook}.ipynb"))
    for name in candidates:
        if name and name.endswith(".ipynb") and Path(name).is_file():
            try:
                return notebook_cells(Path(name))
            except (OSError, ValueError):
                continue
    return None


def check(lab_id: str, fn: Callable[..., Any] | None = None, *, time_limit: float = 120.0) -> bool:
    """Run the public checks of ``lab_id`` as the grader runs them; print a line per check; True if
    all pass. In a notebook the graded code is the last run of the cell that starts with
    ``# LAB: <lab_id>`` plus the import statements (of the cells this kernel ran) that it uses; ``fn``
    is only used outside a notebook (a script), where there is no cell to read."""
    from paged_attention.lab.grade import grade_program
    from paged_attention.lab.submission import (MARKER, Program, lab_of, program_from_cells,
                                                where_defined)

    if lab_id not in LABS:
        raise KeyError(f"unknown lab {lab_id!r}; the labs are {', '.join(LABS)}")
    if fn is not None and not callable(fn):
        raise TypeError(f"give the function you wrote, got {type(fn).__name__}")
    lab = LABS[lab_id]
    history = _history()
    if history is not None:
        cells = [src for src in history if lab_of(src) == lab_id]
        if not cells:
            print(f"not yet: no cell starting with `{MARKER}{lab_id}` has run in this notebook. The grader "
                  f"reads only that cell: keep its first line, write `{lab.function}` in it and run it.")
            return False
        program = program_from_cells(lab_id, cells[-1], [src for src in history if lab_of(src) is None])
        saved = _notebook_cells(lab)

        def where(name):
            if saved is not None:
                return where_defined(saved, name)
            ran = where_defined(history, name)           # no saved notebook found: what this kernel ran
            return ran and ("a cell this kernel ran", ran[1])
    else:
        import inspect
        module = inspect.getmodule(fn) if fn is not None else None
        try:                        # a script that defines the function: the module is the program
            source = inspect.getsource(module) if getattr(module, lab.function, None) is fn else None
        except (OSError, TypeError):
            source = None
        if source is None:
            return _check_in_process(lab, fn)
        program, where = Program(lab_id, source, 0, (), "the file"), None
    verdict = grade_program(program, public_only=True, time_limit=time_limit, where_name=where)
    if verdict.reason:
        print(f"not yet: {verdict.reason}")
        return False
    for name, ok, message in verdict.results:
        print(f"passed: {name}" if ok else f"not yet: {message}")
    return all(ok for _, ok, _ in verdict.results)


def _check_in_process(lab: Lab, fn: Callable[..., Any]) -> bool:
    """A function without source (made by exec): its public checks, called here, compared alike."""
    import json

    from paged_attention.lab import runner
    from paged_attention.lab.labs import lab_cases
    if fn is None:
        raise TypeError("outside a notebook, give the function: check(lab_id, function)")
    from paged_attention import runtime
    device = runtime.DEVICE.type if lab.on_device else "cpu"
    ok_all = True
    for check_, cases in zip(lab.checks, lab_cases(lab.lab_id)):
        if not check_.public:
            continue
        message = ""
        for args, want in cases:
            answer = runner.call_case(fn, json.dumps(args), list(lab.arg_types), list(lab.returns_args),
                                      device, "<check>")
            if answer.get("stub"):
                message = f"{check_.name}: the function is still the stub (it raises NotImplementedError)"
            elif "raised" in answer:
                message = f"{check_.name}: raised {answer['raised']['type']}: {answer['raised']['message']}"
            elif "not_plain" in answer:
                message = f"{check_.name}: returned {answer['not_plain']}"
            else:
                out = json.loads(json.dumps(answer["out"]))
                detail = lab.compare(out, want, args)
                message = f"{check_.name}: {lab.describe(args)}: {detail}. {check_.hint}" if detail else ""
            if message:
                break
        print(f"passed: {check_.name}" if not message else f"not yet: {message}")
        ok_all = ok_all and not message
    return ok_all
