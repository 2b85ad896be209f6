"""The preflight smoke test runs when it can tell something new: the first launch, a changed
config, another device, or `--smoke`; an unchanged relaunch on the same device skips it and
says so."""

from __future__ import annotations

import pytest
from helpers.launching import Run, overrides

from runner.files import read_jsonl
from runner.protocol import EVENTS_FILE, EXIT_OK

pytestmark = pytest.mark.slow


def _smoke_events(run_dir) -> list[str]:
    return [e["reason"] for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "smoke"]


def test_smoke_runs_on_first_launch_change_and_request_and_is_skipped_otherwise(corpus, tmp_path):
    run_dir = tmp_path / "run"
    sets = overrides(corpus, **{"train.total_steps": 4, "supervisor.smoke": "true"})

    def launch(*extra: str, changes: tuple[str, ...] = ()) -> str:
        run = Run(run_dir, [*sets, *changes], *extra)
        assert run.wait() == EXIT_OK, run.output()
        return _smoke_events(run_dir)[-1]

    assert "ran: first launch" in launch()
    skipped = launch()
    assert skipped.startswith("skipped: it passed for this config on host:"), skipped
    assert "--smoke" in skipped
    assert "ran: --smoke was given" in launch("--smoke")
    changed = launch("--force", changes=("train.total_steps=6",))
    assert "ran: the config changed since the last smoke test" in changed
    assert len(_smoke_events(run_dir)) == 4
