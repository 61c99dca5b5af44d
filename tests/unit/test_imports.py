"""The package's import graph has no circle, and its top level stays small.

Every import counts, at module level or inside a function: a lazy import only moves a circle to
run time. Importing a submodule imports its parent packages, so an edge to a submodule is an edge
to every package above it too (except the importer's own ancestors, which are being imported).
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "deepspeed_multi")
PACKAGE = "deepspeed_multi"
TOP_LEVEL_MODULES = 12  # .py files directly in deepspeed_multi/, __init__.py included


def _modules():
    out = {}
    for directory, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(directory, f)
                parts = [PACKAGE] + os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = path
    return out


def _graph(modules):
    def known(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                target = known(target)
                while target:  # the target and the packages above it run on import
                    if target != module and not module.startswith(target + "."):
                        edges[module].add(target)
                    target = target.rpartition(".")[0]
    return edges


def _circles(edges):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
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


def test_no_import_circle():
    circles = _circles(_graph(_modules()))
    assert not circles, "import circles in deepspeed_multi (every import counts, lazy ones too):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_check_finds_a_circle():
    edges = {"p": set(), "p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert _circles(edges) == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("lazy", [False, True])
def test_a_circle_through_a_parent_package_is_found(tmp_path, monkeypatch, lazy):
    """pkg.x imports pkg.sub.y, whose package pkg.sub imports pkg.sub.z, which imports pkg.x."""
    root = tmp_path / PACKAGE
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    indent = "def f():\n    " if lazy else ""
    (root / "x.py").write_text(f"{indent}from .sub import y\n")
    (root / "sub" / "__init__.py").write_text("from . import z\n")
    (root / "sub" / "y.py").write_text("")
    (root / "sub" / "z.py").write_text("from .. import x\n")
    monkeypatch.setitem(globals(), "ROOT", str(root))
    circles = _circles(_graph(_modules()))
    assert circles and f"{PACKAGE}.x" in circles[0] and f"{PACKAGE}.sub.z" in circles[0], circles


def test_top_level_stays_small():
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert len(top) <= TOP_LEVEL_MODULES, (
        f"deepspeed_multi/ holds {len(top)} modules ({top}), at most {TOP_LEVEL_MODULES}: put a new one in the "
        "subpackage of its job (checkpoint/, zero/, autograd/, reliability/, integrations/, ...).")
