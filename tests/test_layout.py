"""The package's layout holds: no import circle between llmtrain's modules (function-level
imports count too), and docs/development.md lists every module."""

import ast
from pathlib import Path

from tests.conftest import ROOT

PKG = ROOT / "llmtrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The llmtrain modules a file imports, anywhere in it (a package's __init__ stands for
    the package: importing a name from a package imports its __init__)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("llmtrain"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{mod}.{alias.name}"
                found.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).is_file() else mod)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("llmtrain")}
    return {m for m in found if m != name and m != "llmtrain"}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PKG.rglob("*.py") if p.name != "__main__.py"}


def test_no_import_circles():
    g = graph()
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                circles.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_layout_lists_every_module():
    text = (ROOT / "docs" / "development.md").read_text()
    missing = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and p.name not in text
    ]
    assert not missing, f"docs/development.md's layout does not list {missing}"


def test_no_circles_between_packages():
    """Between the subpackages and the top-level modules too: config/ sits below data/,
    which sits below core/, and so on; a module may use one below its own package only."""

    def unit(m: str) -> str:
        return ".".join(m.split(".")[:2])

    g: dict[str, set[str]] = {}
    for m, deps in graph().items():
        g.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                circles.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not circles, "circles between packages:\n" + "\n".join(circles)
