"""The package's layering, read from the source: each stage imports only itself and the stages below it
(the order `prism_dsl.STAGES` declares), no module imports itself back through others, and no private
name (`_x`) is used outside the module that defines it. Imports inside functions count: hiding an import
in a function does not hide the dependency. And no module grows past what one reads whole."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prism_dsl

PACKAGE = Path(prism_dsl.__file__).parent


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for each import of `module` inside the package."""
    path = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("prism_dsl")]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, path, node)
            if not target.startswith("prism_dsl"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return out


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in prism_dsl.STAGES) else None


def test_every_module_belongs_to_a_declared_stage():
    loose = [m for m in MODULES if m not in ("prism_dsl", "prism_dsl.__main__") and stage(m) is None]
    assert not loose, f"modules outside every stage package: {loose}"
    undeclared = sorted({m.split(".")[1] for m in MODULES if m.count(".") >= 1} - set(prism_dsl.STAGES) - {"__main__"})
    assert not undeclared, f"packages missing from prism_dsl.STAGES: {undeclared}"


def test_each_stage_imports_only_itself_and_lower_stages():
    order = {s: i for i, s in enumerate(prism_dsl.STAGES)}
    wrong = []
    for module in MODULES:
        if stage(module) is None:
            continue
        for target, _, line in imports(module):
            if stage(target) and order[stage(target)] > order[stage(module)]:
                wrong.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {stage(module)} imports "
                             f"{target} ({stage(target)} is a higher stage)")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: sorted({t for t, _, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_no_private_name_used_outside_its_module():
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        imported_modules = set()
        for target, name, line in imports(module):
            if name.startswith("_") and not name.startswith("__"):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _absolute(module, path, node)
                imported_modules |= {a.asname or a.name for a in node.names if f"{target}.{a.name}" in MODULES}
            elif isinstance(node, ast.Import):
                imported_modules |= {a.asname or a.name for a in node.names if a.name in MODULES}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported_modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: uses {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)


MAX_MODULE_LINES = 500  # past this a module holds more than one concern: split it by concern


def test_no_module_is_too_long_to_read_whole():
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "\n".join(long)
