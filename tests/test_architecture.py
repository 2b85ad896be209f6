"""The shape of the code, checked: the torch-free side stays torch-free, imports flow one way
(runner → model → kernels), the supervisor and the worker never reach each other's code, no two
project modules import each other (directly or round a loop), and no file or class outgrows the
size the design allows.

An import arrow is any import statement anywhere in a module, inside functions and under
`if TYPE_CHECKING` too, and `importlib.import_module` of a constant project name: a lazy import
runs in the same process as an eager one, only later."""

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
    "m3run.runner.console",
    "m3run.runner.files",
    "m3run.runner.formatting",
    "m3run.runner.procs",
    "m3run.runner.config",
    "m3run.runner.runstate",
    "m3run.runner.cli",
    "m3run.runner.plot",
    "m3run.runner.checkpoint.layout",
    # generate and export check their arguments, the run and its tokenizer with these first
    "m3run.runner.trained",
    "m3run.runner.data.tokenizer_file",
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
        elif _imports_by_name(node):
            targets = [node.args[0].value]
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


def _imports_by_name(node: ast.AST) -> bool:
    """`importlib.import_module("m3run....")` (or a bare `import_module(...)`) of a constant."""
    if not (isinstance(node, ast.Call) and node.args):
        return False
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    return (
        called == "import_module"
        and isinstance(first, ast.Constant)
        and isinstance(first.value, str)
        and first.value.startswith("m3run.")
    )


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(mod: str, roots: tuple[str, ...]) -> bool:
    return any(mod == r or mod.startswith(r + ".") for r in roots)


def _reached(roots: tuple[str, ...]) -> dict[str, list[str]]:
    """Every project module that importing the modules under `roots` can import, directly or
    through others, each with the shortest chain of arrows that gets there."""
    starts = sorted(m for m in GRAPH if _within(m, roots))
    paths = {m: [m] for m in starts}
    queue = list(starts)
    while queue:
        mod = queue.pop(0)
        for dep in sorted(GRAPH[mod]):
            if dep not in paths:
                paths[dep] = [*paths[mod], dep]
                queue.append(dep)
    return paths


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


# What only the worker process runs: torch, the trainer, checkpoint loading, the batch stream.
WORKER_SIDE = ("m3run.runner.worker", "m3run.runner.checkpoint.io", "m3run.runner.data.loader")
# What only the supervisor process and the CLI run. The worker writes the run dir that runstate
# and the CLI read from outside and has no use for them: a helper it wants from there belongs in
# a shared module (protocol, files, formatting, checkpoint.layout), or the worker would start
# loading whatever those modules load, lazily, later, unseen.
OUTSIDE_THE_WORKER = (
    "m3run.runner.supervisor",
    "m3run.runner.health",
    "m3run.runner.runstate",
    "m3run.runner.stopping",
    "m3run.runner.cli",
)


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        (("m3run.kernels",), ("m3run.runner", "m3run.model")),
        (("m3run.model",), ("m3run.runner",)),
    ],
    ids=["kernels", "model"],
)
def test_imports_flow_one_way(side, forbidden):
    """runner → model → kernels. The arrows leaving each layer are checked one layer at a time:
    with every layer's own arrows pointing down, no chain of them can point up, and a chain
    model → kernels → runner is reported once, where it turns (the kernels rule)."""
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if _within(mod, side)
        for dep in deps
        if _within(dep, forbidden)
    )
    assert not bad, bad


@pytest.mark.parametrize(
    ("side", "forbidden"),
    [
        (("m3run.runner.worker",), OUTSIDE_THE_WORKER),
        (("m3run.runner.supervisor",), WORKER_SIDE),
        (("m3run.runner.health",), (*WORKER_SIDE, "m3run.runner.supervisor")),
    ],
    ids=["worker", "supervisor", "health"],
)
def test_process_sides_never_reach_each_other(side, forbidden):
    """A process side is everything its modules import, through any shared module and any
    lazy import: the worker must not load the supervisor's code by way of a helper that
    happens to sit in a module the CLI also uses."""
    bad = sorted(
        " -> ".join(path) for mod, path in _reached(side).items() if _within(mod, forbidden)
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
    # model/__init__ imports the LM only inside a function: lazy arrows are walked too.
    assert "m3run.model.lm" in GRAPH["m3run.model"]


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
