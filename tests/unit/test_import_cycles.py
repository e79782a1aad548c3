"""No import cycle inside the library, counting every import: module-level, function-local
and TYPE_CHECKING ones. import-linter's layers contract (pyproject.toml) keeps the concerns
apart; this finds a cycle between two modules of one concern too, or one hidden behind a
function-local import, which a lazy import would otherwise make invisible until it bites."""

from __future__ import annotations

from collections.abc import Iterator

import grimp


def _imports(graph: grimp.ImportGraph, module: str) -> Iterator[str]:
    return iter(sorted(graph.find_modules_directly_imported_by(module)))


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, _imports(graph, root))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, _imports(graph, child)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _graph() -> grimp.ImportGraph:
    graph = grimp.build_graph("ddpflow", exclude_type_checking_imports=False, cache_dir=None)
    # A package's __init__ is not a dependency of its own modules' imports of each other.
    for module in list(graph.modules):
        for imported in list(graph.find_modules_directly_imported_by(module)):
            if module.startswith(imported + "."):
                graph.remove_import(importer=module, imported=imported)
    return graph


def test_the_library_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_check_finds_a_cycle_hidden_in_a_function():
    graph = _graph()
    # ddpflow.storage.retry imports ddpflow.storage.redact; a function-local import back:
    graph.add_import(importer="ddpflow.storage.redact", imported="ddpflow.storage.retry")
    assert ["ddpflow.storage.redact", "ddpflow.storage.retry"] in _cycles(graph)
