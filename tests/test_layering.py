"""The rooms import one way: server -> engine -> model family -> ops, with the scheduler beside the
engine (torch-free), the KV cache below the model and the shared base (config, sampling params,
constraints, tokenizer) under everything. Read from the source, not from what happens to load:
every import counts, inside functions and under TYPE_CHECKING too; module-level imports must
not form a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Higher imports lower (or its own room); the package facade deepinfer/__init__.py re-exports
# lazily and is exempt.
RANKS = {
    "deepinfer.cli": 90,
    "deepinfer.bench": 85,
    "deepinfer.server": 80,
    "deepinfer.llm": 70,
    "deepinfer.engine": 60,
    "deepinfer.scheduler": 50,
    "deepinfer.model": 40,
    "deepinfer.kv_cache": 30,
    "deepinfer.parallel": 25,
    "deepinfer.ops": 20,
}
BASE = 0  # config, flags, device, logger, outputs, sampling_params, tokenizer, constraints
# A model family's package is known to the rest only through the family table and interface.
# A family may build on another family's modules (DeepSeek-V4.1 on V4's step plans and loader);
# everything else reaches a family through the table (deepinfer/model/families.py).
FAMILY_PACKAGES = ("deepinfer.model.deepseek_v4", "deepinfer.model.deepseek_v41")


def _modules() -> dict[str, Path]:
    """Module name -> file, for the deepinfer package and the packages mapped into it."""
    out = {}
    for top, prefix in (("deepinfer", "deepinfer"), ("ops", "deepinfer.ops")):
        out.update(_walk(ROOT / top, prefix))
    for top in ("scheduler", "server"):
        out.update(_walk(ROOT / top, f"deepinfer.{top}"))
    return out


def _walk(folder: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([prefix, *parts])] = path
    return out


def _room(module: str) -> str:
    for room in sorted(RANKS, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return "base"


def _rank(module: str) -> int:
    return RANKS.get(_room(module), BASE)


def _imports(module: str, path: Path) -> list[tuple[str, bool]]:
    """(imported deepinfer module, at module level and outside TYPE_CHECKING) for each import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            ) or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, False)
            elif isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.extend((f"{base}.{a.name}", top) for a in child.names)
                found.append((base, top))
            else:
                visit(child, top)

    visit(tree, True)
    return [(name, top) for name, top in found if name.startswith("deepinfer")]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` is (``from a.b import c``: a.b.c if a module, else a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges = []
        for name, top in _imports(module, path):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.append((target, top))
        graph[module] = edges
    return graph


def test_no_room_imports_upward() -> None:
    upward = []
    for module, edges in _graph().items():
        if module == "deepinfer":
            continue
        for target, _ in edges:
            if _rank(target) > _rank(module) and _room(target) != _room(module):
                upward.append(f"{module} -> {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(set(upward)))


def test_model_families_are_reached_only_through_the_table() -> None:
    def family_of(name: str) -> str | None:
        return next((f for f in FAMILY_PACKAGES if name == f or name.startswith(f + ".")), None)

    outside = []
    for module, edges in _graph().items():
        for target, _ in edges:
            if family_of(target) is not None and family_of(module) is None:
                outside.append(f"{module} -> {target}")
    assert not outside, "family internals imported from outside:\n" + "\n".join(outside)


def test_no_module_level_import_cycle() -> None:
    graph = {m: sorted({t for t, top in edges if top}) for m, edges in _graph().items()}
    # A package's __init__ importing its own submodules is not a cycle of theirs.
    cycles = [c for c in _cycles(graph) if len(c) > 1]
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each a cycle when it has several modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
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
            out.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_the_scheduler_and_the_family_table_load_no_torch() -> None:
    code = (
        "import sys, deepinfer.scheduler, deepinfer.scheduler.scheduler, "
        "deepinfer.scheduler.prefix_reuse, deepinfer.model.families; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_scheduler_never_imports_torch() -> None:
    # Not even inside a function: the scheduler runs where torch is not installed.
    torch_imports = []
    for module, path in _modules().items():
        if _room(module) == "deepinfer.scheduler":
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                torch_imports += [f"{module}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not torch_imports, torch_imports


def test_the_layering_check_sees_an_upward_import(tmp_path: Path) -> None:
    # The checker itself: a scheduler module importing the engine under TYPE_CHECKING is caught.
    path = tmp_path / "x.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from deepinfer.engine.llm_engine import LLMEngine\n"
    )
    imports = _imports("deepinfer.scheduler.x", path)
    [(name, top)] = [i for i in imports if i[0] == "deepinfer.engine.llm_engine"]
    assert _rank(name) > _rank("deepinfer.scheduler.x") and not top
