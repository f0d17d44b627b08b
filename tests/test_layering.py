"""Imports go down the layers: cli -> server -> engine -> model -> ops, the scheduler below the
engine. Every import counts: at module level, inside functions and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A package's folder, and the packages above it that it must not import.
FORBIDDEN = {
    "server": ("deepinfer.cli",),
    "deepinfer/engine": ("deepinfer.cli", "deepinfer.server"),
    "scheduler": ("deepinfer.cli", "deepinfer.server", "deepinfer.engine", "torch"),
    "ops": ("deepinfer.cli", "deepinfer.server", "deepinfer.engine"),
}


def _imported(path: Path) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append((node.lineno, node.module))
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_upward_imports(folder: str) -> None:
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in _imported(path)
        if any(name == above or name.startswith(f"{above}.") for above in FORBIDDEN[folder])
    ]
    assert upward == []
