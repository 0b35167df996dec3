"""No import circles among appliance's modules (DESIGN.md: "no import cycles").

The imports are read from the source with `ast`, nothing is imported. Two graphs:
- module-level imports (what runs when a module loads): no circle at all;
- every import, including the ones deferred into a function (a circle Python tolerates, but
  still two modules that cannot be understood or tested apart): none outside `ALLOWED`,
  each entry with its reason.
Imports under `if TYPE_CHECKING:` never run and are left out of both. A new circle fails
here with the modules and the edges that close it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "appliance"

# Circles left on purpose (each as the sorted modules of its strongly connected component),
# with why. An entry that no longer closes a circle fails too, so the list stays true.
ALLOWED: dict[frozenset[str], str] = {
    frozenset({"appliance.testing.fake_sglang.core", "appliance.testing.fake_sglang.disagg"}):
        "the emulator's request core starts a cell handover (disagg) in a deferred import, "
        "and disagg raises the core's EngineAbort; ending it moves EngineAbort to its own "
        "module, in the emulator's own change",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_BLOCKS = (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _imports(body: list[ast.stmt], *, deep: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run: at module level (through if/try/with blocks), and,
    when `deep`, inside functions and classes too; never under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _imports(node.body, deep=deep)
            yield from _imports(node.orelse, deep=deep)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _imports(block, deep=deep)
        elif isinstance(node, _BLOCKS) or (deep and isinstance(node, _DEFINITIONS)):
            yield from _imports(node.body, deep=deep)


def import_graph(*, deep: bool) -> dict[str, set[str]]:
    """Each appliance module and the appliance modules it imports."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")).body, deep=deep):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod.
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names)
        graph[name] = {t for t in map(known, targets) if t and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def describe(graph: dict[str, set[str]], circle: frozenset[str]) -> str:
    edges = [f"    {a} -> {b}" for a in sorted(circle) for b in sorted(graph[a] & circle)]
    return " <-> ".join(sorted(circle)) + "\n" + "\n".join(edges)


def test_no_module_level_import_circles() -> None:
    graph = import_graph(deep=False)
    found = circles(graph)
    assert not found, "import circles at module level:\n" + "\n".join(
        describe(graph, c) for c in found)


def test_no_import_circles_but_the_allowed_ones() -> None:
    graph = import_graph(deep=True)
    found = circles(graph)
    new = [c for c in found if c not in ALLOWED]
    assert not new, ("import circles (deferred imports included; end each where a value "
                     "type or a small module ends the loop, or allow it here with the "
                     "reason):\n" + "\n".join(describe(graph, c) for c in new))
    stale = [sorted(c) for c in ALLOWED if c not in found]
    assert not stale, f"allowed circles that no longer exist (drop them from ALLOWED): {stale}"


def test_the_finder_sees_a_circle_and_ignores_type_checking(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
              "def f():\n    import y\n")
    body = ast.parse(source).body
    shallow = [a.name for n in _imports(body, deep=False) if isinstance(n, ast.Import)
               for a in n.names]
    deep = [a.name for n in _imports(body, deep=True) if isinstance(n, ast.Import)
            for a in n.names]
    assert shallow == [] and deep == ["y"]
