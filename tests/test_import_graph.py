"""The package's import structure, read from the source with ``ast`` (nothing is imported).

* No import cycle among the modules of ``lightning_gossip``: the graph of its imports is
  acyclic, both the graph of what runs when a module is imported (the module's body, its
  ``if``/``try``/``with`` blocks and class bodies) and the graph of every import, those in
  function bodies included (a cycle hidden by a function-level import is still a cycle: the
  error classes in ``exchange.py`` once forced four of them), and the graph with the imports
  under ``if TYPE_CHECKING:`` too (they never run, but two modules that name each other's
  types are one concept split in two, or lean on each other through a protocol). An edge
  goes to the module an import names: ``from lightning_gossip.liveness import Heartbeat`` is
  an edge to ``lightning_gossip.liveness`` (its ``__init__``), ``from lightning_gossip import
  liveness`` one to ``lightning_gossip.liveness``; the implicit import of a parent package is
  not an edge (every package's ``__init__`` imports its own submodules).
* ``lightning_gossip.errors`` imports nothing from the package and nothing outside the
  standard library, and every exception class of the package is defined there (the CLI's
  usage error aside).
* ``benchmarks/`` and the package import nothing from ``tests/``.
* Lightning only in the adapters: no module of the package outside ``strategies/`` (the
  Lightning strategies), ``fabric/`` (the Fabric strategies) and ``_compat.py`` (every private
  Lightning name) imports ``lightning``, ``pytorch_lightning`` or ``lightning_fabric``, anywhere
  in the module (function bodies and ``TYPE_CHECKING`` blocks included), nor names one to
  ``importlib.import_module`` / ``__import__``.
* The elastic package (``lightning_gossip/elastic/``) and the shared cursor's
  (``lightning_gossip/cursor/``) import nothing of the adapters either.
"""

from __future__ import annotations

import ast
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "lightning_gossip"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(node: ast.AST, functions: bool,
                 type_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements under ``node`` that can run, those in function bodies only with
    ``functions`` (without them: those that run when the module is imported), and with
    ``type_only`` those under ``if TYPE_CHECKING:`` too (every import of the module)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and not type_only:
            for stmt in child.orelse:
                yield from import_nodes(ast.Module(body=[stmt], type_ignores=[]), functions)
        elif functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                 ast.Lambda)):
            yield from import_nodes(child, functions, type_only)


def imported_modules(name: str, path: Path, functions: bool,
                     type_only: bool = False) -> set[str]:
    """The package's modules that the module ``name`` (at ``path``) imports by name (see
    :func:`import_nodes` for ``functions`` and ``type_only``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in import_nodes(tree, functions, type_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES
                       else module for alias in node.names]
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target.split(".")[0] == PACKAGE:
                out.add(target)
    return out


def import_graph(functions: bool, type_only: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports (see
    :func:`import_nodes` for ``functions`` and ``type_only``)."""
    return {name: imported_modules(name, path, functions, type_only) - {name}
            for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None`` when it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_is_read_from_the_source():
    """The walk finds the package's modules and known edges (a guard on the test itself)."""
    graph, every = import_graph(functions=False), import_graph(functions=True)
    assert {f"{PACKAGE}.errors", f"{PACKAGE}.exchange", f"{PACKAGE}.liveness.waits"} <= set(graph)
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}.exchange"]
    assert f"{PACKAGE}.liveness" in graph[f"{PACKAGE}.exchange"]  # `from ... import liveness`
    assert f"{PACKAGE}.liveness.waits" in graph[f"{PACKAGE}.liveness.heartbeat"]
    # a TYPE_CHECKING import is an edge of the type-only graph alone (pairing.py names
    # hierarchy's types for annotations only)
    typed = import_graph(functions=True, type_only=True)
    assert f"{PACKAGE}.hierarchy" in typed[f"{PACKAGE}.pairing"]
    assert f"{PACKAGE}.hierarchy" not in every[f"{PACKAGE}.pairing"]
    # a function-level import is an edge of the full graph only (plan.blocks's of analysis)
    assert f"{PACKAGE}.analysis" in every[f"{PACKAGE}.plan.blocks"]
    assert f"{PACKAGE}.analysis" not in graph[f"{PACKAGE}.plan.blocks"]


def test_find_cycle_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize(("functions", "type_only"), [(False, False), (True, False), (True, True)],
                         ids=["import-time", "with-functions", "with-type-only"])
