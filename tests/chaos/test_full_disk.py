"""A run dir on a disk that fills up mid-run: the run ends with a protocol exit code the deploy
recipes halt on, one clear line naming the path and the errno, no traceback, and a state.json
that does not claim a dead supervisor is still running."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.launching import Run, overrides

from m3run.runner.protocol import EXIT_CONFIG, EXIT_SOFTWARE, EXIT_STOPPED, STATE_FILE

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for the run's first checkpoints, not for all of them."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"this machine does not let the tests mount a tmpfs: {done.stderr!r}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_disk_that_fills_mid_run_ends_cleanly(corpus, small_disk):
    run_dir = small_disk / "run"
    sets = overrides(
        corpus,
        **{
            "train.total_steps": 400,
            "checkpoint.interval_steps": 2,
            "checkpoint.keep_last": 50,
            "log.interval_steps": 1,
        },
    )
    run = Run(run_dir, sets)
    code = run.wait(timeout=240)
    out = run.output()
    assert code in (EXIT_SOFTWARE, EXIT_STOPPED, EXIT_CONFIG), out
    assert "Traceback" not in out, out
    assert "ENOSPC" in out, out
    text = (run_dir / STATE_FILE).read_text()
    state = json.loads(text)
    assert state["phase"] not in ("preflight", "running", "restarting", "stopping"), state
