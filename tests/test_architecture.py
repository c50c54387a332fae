"""The package's layers, checked on the source: every module's imports, parsed (``ast``), must flow
one way, and no two modules may import each other, directly or round a longer circle.

Layers, lowest first; a module may import its own component and anything in a lower layer:

0. ``utils``, ``runtime``, ``triton_launch`` (and the package's ``__init__``);
1. the structures and kernels: ``legacy``, ``v1`` (``v1/core`` included), ``v2``, ``kv_cache``,
   ``kernels``, ``memory_sim``. Each stands alone: none imports another (no vLLM version imports
   another, and the tables know nothing of the kernels), except that any may read the KV-cache
   specs (``kv_cache.interface``: plain data, as vLLM's own v1 core does);
2. ``model``, ``distributed``; the model imports nothing of ``legacy``, ``v1`` or ``v2`` (it knows
   nothing of schedulers, managers or tables);
3. ``engine``;
4. ``bench``, ``verify``, ``check``;
5. ``viz`` (nothing below it draws);
6. ``exercises``, ``lab``;
7. ``__main__`` (the command line).

Every import counts, also one inside a function, or a module named in a string
(``importlib.import_module("paged_attention.kernels.cuda")``). A module in no layer is an error
too: a new package must be placed.
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "paged_attention"

LAYERS: dict[str, int] = {
    "": 0, "utils": 0, "runtime": 0, "triton_launch": 0,
    "legacy": 1, "v1": 1, "v2": 1, "kv_cache": 1, "kernels": 1, "memory_sim": 1,
    "model": 2, "distributed": 2,
    "engine": 3,
    "bench": 4, "verify": 4, "check": 4,
    "viz": 5,
    "exercises": 6, "lab": 6,
    "__main__": 7,
}
LAYER_NAMES = ["utils/runtime", "structures and kernels", "model", "engine", "bench, verify, check", "viz",
               "exercises, lab", "command line"]
# Components of layer 1 import none of each other, except these modules (plain data).
SHARED_IN_LAYER_1 = {"paged_attention.kv_cache.interface"}
# What a component must not import although its layer would allow it.
FORBIDDEN: dict[str, set[str]] = {"model": {"legacy", "v1", "v2"}}


@dataclass(frozen=True)
class Import:
    """Module ``importer`` imports module ``imported`` at ``line``."""
    importer: str
    imported: str
    line: int


def component(module: str) -> str:
    """``paged_attention.v2.block_table`` -> ``v2``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _resolve(name: str, modules: Iterable[str]) -> Optional[str]:
    """The module that ``name`` lands in: itself, else the longest package prefix that exists."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False) -> list[Import]:
    """The package modules ``module`` imports (each once, at its first line), from its source."""
    tree = ast.parse(source)
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        target = _resolve(name, modules)
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                full = f"{origin}.{alias.name}"
                add(full if full in modules else origin, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            add(node.value, node.lineno)          # a module named in a string: a dynamic import
    return [Import(module, target, line) for target, line in sorted(found.items())]


def module_graph(sources: Mapping[str, tuple[str, bool]]) -> list[Import]:
    """Every import among ``sources``: ``{module name: (source, is_package)}``."""
    modules = frozenset(sources)
    return [imp for name, (source, is_package) in sorted(sources.items())
            for imp in _imports_cached(name, source, modules, is_package)]


@functools.lru_cache(maxsize=None)
def _imports_cached(module: str, source: str, modules: frozenset, is_package: bool) -> tuple[Import, ...]:
    return tuple(imports_of(module, source, modules, is_package))


def layer_violations(edges: Iterable[Import]) -> list[str]:
    """Each import that breaks a rule of the module docstring, said in a sentence."""
    problems = []
    unplaced = set()
    for imp in edges:
        src, dst = component(imp.importer), component(imp.imported)
        for c, module in ((src, imp.importer), (dst, imp.imported)):
            if c not in LAYERS and c not in unplaced:
                unplaced.add(c)
                problems.append(f"{module} is in no layer: place {c!r} in LAYERS (tests/test_architecture.py)")
        if src not in LAYERS or dst not in LAYERS or src == dst:
            continue
        where = f"{imp.importer} (line {imp.line}) imports {imp.imported}"
        ls, ld = LAYERS[src], LAYERS[dst]
        if ld > ls:
            problems.append(f"{where}: {src or PACKAGE} ({LAYER_NAMES[ls]}) is below {dst} ({LAYER_NAMES[ld]}); "
                            f"imports flow one way, upwards")
        elif ls == ld == 1 and imp.imported not in SHARED_IN_LAYER_1:
            problems.append(f"{where}: {src} and {dst} each stand alone (no vLLM version imports another; the "
                            f"tables and the kernels know nothing of each other)")
        elif dst in FORBIDDEN.get(src, ()):
            problems.append(f"{where}: {src} imports nothing of {', '.join(sorted(FORBIDDEN[src]))}")
    return problems


def find_cycle(edges: Iterable[Import]) -> Optional[list[str]]:
    """A circle of imports ``[a, b, ..., a]`` if there is one, else None."""
    graph: dict[str, list[str]] = {}
    for imp in edges:
        graph.setdefault(imp.importer, []).append(imp.imported)
    state: dict[str, int] = {}              # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """``{module name: (source, is_package)}`` for every ``.py`` file of the package."""
    sources = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        sources[name] = (path.read_text(encoding="utf-8"), is_package)
    return sources


# ---- The package as it is ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources():
    return package_sources()


def test_every_module_is_parsed(sources):
    # The walk finds the package's modules, its sub-packages included (a checker that saw nothing
    # would pass anything).
    assert {"paged_attention", "paged_attention.utils", "paged_attention.v2.block_table",
            "paged_attention.kernels.triton.decode", "paged_attention.engine.llm"} <= set(sources)
    edges = module_graph(sources)
    pairs = {(e.importer, e.imported) for e in edges}
    assert ("paged_attention.v2.block_table_fast", "paged_attention.v2.block_table") in pairs
    assert ("paged_attention.kernels.triton.prefill", "paged_attention.kernels.args") in pairs
    assert len(edges) > 200


def test_imports_flow_one_way(sources):
    problems = layer_violations(module_graph(sources))
    assert not problems, "\n".join(problems)


def test_no_import_circle(sources):
    cycle = find_cycle(module_graph(sources))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# ---- The checker, shown failing on planted imports ------------------------------------------------
def _planted(sources, module: str, line: str) -> dict[str, tuple[str, bool]]:
    planted = dict(sources)
    source, is_package = planted[module]
    planted[module] = (source + "\n" + line + "\n", is_package)
    return planted


@pytest.mark.parametrize("module, line, says", [
    ("paged_attention.v2.block_table", "import paged_attention.viz", "imports flow one way"),
    ("paged_attention.v2.block_table", "from paged_attention.v1.block_table import BlockTable", "stand alone"),
    ("paged_attention.v2.block_table_fast", "from paged_attention.kernels.triton.decode import DecodePlan",
     "stand alone"),
    ("paged_attention.legacy.block_table", "from paged_attention import v2", "stand alone"),
    ("paged_attention.model.llama", "from paged_attention.engine import LLM", "imports flow one way"),
    ("paged_attention.model.attention", "from paged_attention.v2.block_table import BlockTables",
     "model imports nothing of legacy, v1, v2"),
    ("paged_attention.kernels.reference", "from ..bench import timing", "imports flow one way"),
    ("paged_attention.engine.llm", "def f():\n    from paged_attention.bench import timing", "imports flow one way"),
    ("paged_attention.utils", "import importlib\nimportlib.import_module('paged_attention.kernels.triton')",
     "imports flow one way"),
    ("paged_attention.verify", "from paged_attention.viz import style", "imports flow one way"),
])
def test_a_planted_forbidden_import_fails(sources, module, line, says):
    problems = layer_violations(module_graph(_planted(sources, module, line)))
    assert len(problems) == 1 and says in problems[0] and module in problems[0], problems


def test_an_unplaced_package_fails(sources):
    planted = dict(sources)
    planted["paged_attention.newpart"] = ("from paged_attention.utils import cdiv\n", False)
    problems = layer_violations(module_graph(planted))
    assert len(problems) == 1 and "'newpart'" in problems[0]


def test_a_planted_circle_is_found(sources):
    # Two modules of one component (legal layer-wise) that import each other.
    planted = _planted(sources, "paged_attention.v2.buffers", "from paged_attention.v2.block_table import BlockTables")
    assert not layer_violations(module_graph(planted))
    cycle = find_cycle(module_graph(planted))
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"paged_attention.v2.buffers", "paged_attention.v2.block_table"} <= set(cycle)


def test_checker_on_a_synthetic_package():
    # The checker alone, on a made-up package: relative imports, a package's __init__, a lazy
    # import and a three-module circle.
    sources = {
        "paged_attention": ("from paged_attention.utils import x\n", True),
        "paged_attention.utils": ("", False),
        "paged_attention.v1": ("from .table import T\n", True),
        "paged_attention.v1.table": ("from ..utils import x\nfrom . import helpers\n", False),
        "paged_attention.v1.helpers": ("def f():\n    import paged_attention.v1.late\n", False),
        "paged_attention.v1.late": ("from paged_attention.v1.table import T\n", False),
    }
    edges = {(e.importer, e.imported) for e in module_graph(sources)}
    assert edges == {("paged_attention", "paged_attention.utils"), ("paged_attention.v1", "paged_attention.v1.table"),
                     ("paged_attention.v1.table", "paged_attention.utils"),
                     ("paged_attention.v1.table", "paged_attention.v1.helpers"),
                     ("paged_attention.v1.helpers", "paged_attention.v1.late"),
                     ("paged_attention.v1.late", "paged_attention.v1.table")}
    assert not layer_violations(module_graph(sources))
    cycle = find_cycle(module_graph(sources))
    assert cycle == ["paged_attention.v1.table", "paged_attention.v1.helpers", "paged_attention.v1.late",
                     "paged_attention.v1.table"]
    sources["paged_attention.utils"] = ("from paged_attention.v1 import T\n", False)
    assert any("imports flow one way" in p for p in layer_violations(module_graph(sources)))
