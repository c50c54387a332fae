"""What is graded: the program a lab's cell becomes, read the same way in the notebook and by the grader.

The rule (the student edition states it above every lab): a lab is graded by running **the cell
that starts with ``# LAB: <id>``**, after **those import statements of the notebook's other code
cells that bind a name the cell uses** (``import ...`` / ``from ... import ...`` at the top level
of a cell), and nothing else of the notebook. Helpers, constants and kernels belong in the lab cell.
The program runs without the ``paged_attention`` library: a lab whose code imports or uses it
scores 0 ("uses the library's implementation").

``lab grade`` applies the rule to the saved notebook; the in-notebook ``check`` applies it to the
cells the kernel ran (IPython's history). A ``.py`` submission is one program, the whole file.
"""
from __future__ import annotations

import ast
import json
import re
import symtable
from dataclasses import dataclass
from pathlib import Path

MARKER = "# LAB: "
LIBRARY = "paged_attention"
_MAGIC = re.compile(r"^\s*[%!]")


@dataclass(frozen=True)
class Program:
    """One lab's code as the grader runs it: the selected imports, then the lab cell."""
    lab_id: str
    source: str
    header_lines: int           # lines before the lab cell's first line
    imports: tuple[str, ...]    # the import statements taken from other cells
    where: str = "the lab cell"  # what a line number counts in, for messages

    def cell_line(self, line: int | None) -> int | None:
        """A line of ``source`` as a line of the lab cell (None if it is in the imports)."""
        return line - self.header_lines if line is not None and line > self.header_lines else None


def without_magics(source: str) -> str:
    """A cell with its IPython magics and shell lines (``%time``, ``!pip``) blanked: the grader runs
    plain Python."""
    return "\n".join("" if _MAGIC.match(line) else line for line in source.splitlines())


def lab_of(source: str) -> str | None:
    """The lab id of a cell that starts with the lab marker, else None."""
    first = source.lstrip().split("\n", 1)[0].strip()
    if first.startswith(MARKER.strip()):
        return first[len(MARKER.strip()):].strip() or None
    return None


def free_names(source: str) -> set[str]:
    """Names the code reads from outside itself: used at the top level or as a global in any
    function or class, and never bound at the top level."""
    try:
        top = symtable.symtable(source, "<lab>", "exec")
    except SyntaxError:
        return set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    names = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    stack = list(top.get_children())
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        names |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
    return names - bound


def _import_statements(source: str) -> list[tuple[ast.stmt, list[ast.alias]]]:
    try:
        tree = ast.parse(without_magics(source))
    except SyntaxError:
        return []
    return [(node, node.names) for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__")]


def _bound_name(node: ast.stmt, alias: ast.alias) -> str:
    if alias.asname:
        return alias.asname
    return alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name


def imports_binding(cells: list[str], names: set[str]) -> list[str]:
    """The import statements of ``cells`` (in order) that bind one of ``names``, each cut down to
    the names needed (``from x import a, b`` -> ``from x import a``). Star imports are skipped."""
    out = []
    for cell in cells:
        for node, aliases in _import_statements(cell):
            keep = [a for a in aliases if a.name != "*" and _bound_name(node, a) in names]
            if keep:
                cut = ast.Import(names=keep) if isinstance(node, ast.Import) else \
                    ast.ImportFrom(module=node.module, names=keep, level=node.level)
                out.append(ast.unparse(cut))
    return out


def program_from_cells(lab_id: str, lab_cell: str, other_cells: list[str]) -> Program:
    """The rule above, on a lab cell and the notebook's other code cells."""
    cell = without_magics(lab_cell)
    imports = imports_binding(other_cells, free_names(cell))
    header = "".join(line + "\n" for line in imports)
    return Program(lab_id, header + cell + "\n", len(imports), tuple(imports))


def notebook_cells(path: Path) -> list[str]:
    """The sources of a notebook's code cells, read as plain JSON (nothing of it runs)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError("not a notebook (no list of cells)")
    out = []
    for cell in nb["cells"]:
        if isinstance(cell, dict) and cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append("".join(src) if isinstance(src, list) else str(src))
    return out


def notebook_programs(cells: list[str]) -> dict[str, Program]:
    """Every lab of a notebook: lab id -> its program. Two cells with the same marker are run in
    order, as one cell."""
    labs: dict[str, list[str]] = {}
    others = []
    for src in cells:
        lab = lab_of(src)
        if lab is None:
            others.append(src)
        else:
            labs.setdefault(lab, []).append(src)
    return {lab: program_from_cells(lab, "\n\n".join(srcs), others) for lab, srcs in labs.items()}


def py_labs(source: str, functions: dict[str, str]) -> list[str]:
    """The labs a .py submission holds: a ``# LAB: <id>`` line, or a top-level definition of the
    lab's function (``functions``: lab id -> function name)."""
    found = {lab_of(line.lstrip()) for line in source.splitlines()}
    defined = set(re.findall(r"^(?:async\s+)?def\s+(\w+)", source, re.MULTILINE))
    return [lab for lab, fn in functions.items() if lab in found or fn in defined]


def read_submission(path: Path, functions: dict[str, str]) -> dict[str, Program]:
    """Lab id -> program for the labs ``path`` (a .ipynb or .py file) holds."""
    if path.suffix == ".ipynb":
        return notebook_programs(notebook_cells(path))
    if path.suffix == ".py":
        text = path.read_text(encoding="utf-8")
        return {lab: Program(lab, text, 0, (), "the file") for lab in py_labs(text, functions)}
    raise ValueError(f"a submission is a .ipynb or a .py file, got {path.name}")


def library_use(source: str) -> str | None:
    """What of the ``paged_attention`` library the code uses (an import, or its name in a string
    handed to an import function), or None. A static check: the graded program may not use the
    library it re-implements."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None                  # reported as "does not run"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == LIBRARY or a.name.startswith(LIBRARY + "."):
                    return f"import {a.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module == LIBRARY or node.module.startswith(LIBRARY + ".")):
            return f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and LIBRARY in node.value:
            return f"the string {node.value[:60]!r}"
        elif isinstance(node, (ast.Name, ast.Attribute)) and (
                getattr(node, "id", None) == LIBRARY or getattr(node, "attr", None) == LIBRARY):
            return LIBRARY
    return None


def top_level_modules(source: str) -> set[str]:
    """The top-level packages the code imports anywhere (``numpy`` for ``import numpy.linalg``)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def where_defined(cells: list[str], name: str) -> tuple[str, bool] | None:
    """Which code cell of a notebook binds ``name`` at its top level, as a phrase for a student
    ('code cell 3 (`import numpy as np`)'), and whether it is an import statement (which the grader
    carries over) rather than a definition (which it does not)."""
    for k, src in enumerate(cells, start=1):
        if lab_of(src):
            continue
        text = without_magics(src)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in tree.body:
            bound, is_import = set(), isinstance(node, (ast.Import, ast.ImportFrom))
            if is_import:
                bound = {_bound_name(node, a) for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound = {node.name}
            elif isinstance(node, ast.Assign):
                bound = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if name in bound:
                first = (ast.get_source_segment(text, node) or "").splitlines()[0][:70]
                return f"code cell {k} (`{first}`)", is_import
    return None
