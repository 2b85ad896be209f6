"""The demo from any working directory, with --set passed on to its launch; its last lines: the
commands to try next, and how to reach `m3run` when the shell's PATH does not have it (after
`make demo`, the venv's bin/ is not on it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import REPO, tiny_run_overrides, worker_env

BIN = Path(sys.executable).parent
SHOW = "from m3run.runner.demo import next_steps; print(next_steps())"


def _next_steps(path: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SHOW], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the venv: the hint shows absolute paths."""
    return tmp_path


def test_the_demo_ends_with_the_next_commands_and_how_to_put_m3run_on_path(elsewhere):
    if not (BIN / "m3run").is_file() or not (BIN / "activate").is_file():
        pytest.skip(f"{BIN} is not a venv with the m3run console script")
    shown = _next_steps("/usr/bin:/bin", elsewhere)
    for command in ("m3run status runs/demo", "m3run logs runs/demo", "m3run plot runs/demo"):
        assert command in shown
    assert 'm3run generate runs/demo --prompt "def main("' in shown
    assert (
        f"m3run is not on your PATH: `source {BIN / 'activate'}` puts it there "
        f"(or call {BIN / 'm3run'})"
    ) in shown
    # Below the working directory (`make demo` runs from the folder that holds .venv), the
    # paths are shown relative to it.
    near = _next_steps("/usr/bin:/bin", BIN.parent)
    assert f"`source {BIN.name}/activate` puts it there (or call {BIN.name}/m3run)" in near


def test_no_path_hint_when_m3run_on_path_is_this_one(elsewhere):
    if not (BIN / "m3run").is_file():
        pytest.skip(f"no m3run console script beside {sys.executable}")
    shown = _next_steps(f"{BIN}:/usr/bin:/bin", elsewhere)
    assert "m3run status runs/demo" in shown and "not on your PATH" not in shown


@pytest.mark.slow
def test_the_demo_trains_from_any_directory_with_its_overrides(tmp_path, corpus):
    work = tmp_path / "work"
    data = work / "runs" / "demo-data"
    shutil.copytree(corpus, data)  # prepared already: the demo goes straight to the launch
    sets = tiny_run_overrides(data, **{"train.total_steps": 4, "checkpoint.interval_steps": 4})
    argv = [sys.executable, "-m", "m3run.runner.demo", *(a for kv in sets for a in ("--set", kv))]
    done = subprocess.run(
        argv, cwd=work, env=worker_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (work / "runs" / "demo" / "checkpoints" / "step_00000004" / "meta.json").exists()
    assert "sample from step 4 (prompt 'def main(')" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith(("  m3run list", "m3run is not"))
