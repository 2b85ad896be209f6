"""The preflight smoke test runs when it can tell something new: the first launch, a changed
config, another device, or `--smoke`; an unchanged relaunch on the same device skips it and
says so. A smoke test that runs has the first worker start beside it as a warm spare."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.launching import Run, overrides

from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EVENTS_FILE, EXIT_OK
from m3run.runner.supervisor.preflight import SmokeTest


def _smoke_events(run_dir) -> list[str]:
    return [e["reason"] for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "smoke"]


def _first_workers(run_dir) -> list[bool]:
    """Per launch, whether its first worker was a warm spare."""
    starts = [e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "worker_start"]
    return [e["warm_spare"] for e in starts if e["reason"] == "attempt 1"]


@pytest.mark.slow
def test_smoke_runs_on_first_launch_and_is_skipped_on_an_unchanged_relaunch(corpus, tmp_path):
    """With supervisor.warm_spare true, the launch whose smoke test runs hands its first worker
    to the spare started beside the test; the relaunch that skips it spawns a fresh worker."""
    run_dir = tmp_path / "run"
    sets = overrides(
        corpus,
        **{"train.total_steps": 4, "supervisor.smoke": "true", "supervisor.warm_spare": "true"},
    )
    for _ in range(2):
        run = Run(run_dir, sets)
        assert run.wait() == EXIT_OK, run.output()
    first, second = _smoke_events(run_dir)
    assert "ran: first launch" in first
    assert second.startswith("skipped: it passed for this config on host:"), second
    assert "--smoke" in second
    assert _first_workers(run_dir) == [True, False]


def test_smoke_runs_again_on_request_another_config_or_another_device():
    smoke, forced = SmokeTest(Path("config.yaml")), SmokeTest(Path("config.yaml"), always=True)
    passed = {"config_hash": "h1", "device": "GPU-a", "time": 0.0}
    assert smoke.reason_to_run(passed, "h1", "GPU-a") is None
    assert forced.reason_to_run(passed, "h1", "GPU-a") == "--smoke was given"
    assert smoke.reason_to_run(None, "h1", "GPU-a") == "first launch of this run dir"
    assert "config changed" in smoke.reason_to_run(passed, "h2", "GPU-a")
    assert "another device (GPU-b; the last smoke test passed on GPU-a)" in smoke.reason_to_run(
        passed, "h1", "GPU-b"
    )
