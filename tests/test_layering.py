"""Imports run one way (DESIGN.md): server -> engine -> model -> kernels / gguf / templates, the API and
the CLI on top, and no import circle anywhere in bubo/. Read from the source (every import statement,
those inside functions and under TYPE_CHECKING included), so nothing has to be imported to check it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "bubo"

# What each part may import besides itself and the leaf modules (bubo.options, bubo.dtypes,
# bubo.process_memory, bubo.default_model).
ALLOWED = {
    "gguf": set(),
    "kernels": {"gguf"},
    "templates": set(),
    "vision": {"gguf"},
    "model": {"gguf", "kernels"},
    "engine": {"gguf", "kernels", "templates", "vision", "model"},
    "api": {"engine", "model", "gguf"},
    "server": {"engine", "model", "gguf", "templates", "vision", "__init__"},
    "file_listing": {"gguf"},
    "cli": {"api", "engine", "file_listing", "gguf", "server", "__init__"},
    "__main__": {"cli"},
}
LEAVES = {"options", "dtypes", "process_memory", "default_model"}


def _modules() -> dict[str, set[str]]:
    """Each module of bubo (dotted name) and the bubo modules it imports."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("bubo")
            ):
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("bubo"))
        found[name] = imported
    return {name: {i for i in imports if i in found and i != name} for name, imports in found.items()}


def _part(module: str) -> str:
    """The part of bubo a module belongs to: its subpackage, or its own name for a top-level module."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_parts_import_only_the_parts_below_them() -> None:
    wrong = []
    for module, imports in _modules().items():
        part = _part(module)
        if part in LEAVES:
            assert not imports, f"{module} is a leaf and imports {sorted(imports)}"
            continue
        for target in imports:
            other = _part(target)
            if other != part and other not in LEAVES and other not in ALLOWED[part]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph = _modules()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_checks_see_a_circle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a package with a circle and an upward import is caught."""
    package = tmp_path / "bubo"
    (package / "model").mkdir(parents=True)
    (package / "engine").mkdir()
    (package / "__init__.py").write_text("")
    (package / "model" / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "model" / "a.py").write_text("from bubo.engine.b import X\n")
    (package / "engine" / "b.py").write_text("from bubo.model.a import Y\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    with pytest.raises(AssertionError, match=r"bubo\.model\.a imports bubo\.engine\.b"):
        test_parts_import_only_the_parts_below_them()
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_no_import_circle()
