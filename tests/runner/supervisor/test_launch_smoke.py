"""The preflight smoke test runs when it can tell something new: the first launch, a changed
config, another device, or `--smoke`; an unchanged relaunch on the same device skips it and
says so. A smoke test that runs has the first worker start beside it as a warm spare, and
`m3run status` names the check it runs."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import psutil
import pytest
from helpers.launching import Run, overrides
from helpers.run_dirs import invoke

from m3run.runner.checkpoint.layout import DATA_FILES, list_checkpoints
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_OK,
    SMOKE_FILE,
    SMOKE_PROGRESS_FILE,
    SmokeProgress,
    SmokeVerdict,
    StopSaveFigures,
)
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
        **{
            "train.total_steps": 4,
            "checkpoint.interval_steps": 2,
            "supervisor.smoke": "true",
            "supervisor.warm_spare": "true",
        },
    )
    # The relaunch replays from step 2: a finished run's relaunch starts nothing.
    for extra in ((), ("--resume", "2")):
        run = Run(run_dir, sets, *extra)
        assert run.wait() == EXIT_OK, run.output()
    first, second = _smoke_events(run_dir)
    assert "ran: first launch" in first
    assert second.startswith("skipped: it passed for this config on host:"), second
    assert "--smoke" in second
    assert _first_workers(run_dir) == [True, False]
    # What the smoke test said a full checkpoint of this run weighs is what the run wrote.
    figures = SmokeVerdict.from_dict(read_json(run_dir / SMOKE_FILE)).stop_save
    for ckpt in list_checkpoints(run_dir):
        written = sum((ckpt.path / name).stat().st_size for name in DATA_FILES)
        assert abs(figures.checkpoint_bytes - written) < 0.05 * written, (figures, written)


def test_smoke_runs_again_on_request_another_config_data_or_device():
    smoke, forced = SmokeTest(Path("config.yaml")), SmokeTest(Path("config.yaml"), always=True)
    passed = {"config_hash": "h1", "device": "GPU-a", "data": "d1", "time": 0.0}
    assert smoke.reason_to_run(passed, "h1", "GPU-a", "d1") is None
    assert forced.reason_to_run(passed, "h1", "GPU-a", "d1") == "--smoke was given"
    assert smoke.reason_to_run(None, "h1", "GPU-a", "d1") == "first launch of this run dir"
    assert "config changed" in smoke.reason_to_run(passed, "h2", "GPU-a", "d1")
    assert "data changed" in smoke.reason_to_run(passed, "h1", "GPU-a", "d2")
    # A record from before the data was fingerprinted: checked once more.
    old = {"config_hash": "h1", "device": "GPU-a", "time": 0.0}
    assert "data changed" in smoke.reason_to_run(old, "h1", "GPU-a", "d1")
    assert "another device (GPU-b; the last smoke test passed on GPU-a)" in smoke.reason_to_run(
        passed, "h1", "GPU-b", "d1"
    )


def test_a_smoke_verdict_written_before_the_stop_save_figures_still_reads():
    old = {"ok": True, "message": "6 checks passed, 2 skipped", "checks": []}
    verdict = SmokeVerdict.from_dict(old)
    assert verdict is not None and verdict.ok and verdict.stop_save is None
    figures = StopSaveFigures(checkpoint_bytes=5_220_000_000, write_bytes_per_s=4.7e8)
    new = SmokeVerdict(ok=True, message="ok", stop_save=figures)
    assert SmokeVerdict.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    # A damaged figure reads as none measured, never as a crash or a zero speed.
    for bad in ({"checkpoint_bytes": "5 GB", "write_bytes_per_s": 4.7e8}, {"write_bytes_per_s": 0}):
        assert SmokeVerdict.from_dict({**old, "stop_save": bad}).stop_save is None


def test_data_prepared_again_under_the_same_paths_is_smoke_tested_again(corpus, tmp_path):
    """The observed trap: data re-prepared after a failed first eval, and the relaunch skipped
    the smoke test because the config (its paths) had not changed."""
    from helpers.runs import DEMO_CONFIG, tiny_run_overrides

    from m3run.runner.config import load_config
    from m3run.runner.data.prepare import prepare_data

    data = tmp_path / "data"
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x\n\n" * 400, encoding="utf-8")

    def prepare(fraction: float) -> None:
        prepare_data(
            [str(text)],
            data,
            tokenizer=str(corpus / "tokenizer.json"),
            val_fraction=fraction,
            val_split="tail",
            progress=False,
        )

    prepare(0.01)
    config = tmp_path / "config.yaml"
    config.write_text(load_config(DEMO_CONFIG, tiny_run_overrides(data)).to_yaml())
    smoke = SmokeTest(config)
    before = smoke.data_fingerprint()
    assert before is not None and before == smoke.data_fingerprint()
    passed = {"config_hash": "h1", "device": "host:a", "data": before, "time": 0.0}
    assert smoke.reason_to_run(passed, "h1", "host:a", smoke.data_fingerprint()) is None
    prepare(0.2)  # a larger val split, same paths, same config
    after = smoke.data_fingerprint()
    assert after != before
    assert "data changed" in smoke.reason_to_run(passed, "h1", "host:a", after)


@pytest.mark.slow
def test_status_during_the_smoke_test_shows_the_check_that_runs(corpus, tmp_path):
    """The smoke child is frozen (SIGSTOP) once it has started a check: the supervisor has
    copied that check into state.json and `m3run status` names it instead of an empty step and
    a heartbeat allowance. Once it goes on, the run trains and the check is cleared."""
    run_dir = tmp_path / "run"
    run = Run(run_dir, overrides(corpus, **{"train.total_steps": 2, "supervisor.smoke": "true"}))
    progress_file = run_dir / SMOKE_PROGRESS_FILE

    def smoke_child():
        for child in psutil.Process(run.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "m3run.runner.worker.smoke" in child.cmdline():
                    return child
        return None

    child = run.wait_for(smoke_child, "the smoke test's process", poll_s=0.001)
    run.wait_for(progress_file.exists, "the smoke test's first check", poll_s=0.0005)
    child.send_signal(signal.SIGSTOP)
    try:
        # A signal sent is not yet a process stopped: it may start one more check before.
        run.wait_for(lambda: child.status() == psutil.STATUS_STOPPED, "the smoke test to stop")
        running = SmokeProgress.from_dict(read_json(progress_file))
        run.wait_for(
            lambda: run.state().get("preflight_check") == running.to_dict(),
            "the supervisor to record the check",
        )
        shown = invoke("status", run_dir, "--no-gpu")
        as_json = json.loads(invoke("status", run_dir, "--no-gpu", "--json").output)
    finally:
        child.send_signal(signal.SIGCONT)
    assert shown.exit_code == 0, shown.output
    assert (
        f"preflight  smoke test check {running.number}/8: {running.name} (running" in shown.output
    ), shown.output
    assert "heartbeat" not in shown.output and "step       -/-" not in shown.output
    assert as_json["preflight_check"]["name"] == running.name
    assert run.wait() == EXIT_OK, run.output()
    assert run.state()["preflight_check"] is None and not progress_file.exists()
