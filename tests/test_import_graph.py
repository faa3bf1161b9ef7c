"""No circles in the house (issue #33 item 7): no two modules of ``resjax`` or ``experiments`` import each other,
directly or through a chain of other modules.

The graph is read from the source (``ast``; nothing is imported): an edge ``a -> b`` for every ``import`` and
``from ... import`` in module ``a`` that names module ``b`` of the two packages, wherever it stands (at the top,
or inside a function: a deferred import is how a circle is usually hidden, and it still ties the two modules
together). Not counted: imports under ``if TYPE_CHECKING:`` (never executed; annotations only), and the implicit
import of a module's parent packages (``import resjax.train.core`` runs ``resjax/train/__init__.py`` first; a
package's ``__init__`` re-exporting its submodules would otherwise make every package a circle with its
members). ``from package import name`` is an edge to the submodule ``package.name`` when there is one, else to the
package itself (its ``__init__`` defines or re-exports ``name``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("resjax", "experiments")

#: Circles known at the time of writing, each being removed by another change: ``frozenset`` of the modules of
#: one strongly connected component. The lead removes an entry once that change is merged.
KNOWN: set = set()  # circles tolerated for now: none (block.py <-> residual.py was the last one)


def modules() -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module of the packages (a package is its ``__init__.py``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every ``Import``/``ImportFrom`` node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _target(name: str, known: dict) -> str | None:
    """The deepest module of ``known`` that ``name`` (dotted) names, or None outside the packages."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


def graph() -> dict[str, set[str]]:
    """``{module: modules it imports}``, within the packages (see the module docstring)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_target(alias.name, known) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [_target(f"{base}.{alias.name}", known) if f"{base}.{alias.name}" in known
                           else _target(base, known) for alias in node.names]
            edges[name].update(t for t in targets if t is not None and t != name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one circle through all of
    its modules where the component is a single circle, else its modules sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _path(edges, component) -> str:
    """One circle inside ``component`` for the message: ``a -> b -> a``."""
    members = set(component)
    start = component[0]
    route, seen = [start], {start}
    while True:
        nxt = sorted(w for w in edges[route[-1]] if w in members)
        back = [w for w in nxt if w == start]
        if back and len(route) > 1:
            return " -> ".join(route + [start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:
            return " <-> ".join(component)
        route.append(fresh[0])
        seen.add(fresh[0])


def test_the_graph_is_read():
    """The reader finds the imports it must (a reader that finds nothing passes every circle test)."""
    edges = graph()
    assert "experiments.checkpoints" in edges["experiments.runner"]
    assert "experiments.files" in edges["experiments.checkpoints"]  # a deferred import counts
    assert "resjax.train.lock" in edges["experiments.files"]
    assert "resjax.train" in edges["experiments.degradation"]  # from resjax.train import make_train (a name)
    assert "resjax.train.side_by_side" in edges["experiments.checkpoints"]  # from resjax.train import (a module)


def test_a_circle_is_found_and_named():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    (component,) = cycles(edges)
    assert component == ["a", "b", "c"] and _path(edges, component) == "a -> b -> c -> a"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_modules_import_each_other(package):
    edges = graph()
    circles = [c for c in cycles(edges) if c[0].split(".")[0] == package and frozenset(c) not in KNOWN]
    assert not circles, "import circles: " + "; ".join(_path(edges, c) for c in circles)
