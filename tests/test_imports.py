"""The package's import graph, read from the source: `core/` imports only `core/` (it is the
pure core every layer above stands on), and no modules import each other in a circle (a late
import inside a function counts too; only `if TYPE_CHECKING:` imports do not); and no module
is over 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import corral

ROOT = Path(corral.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The corral modules `path` imports (a name imported from a package counts as its module
    when it is one)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name.startswith("corral"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                if base.startswith("corral"):
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        out.add(sub if sub in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in modules and m != me}


def graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def test_core_imports_only_core() -> None:
    g = graph()
    outside = {
        m: sorted(i for i in deps if not i.startswith("corral.core"))
        for m, deps in g.items() if m.startswith("corral.core.")
    }  # fmt: skip
    assert {m: d for m, d in outside.items() if d} == {}


def find_circles(g: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                circles.append([*path[path.index(d):], d])
            elif d not in state:
                walk(d)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            walk(m)
    return circles


def test_no_import_circles() -> None:
    g = graph()
    g.pop("corral", None)  # the package's face (its version) imports nothing of the package
    assert find_circles(g) == []


def test_the_graph_is_read() -> None:
    """The reader itself: it sees a late import, a relative one and a package's module."""
    g = graph()
    assert "corral.core.devices" in g["corral.core.placement"]
    assert "corral.api.service" in g["corral.api.families.openai.routes"]
    assert g["corral.core.units"] == set()
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


MAX_LINES = 700  # past this a module holds several concepts: split it along its seams


def test_no_module_is_over_700_lines() -> None:
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert sizes["corral.core.books"] > 100  # the walk found the package
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
