"""Rules of the package's source: no module reaches itself through others (an import inside
a function counts too; qmigrate/bench/ is tooling and not checked), and the KV pool's state
is changed by the pool's own methods only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "qmigrate"
SKIP = ("qmigrate.bench",)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports anywhere in it."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    deps.add(full if full in paths else base)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_circle_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_product_imports_itself_through_others():
    graph = import_graph()
    assert "qmigrate.wire.codec" in graph["qmigrate.wire.transport"]   # the graph sees imports
    found = [c for c in circles(graph) if not all(m.startswith(SKIP) for m in c)]
    assert found == []


POOL_FIELD = re.compile(r"(^|\.)pool\.\w+")                      # pool.x, self.pool.x, engine.pool.x
POOL_MUTATION = re.compile(r"(^|\.)pool\.(\w+\.(update|pop|popitem|append|extend|clear|setdefault|remove|"
                           r"insert|move_to_end)|_\w+)$")          # a change of one of its maps, or a private method


def pool_writes(source: str) -> list[str]:
    """Statements that change a KV pool's fields from outside it: assignments to pool.x or
    pool.x[...], and calls that change pool.x in place or reach a private method."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and POOL_FIELD.search(ast.unparse(t)):
                found.append(ast.unparse(node))
        if isinstance(node, ast.Call) and POOL_MUTATION.search(ast.unparse(node.func)):
            found.append(ast.unparse(node))
    return found


def test_the_rule_sees_a_pool_changed_from_outside():
    assert pool_writes("self.pool.length[s] = 3\npool.length.update(x)\nengine.pool.can_copy = False\n"
                       "pool._zero([1])\ndel pool.blocks[4]\n")
    assert pool_writes("self.pool = pool\npool.grow(s, 4)\nn = pool.length[s]\nx.update(pool.length)\n") == []


def test_only_the_pool_changes_its_state():
    owners = {ROOT / "engine" / "kv" / "pool.py"}
    found = {str(p.relative_to(ROOT.parent)): w for p in ROOT.rglob("*.py")
             if p not in owners and (w := pool_writes(p.read_text()))}
    assert found == {}
