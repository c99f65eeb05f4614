"""The import graph of `src/hylo`, held against the layer order `hylo`'s docstring states: the
circles (modules that import each other, and units that do: a unit is a folder or a top-level
module) and the imports that run from a lower layer up to a higher one. Every import statement
counts, wherever it stands (inside a function, under `TYPE_CHECKING`). Prints JSON.

    .venv/bin/python benchmarks/import_graph.py [--src SRC] [--order "cli/server,llm,bench/..."]

`--src` measures another checkout's `src`; `--order` (layers top to bottom, `/` between layers, `,`
between the units of one layer) holds a tree whose docstring states no order against one.
`tests/test_import_layers.py` keeps the figures at zero.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER_HEADING = "Layers, top to bottom"


def modules(src: Path) -> dict[str, Path]:
    """Every module of the `hylo` package under `src`, by dotted name (a package by its own)."""
    found = {}
    for path in sorted((src / "hylo").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The modules of the tree an import statement names (`from a import b`: `a.b` where it is a
    module, else `a`)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".")[: len(module.split(".")) - node.level + int(is_package)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    else:
        return []
    resolved = []
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            resolved.append(name)
    return resolved


def import_graph(src: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import}, within the tree, self-imports left out."""
    known = modules(src)
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, module, path.name == "__init__.py", known):
                if target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def unit(module: str) -> str | None:
    """`hylo.a.b` -> `a`; the `hylo` package itself is no unit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_order(src: Path) -> list[list[str]]:
    """The layers, top to bottom, as `hylo`'s docstring lists them under `ORDER_HEADING`."""
    doc = ast.get_docstring(ast.parse((src / "hylo" / "__init__.py").read_text())) or ""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(ORDER_HEADING)), None)
    if start is None:
        raise ValueError(f"{src}/hylo/__init__.py: no '{ORDER_HEADING}' in the docstring (pass --order)")
    layers, i = [], start + 1
    while i < len(lines) and not lines[i].startswith("    "):
        i += 1  # the heading's own continuation lines
    while i < len(lines) and lines[i].startswith("    "):
        layers.append([name.strip() for name in lines[i].split(",")])
        i += 1
    return layers


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return sorted(found)


def measure(src: Path, order: list[list[str]]) -> dict:
    """What `main` prints: the circles and the upward imports (`unit -> unit: file:line imports
    module`), against `order`."""
    graph, paths = import_graph(src), modules(src)
    rank = {name: i for i, layer in enumerate(order) for name in layer}
    units: dict[str, set[str]] = defaultdict(set)
    upward = []
    for module, edges in graph.items():
        a = unit(module)
        for target, line in edges.items():
            b = unit(target)
            if a is None or b is None or a == b:
                continue
            units[a].add(b)
            if a in rank and b in rank and rank[a] > rank[b]:
                path = paths[module].relative_to(src)
                upward.append(f"{a} -> {b}: {path}:{line} imports {target}")
    all_units = sorted({u for m in graph if (u := unit(m)) is not None})
    return {
        "order": [", ".join(layer) for layer in order],
        "units": len(all_units),
        "unplaced": [u for u in all_units if u not in rank],
        "module_circles": circles({m: set(e) for m, e in graph.items()}),
        "unit_circles": circles({u: units.get(u, set()) for u in all_units}),
        "upward_unit_pairs": sorted({line.split(":")[0] for line in upward}),
        "upward_imports": sorted(upward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src")
    parser.add_argument("--order", help='layers top to bottom: "cli/server,llm,bench/..."')
    args = parser.parse_args()
    order = [layer.split(",") for layer in args.order.split("/")] if args.order else layer_order(args.src)
    found = measure(args.src, order)
    found |= {
        "module_circle_count": len(found["module_circles"]),
        "unit_circle_count": len(found["unit_circles"]),
        "upward_pair_count": len(found["upward_unit_pairs"]),
        "upward_import_count": len(found["upward_imports"]),
    }
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
