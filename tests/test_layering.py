"""The layer rule of docs/design.md section 1, read from the source: who may import whom."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

try:  # Python >= 3.11; the oldest-supported leg (3.10) reads TOML with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
OURS = {"fsdp_comm", "fsdp_memory", "fsdp_engine", "fsdp_ckpt", "fsdp"}
# package -> the packages of ours it may import (besides itself)
ALLOWED = {
    "fsdp_comm": set(),
    "fsdp_memory": set(),
    "fsdp_engine": {"fsdp_comm", "fsdp_memory"},
    "fsdp_ckpt": {"fsdp_comm", "fsdp_memory", "fsdp_engine"},
}
THIRD_PARTY_ALLOWED = {"fsdp_comm": {"torch", "cupy"}, "fsdp_memory": {"torch"}}


def _package_dirs() -> dict[str, Path]:
    found = {}
    for src in sorted(ROOT.glob("packages/*/src/*")):
        if src.is_dir() and (src / "__init__.py").exists():
            found[src.name] = src
    return found


def _imported_top_levels(pkg_dir: Path) -> dict[str, set[str]]:
    """Top-level module names imported anywhere in the package, with the files doing it."""
    seen: dict[str, set[str]] = {}
    for path in pkg_dir.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                seen.setdefault(name.split(".")[0], set()).add(path.name)
    return seen


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layer_imports(package: str) -> None:
    dirs = _package_dirs()
    if package not in dirs:
        pytest.skip(f"{package} is not in the tree yet")
    imported = _imported_top_levels(dirs[package])
    forbidden = {
        m: files
        for m, files in imported.items()
        if m in OURS and m != package and m not in ALLOWED[package]
    }
    assert not forbidden, f"{package} imports {forbidden}; allowed: {ALLOWED[package] or 'none'}"


@pytest.mark.parametrize("package", sorted(THIRD_PARTY_ALLOWED))
def test_bottom_layers_depend_only_on_torch(package: str) -> None:
    dirs = _package_dirs()
    if package not in dirs:
        pytest.skip(f"{package} is not in the tree yet")
    import sys

    stdlib = set(sys.stdlib_module_names)
    imported = set(_imported_top_levels(dirs[package])) - stdlib - {package, "__future__"}
    assert imported <= THIRD_PARTY_ALLOWED[package], imported
    pyproject = tomllib.loads((dirs[package].parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["dependencies"] == ["torch>=2.11"]


def test_every_package_ships_py_typed_and_all() -> None:
    for name, pkg_dir in _package_dirs().items():
        assert (pkg_dir / "py.typed").exists(), name
        tree = ast.parse((pkg_dir / "__init__.py").read_text())
        assigned = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        assert "__all__" in assigned, f"{name}/__init__.py lists no __all__"


# The umbrella's subpackages (issue #29): subpackage -> the subpackages it may import at runtime
# (imports under ``if TYPE_CHECKING:`` are annotations only and not counted). The top-level
# modules (``__init__``, ``__main__``, the ``fsdp`` command in ``_cli``) may import any.
UMBRELLA_ALLOWED = {
    "models": set(),
    "plan": {"models"},
    "hf": set(),
    "train": {"models", "hf"},
    "bench": {"models"},
    "integrations": set(),
}


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module, less those under ``if TYPE_CHECKING:``."""
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped
    ]


def _umbrella_subpackages_imported(path: Path, umbrella: Path) -> set[str]:
    """The umbrella subpackages a module of ``umbrella/<sub>/`` imports (absolute or relative)."""
    here = path.relative_to(umbrella).parts
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            dotted = [a.name.split(".") for a in node.names]
        elif node.level == 0:
            dotted = [(node.module or "").split(".")]
        else:  # relative: resolve against this module's package, then add the imported names
            base = list(here[:-1])[: len(here) - node.level]
            module = base + (node.module.split(".") if node.module else [])
            dotted = [["fsdp", *module, a.name] for a in node.names]
        for parts in dotted:
            if len(parts) > 1 and parts[0] == "fsdp" and parts[1] in UMBRELLA_ALLOWED:
                found.add(parts[1])
    return found


def test_umbrella_subpackages_layering() -> None:
    umbrella = ROOT / "src" / "fsdp"
    subpackages = {p.name for p in umbrella.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(UMBRELLA_ALLOWED), "a subpackage of fsdp is missing from the rule"
    for sub, allowed in UMBRELLA_ALLOWED.items():
        for path in sorted((umbrella / sub).rglob("*.py")):
            imported = _umbrella_subpackages_imported(path, umbrella) - {sub}
            assert imported <= allowed, (
                f"{path.relative_to(ROOT)} imports fsdp.{sorted(imported - allowed)}; "
                f"fsdp.{sub} may import {sorted(allowed) or 'no other subpackage'}"
            )
        tree = ast.parse((umbrella / sub / "__init__.py").read_text())
        assert any(
            isinstance(t, ast.Name) and t.id == "__all__"
            for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        ), f"fsdp/{sub}/__init__.py lists no __all__"
