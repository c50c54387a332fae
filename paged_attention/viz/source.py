"""Show the library's own code in a notebook: a function, or a marked stretch of a file.

Notebooks that teach a kernel show its source from the package itself, never a pasted copy, so
the listing a reader sees is the code that just ran. ``source_excerpt`` takes a function (a
Triton ``@jit`` kernel too) or a file inside the package (a CUDA source, say), optionally cut
from the first line that contains ``start`` to the line before the one that contains ``until``.
"""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

_PACKAGE = Path(__file__).resolve().parent.parent      # .../paged_attention

__all__ = ["Listing", "source_excerpt"]


@dataclass(frozen=True)
class Listing:
    """Lines of one file: ``path`` relative to the package's parent, ``first`` the number of the
    first line. Its text form numbers every line, as an editor would."""

    path: str
    first: int
    lines: tuple[str, ...]

    @property
    def last(self) -> int:
        return self.first + len(self.lines) - 1

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def __str__(self) -> str:
        width = len(str(self.last))
        body = "\n".join(f"{self.first + i:>{width}} | {line}".rstrip() for i, line in enumerate(self.lines))
        return f"{self.path}, lines {self.first}-{self.last}\n{body}"

    __repr__ = __str__


def _file_and_lines(obj: Any) -> tuple[Path, list[str], int]:
    """The file that holds ``obj``, the lines to show and the number of the first one."""
    if isinstance(obj, (str, Path)):
        path = (_PACKAGE / obj).resolve()
        if _PACKAGE not in path.parents or not path.is_file():
            raise ValueError(f"{str(obj)!r} is not a file inside the paged_attention package")
        return path, path.read_text().splitlines(), 1
    fn = getattr(obj, "fn", obj)                       # a Triton JITFunction wraps the Python function
    if not (inspect.isfunction(fn) or inspect.isclass(fn) or inspect.ismethod(fn)):
        raise TypeError(f"expected a function, a class or a file path, got {type(obj).__name__}")
    lines, first = inspect.getsourcelines(fn)
    if first == 0:                                    # a whole module
        first = 1
    # A decorator line comes first in getsourcelines; keep it, it is part of the lesson.
    return Path(inspect.getsourcefile(fn)).resolve(), [line.rstrip("\n") for line in lines], first


def source_excerpt(obj: Any, start: Optional[str] = None, until: Optional[str] = None) -> Listing:
    """The source of ``obj`` (a function, class, Triton kernel, or a path relative to the package),
    from the first line containing ``start`` (default: the first line) up to, not including, the
    first later line containing ``until`` (default: to the end). Trailing blank lines are dropped
    and the common indentation removed. A marker that is not there raises ``ValueError``."""
    for name, marker in (("start", start), ("until", until)):
        if marker is not None and (not isinstance(marker, str) or not marker):
            raise TypeError(f"{name} must be a non-empty str or None, got {marker!r}")
    path, lines, first = _file_and_lines(obj)
    lo = 0
    if start is not None:
        lo = next((i for i, line in enumerate(lines) if start in line), -1)
        if lo < 0:
            raise ValueError(f"no line of {path.name} contains start={start!r}")
    hi = len(lines)
    if until is not None:
        hi = next((i for i in range(lo + 1, len(lines)) if until in lines[i]), -1)
        if hi < 0:
            raise ValueError(f"no line of {path.name} after line {first + lo} contains until={until!r}")
    chosen = lines[lo:hi]
    while chosen and not chosen[-1].strip():
        chosen.pop()
    chosen = textwrap.dedent("\n".join(chosen)).split("\n")
    try:
        shown = path.relative_to(_PACKAGE.parent).as_posix()
    except ValueError:                                 # an installed copy elsewhere
        shown = path.name
    return Listing(shown, first + lo, tuple(chosen))