def test_the_package_has_no_import_cycle(functions, type_only):
    """Type-only imports included: a cycle that only ``TYPE_CHECKING`` hides is still two
    modules that need each other."""
    cycle = find_cycle(import_graph(functions, type_only))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_errors_imports_only_the_standard_library():
    """Anywhere in the module, function bodies included."""
    tree = ast.parse(MODULES[f"{PACKAGE}.errors"].read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            names.add((node.module or "").split(".")[0])
    assert "__future__" in names  # the walk sees the module's imports
    outside = sorted(n for n in names if n != "__future__" and n not in sys.stdlib_module_names)
    assert outside == [], outside


def exception_classes() -> Iterator[tuple[str, str, list[str]]]:
    """``(module, class, base names)`` of every class of the package whose bases look like an
    exception (a name ending in Error, Exception, Timeout, Mismatch, Silent or Peer...)."""
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                if any(b.endswith(("Error", "Exception", "Timeout", "Mismatch", "Silent"))
                       or b.startswith("NonFinite") for b in bases):
                    yield name, node.name, bases


def test_every_exception_class_is_in_the_errors_module():
    found = list(exception_classes())
    assert any(cls == "PeerSilent" for _, cls, _ in found)  # the scan sees errors.py
    outside = [(module, cls) for module, cls, _ in found
               if module != f"{PACKAGE}.errors" and not module.startswith(f"{PACKAGE}.cli")]
    assert outside == [], outside



def test_benchmarks_and_the_library_import_nothing_from_tests():
    """The launcher and the rank helpers live in ``benchmarks/``; ``tests/`` imports them, never
    the other way round (a benchmark must run from a checkout without its tests)."""
    repo = ROOT.parent
    offenders = []
    for path in sorted([*(repo / "benchmarks").rglob("*.py"), *ROOT.rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(repo)}:{node.lineno} imports {name}"
                          for name in names if name == "tests" or name.startswith("tests.")]
    assert offenders == []


# -- Lightning only in the adapters ----------------------------------------------------------
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
#: the modules that may import Lightning: the adapters and the accessor of its private names
ADAPTERS = (f"{PACKAGE}.strategies", f"{PACKAGE}.fabric", f"{PACKAGE}._compat",
            f"{PACKAGE}._compat_loops")


def lightning_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, name)`` of every import of a Lightning package anywhere under ``tree``
    (function bodies and ``TYPE_CHECKING`` blocks included), and of every call of
    ``import_module`` / ``__import__`` with such a name as a string constant."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif (isinstance(node, ast.Call) and node.args
              and ast.unparse(node.func).rpartition(".")[2] in ("import_module", "__import__")
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in LIGHTNING]
    return found


def _is_adapter(module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ADAPTERS)


def test_only_the_adapters_import_lightning():
    offenders = [f"{name}:{line} imports {what}" for name, path in MODULES.items()
                 if not _is_adapter(name)
                 for line, what in lightning_imports(ast.parse(path.read_text()))]
    assert offenders == [], offenders
    # the scan sees the adapters' imports, at module level and in functions
    adapters = {name: lightning_imports(ast.parse(path.read_text()))
                for name, path in MODULES.items() if _is_adapter(name)}
    assert adapters[f"{PACKAGE}.strategies.gossip"]
    assert any(what == "lightning.pytorch.utilities.data"
               for _, what in adapters[f"{PACKAGE}._compat"])  # inside a function


def test_the_lightning_scan_finds_planted_imports():
    planted = ast.parse(textwrap.dedent("""
        import os
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import lightning.pytorch as pl

        def later():
            from pytorch_lightning.utilities import rank_zero_warn
            import importlib
            return importlib.import_module("lightning_fabric.plugins")

        from lightning_gossip import errors
    """))
    assert [what for _, what in lightning_imports(planted)] == [
        "lightning.pytorch", "pytorch_lightning.utilities", "lightning_fabric.plugins"]
    assert _is_adapter(f"{PACKAGE}.fabric.strategy") and _is_adapter(f"{PACKAGE}._compat")
    assert not _is_adapter(f"{PACKAGE}.liveness.waits")
    assert not _is_adapter(f"{PACKAGE}.strategies_extra")


def _below_the_adapters(package: str, at_least: int) -> dict[str, set[str]]:
    """The import graph, once ``package``'s modules (at least ``at_least`` of them) are shown
    to import no Lightning and nothing of the adapters, ``strategies/`` and ``fabric/``,
    anywhere (function bodies and type-only imports included)."""
    modules = [name for name in MODULES
               if name == f"{PACKAGE}.{package}" or name.startswith(f"{PACKAGE}.{package}.")]
    assert len(modules) >= at_least and not any(_is_adapter(name) for name in modules)
    graph = import_graph(functions=True, type_only=True)
    upward = {name: sorted(d for d in graph[name]
                           if d.startswith((f"{PACKAGE}.strategies", f"{PACKAGE}.fabric")))
              for name in modules}
    assert not any(upward.values()), upward
    return graph


def test_the_elastic_package_sits_below_the_adapters():
    """``lightning_gossip.elastic`` (membership, recovery, joins) imports no Lightning (the scan
    above covers it: it is no adapter) and nothing of the adapters, ``strategies/`` and
    ``fabric/``, anywhere in its modules (function bodies and type-only imports included): the
    strategies hand it what Lightning knows as values."""
    graph = _below_the_adapters("elastic", at_least=10)
    assert f"{PACKAGE}.elastic.session" in graph[f"{PACKAGE}.elastic.survivors"]  # (the walk)


def test_the_cursor_package_sits_below_the_adapters():
    """``lightning_gossip.cursor`` (the shared cursor: claims, samplers, the loader's sampler,
    the requeue position) imports no Lightning and nothing of ``strategies/`` or ``fabric/``,
    type-only imports included: the adapters rebuild their loaders with it."""
    graph = _below_the_adapters("cursor", at_least=6)
    assert f"{PACKAGE}.cursor.claims" in graph[f"{PACKAGE}.cursor.sampler"]  # (the walk)
