"""The shape of the code, checked: the torch-free side stays torch-free, the supervisor and the
worker never import each other, no two project modules import each other (directly or round a
loop), and no file or class outgrows the size the design allows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import REPO

PACKAGES = ("runner", "model", "kernels")
# Every module of these runs in the supervisor process or the light CLI commands: importing
# any of them must not import torch (a CUDA fault in the worker must not reach them, and they
# start in milliseconds).
TORCH_FREE = (
    "m3run.runner.supervisor",
    "m3run.runner.health",
    "m3run.runner.protocol",
    "m3run.runner.files",
    "m3run.runner.procs",
    "m3run.runner.config",
    "m3run.runner.runstate",
    "m3run.runner.cli",
    "m3run.runner.plot",
    "m3run.runner.checkpoint.layout",
)
MAX_FILE_LINES = 900
MAX_CLASS_LINES = 500


def _module_name(path: Path) -> str:
    """A file's import name: the folders model/, kernels/ and runner/ are m3run's packages."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["m3run", *parts])


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((REPO / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules `name` imports anywhere in its body (lazy imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` binds a module; keep the longest prefix that is a project module.
            parts = target.split(".")
            while parts and ".".join(parts) not in MODULES:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_torch_free_side_never_imports_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        f"roots = {list(TORCH_FREE)!r}\n"
        "names = []\n"
        "for root in roots:\n"
        "    mod = importlib.import_module(root)\n"
        "    names.append(root)\n"
        "    if hasattr(mod, '__path__'):\n"
        "        for info in pkgutil.walk_packages(mod.__path__, root + '.'):\n"
        "            importlib.import_module(info.name)\n"
        "            names.append(info.name)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "assert not leaked, f'importing the torch-free side imported {leaked[:5]}'\n"
        "print(len(names))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 20  # the walk reached the packages' modules


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        (
            "m3run.runner.supervisor",
            ("m3run.runner.worker", "m3run.runner.data.loader", "m3run.runner.checkpoint.io"),
        ),
        ("m3run.runner.worker", ("m3run.runner.supervisor", "m3run.runner.health")),
        ("m3run.runner.health", ("m3run.runner.worker", "m3run.runner.supervisor")),
        # Imports flow runner → model → kernels: the kernels, their launch plans and tools
        # included, stand alone.
        ("m3run.kernels", ("m3run.runner", "m3run.model")),
    ],
)
def test_process_sides_do_not_import_each_other(side, forbidden):
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if mod == side or mod.startswith(side + ".")
        for dep in deps
        if any(dep == f or dep.startswith(f + ".") for f in forbidden)
    )
    assert not bad, bad


def test_no_import_cycles_between_project_modules():
    # A package's own __init__ is a docstring: importing a submodule runs it, which is not an
    # edge worth counting, so parent packages are left out of the walk.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in GRAPH.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_no_file_or_class_outgrows_its_job():
    too_big = []
    for name, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_big.append(f"{name}: {lines} lines (max {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"{name}.{node.name}: {size} lines (max {MAX_CLASS_LINES})")
    assert not too_big, too_big


def test_the_walk_sees_the_layout():
    # Guards the checks above against walking nothing.
    for name in (
        "m3run.runner.supervisor.supervisor",
        "m3run.runner.protocol",
        "m3run.runner.checkpoint.io",
    ):
        assert name in MODULES
    assert "m3run.runner.protocol" in GRAPH["m3run.runner.supervisor.supervisor"]


def test_no_test_module_imports_another():
    tests = REPO / "tests"
    names = {p.stem for p in tests.rglob("test_*.py")} | {"conftest"}
    bad = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            bad += [f"{path.relative_to(REPO)} imports {t}" for t in targets if t in names]
    assert not bad, bad


def test_nothing_imports_the_folders_by_their_top_level_names():
    """m3run's packages are imported as m3run.model, m3run.kernels and m3run.runner: in a
    checkout the folders also import as top-level `model`, `kernels` and `runner`, which would
    load a second copy of each module (and installs nothing of the kind)."""
    bad = []
    for folder in (*PACKAGES, "tests", "bench", "m3run"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                bad += [
                    f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in PACKAGES
                ]
    assert not bad, bad
