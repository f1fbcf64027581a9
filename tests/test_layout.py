"""The package's layout holds: no import circle between llmtrain's modules or packages
(function-level imports count too), no function-level import of an llmtrain module that
avoids no circle, no method tested for outside its wing, and docs/development.md lists every
module."""

import ast
import re
from pathlib import Path

from llmtrain.methods import METHODS
from tests.support.runs import ROOT

PKG = ROOT / "llmtrain"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, node) -> set[str]:
    """The llmtrain modules an import statement imports (a package's __init__ stands for
    the package: importing a name from a package imports its __init__)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.startswith("llmtrain")}
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if not mod.startswith("llmtrain"):
        return set()
    found = set()
    for alias in node.names:  # `from pkg import module` imports the module
        sub = f"{mod}.{alias.name}"
        found.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).is_file() else mod)
    return found


def imports(path: Path) -> tuple[set[str], set[tuple[str, int]]]:
    """(every llmtrain module the file imports, anywhere in it; those imported inside a
    function, with the line)."""
    name, tree = module_name(path), ast.parse(path.read_text())
    every, inside = set(), set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    inside |= {(m, node.lineno) for m in imported(path, node)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            every |= imported(path, node)
    drop = {name, "llmtrain"}
    return every - drop, {(m, line) for m, line in inside if m not in drop}


def modules() -> list[Path]:
    return [p for p in PKG.rglob("*.py") if p.name != "__main__.py"]


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p)[0] for p in modules()}


def circles(g: dict[str, set[str]]) -> list[str]:
    state, found = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                found.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def reaches(g: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    return False


def test_no_import_circles():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(found)


def test_no_circles_between_packages():
    """Between the subpackages and the top-level modules too: config/ sits below data/,
    which sits below core/, and so on; a module may use one below its own package only."""

    def unit(m: str) -> str:
        return ".".join(m.split(".")[:2])

    g: dict[str, set[str]] = {}
    for m, deps in graph().items():
        g.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    found = circles(g)
    assert not found, "circles between packages:\n" + "\n".join(found)


def test_function_level_imports_avoid_a_circle():
    """An llmtrain module imported inside a function hides an arrow of the house; it is
    there only where importing it at the top would close a circle (the module imported
    reaches back to the importer). Others belong at the top of the file."""
    g = graph()
    hidden = []
    for path in modules():
        name = module_name(path)
        for target, line in sorted(imports(path)[1]):
            if not reaches(g, target, name):
                hidden.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not hidden, "function-level imports that avoid no circle (hoist them):\n" + "\n".join(hidden)


def wing_of(method) -> str:
    """The module or package a method's declaration belongs to: its wing (preference/,
    rl/), or for finetune, core/finetune.py alone (core/ is every method's)."""
    module = method.parts.__module__
    package = module.rpartition(".")[0]
    return module if package == "llmtrain.core" else package


def test_no_method_is_tested_for_outside_its_wing():
    """Outside a method's wing (and the method table) nothing asks which method a run is:
    no attribute of its config section (cfg.grpo), no isinstance of its tree, no
    hasattr/getattr of its section, no string that is its name or section (a comparison,
    a default argument, a lookup)."""
    words = {m.section for m in METHODS.values() if m.section} | {m.name for m in METHODS.values()}
    trees = {m.schema.__name__ for m in METHODS.values()} - {"Config"}
    owner = {}
    for m in METHODS.values():
        for word in (m.name, m.section, m.schema.__name__):
            owner[word] = wing_of(m)
    found = []
    for path in modules():
        name = module_name(path)
        if name == "llmtrain.methods":
            continue

        def mine(word: str, name: str = name) -> bool:
            wing = owner.get(word, "")
            return name == wing or name.startswith(f"{wing}.")

        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and node.attr in words and not mine(node.attr):
                found.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                args = [a.id if isinstance(a, ast.Name) else getattr(a, "value", None) for a in node.args[1:2]]
                if node.func.id == "isinstance":
                    elts = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                    args = [e.id for e in elts if isinstance(e, ast.Name)]
                if node.func.id in ("isinstance", "hasattr", "getattr"):
                    found += [f"{where}: {node.func.id}(..., {a})" for a in args if a in words | trees and not mine(a)]
            elif isinstance(node, (ast.Compare, ast.arguments, ast.Subscript)):  # == "dpo", ="dpo", ["dpo"]
                if isinstance(node, ast.Compare):
                    parts = [node.left, *node.comparators]
                elif isinstance(node, ast.arguments):
                    parts = [*node.defaults, *node.kw_defaults]
                else:
                    parts = [node.slice]
                constants = [e for p in parts if p is not None for e in getattr(p, "elts", [p])]
                found += [
                    f"{path.relative_to(ROOT)}:{c.lineno}: names {c.value!r}"
                    for c in constants
                    if isinstance(c, ast.Constant) and c.value in words and not mine(c.value)
                ]
            elif isinstance(node, ast.ImportFrom) and any(a.name in trees and not mine(a.name) for a in node.names):
                found.append(f"{where}: imports a method's tree")
    assert not found, "methods tested for outside their wings:\n" + "\n".join(found)


def test_the_layout_lists_every_module():
    text = (ROOT / "docs" / "development.md").read_text()
    missing = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and p.name not in text
    ]
    assert not missing, f"docs/development.md's layout does not list {missing}"


def test_slow_tests_live_under_tests_launch():
    """The quick tier is everything outside tests/launch/: a test marked slow elsewhere would
    hide a launch among the unit tests."""
    found = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "launch" not in p.relative_to(ROOT).parts
        and re.search(r"^\s*(@pytest\.mark\.slow|pytestmark\b.*slow)", p.read_text(), re.M)
    ]
    assert not found, f"slow tests outside tests/launch/: {found}"
