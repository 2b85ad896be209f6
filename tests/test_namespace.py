"""One import namespace, m3run: the wheel installs `m3run/` and nothing else at the top level,
and m3run works from a working directory whose own `model.py`, `runner/` and `kernels/` would
shadow packages of those names (the commonest names in ML code)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.runs import REPO, tiny_run_overrides

# The folders that install as m3run's subpackages.
FOLDERS = ("model", "kernels", "runner")


def _tree_files() -> set[str]:
    """Every file the wheel must carry, as its path inside the wheel."""
    files = {"m3run/__init__.py", "m3run/kernels/mamba3/README.md"}
    files |= {f"m3run/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.add(f"m3run/{path.relative_to(REPO).as_posix()}")
    return files


@pytest.mark.slow
def test_the_wheel_holds_m3run_alone_with_every_module_of_the_tree(tmp_path):
    # Built from a copy: setuptools writes its build/ folder beside the sources.
    src = tmp_path / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("m3run", "configs", *FOLDERS):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            "--quiet",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("m3run-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"m3run"}, sorted(top)
    assert len(dist_info) == 1
    missing = _tree_files() - set(names)
    assert not missing, f"pyproject.toml's packages leave out {sorted(missing)[:5]}"
    entry = zipfile.ZipFile(wheel).read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "m3run = m3run.runner.cli:app" in entry

    # Installed as the image installs it (not editable), it runs from the install alone.
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
    installed = subprocess.run(
        [*pip, "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300
    )
    assert installed.returncode == 0, installed.stderr
    env = {**_env(), "PYTHONPATH": str(site)}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    code = "import m3run, m3run.runner.cli, m3run.model.lm, m3run.kernels; print(m3run.__file__)"
    where = subprocess.run([sys.executable, "-c", code], **run)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).parent == site / "m3run"
    shown = subprocess.run([sys.executable, "-m", "m3run.runner.cli", "--help"], **run)
    assert shown.returncode == 0 and "launch" in shown.stdout, shown.stderr
    # The demo finds its recipe in the install, with no checkout (the container image).
    code = "from m3run.runner.demo import demo_config; print(demo_config())"
    recipe = subprocess.run([sys.executable, "-c", code], **run)
    assert recipe.returncode == 0, recipe.stderr
    assert Path(recipe.stdout.strip()) == site / "m3run" / "configs" / "demo_cpu.yaml"


def _shadowing_dir(root: Path) -> Path:
    """A working directory holding a user's own `model.py`, `runner/` and `kernels/`, each of
    which fails loudly if anything imports it."""
    root.mkdir()
    (root / "model.py").write_text('raise ImportError("the user\'s own model.py was imported")\n')
    for name in ("runner", "kernels"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(
            f'raise ImportError("the user\'s own {name}/ package was imported")\n'
        )
    return root


def _env() -> dict[str, str]:
    """The environment without PYTHONPATH: m3run is found as installed, not via the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "M3RUN_FAULT")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _m3run() -> str:
    script = Path(sys.executable).with_name("m3run")
    assert script.exists(), f"no m3run console script beside {sys.executable}"
    return str(script)


def test_m3run_imports_beside_a_users_model_runner_and_kernels(tmp_path):
    cwd = _shadowing_dir(tmp_path / "work")
    run = dict(cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)
    # The user's own modules stay importable under their names, and ours under m3run.
    code = (
        "from m3run.model import Mamba3LM\n"
        "import m3run.kernels.mamba3, m3run.runner.cli\n"
        "try:\n"
        "    import model\n"
        "except ImportError as e:\n"
        "    print('user:', e)\n"
        "print(Mamba3LM.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], **run)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "user: the user's own model.py was imported",
        "m3run.model.lm",
    ]
    shown = subprocess.run([_m3run(), "--help"], **run)
    assert shown.returncode == 0, shown.stderr
    assert "launch" in shown.stdout and "status" in shown.stdout


@pytest.mark.slow
def test_m3run_train_runs_from_a_directory_that_shadows_its_old_names(tmp_path, corpus):
    cwd = _shadowing_dir(tmp_path / "work")
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 3, "checkpoint.interval_steps": 3})
    argv = [
        _m3run(),
        "train",
        str(REPO / "configs" / "demo_cpu.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    for kv in sets:
        argv += ["--set", kv]
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000003" / "meta.json").exists()
