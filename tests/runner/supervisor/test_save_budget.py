"""At launch the supervisor says whether a save on a stop fits in the time the stop leaves: a
cloud's preemption notice (a fake metadata server on 127.0.0.1) or, without one, the stop grace;
from the write speed and checkpoint size a real smoke test measured in the run dir."""

from __future__ import annotations

import json

from helpers.metadata_server import FakeMetadataServer
from helpers.runs import DEMO_CONFIG, tiny_run_overrides, worker_env
from helpers.supervision import FakeGpu, argv_for, events_named, make_run, settings

from m3run.runner.config import load_config
from m3run.runner.files import atomic_write_json, read_json, read_jsonl
from m3run.runner.health.checks import Verdict
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_OK,
    SMOKE_FILE,
    STATE_FILE,
    SUPERVISOR_LOG,
    SmokeVerdict,
)
from m3run.runner.protocol import StopSaveFigures as Figures
from m3run.runner.supervisor.preflight import SmokeTest
from m3run.runner.supervisor.save_budget import launch_stop_save
from m3run.runner.supervisor.supervisor import Supervisor

# The 434m recipe's checkpoint (weights and AdamW moments) at about the speed measured on an
# H200 host's disk.
BIG = Figures(checkpoint_bytes=4979 * 2**20, write_bytes_per_s=470e6)


def test_the_launch_line_weighs_one_full_write_against_the_notice_or_the_grace():
    fits, line = launch_stop_save(BIG, "gcp", 5.0, 120.0)  # 5 s + 11.1 s of 22.5 s
    assert fits, line
    assert line == (
        "a save on a preemption notice takes about 16 s (the notice seen within 5 s, a step "
        "not yet timed, 4,979 MiB at the 470 MB/s the smoke test measured on this run dir's "
        "disk): it fits in the 30 s a gcp notice gives"
    )
    slow = Figures(BIG.checkpoint_bytes, 200e6)  # 26.1 s to write
    fits, line = launch_stop_save(slow, "gcp", 5.0, 120.0)
    assert not fits and "about 31 s" in line and "more than the 30 s a gcp notice gives" in line
    assert "Fix: put the run dir on faster local storage" in line
    assert "supervisor.preemption_poll_s" in line and "checkpoint.interval_steps" in line
    # AWS gives two minutes; without a provider, a stop gets the grace and no notice is polled.
    assert launch_stop_save(slow, "aws", 5.0, 120.0)[0]
    fits, line = launch_stop_save(slow, None, 5.0, 20.0)
    assert not fits and "about 26 s (a step not yet timed, 4,979 MiB" in line
    assert "more than the 20 s stop grace (supervisor.stop_grace_s)" in line
    assert "raise supervisor.stop_grace_s" in line and "preemption_poll_s" not in line
    assert launch_stop_save(slow, None, 5.0, 27.0)[0]


def _launch(run_dir, config, standin, smoke: bool = True, **over) -> list[dict]:
    """One launch of the stand-in worker after the real smoke test (run, or skipped when it
    passed before); the stop_save events of this launch."""
    sup = Supervisor(
        run_dir,
        # The real smoke test imports torch: a loaded machine takes longer than the stand-in's
        # startup allowance for it.
        settings(startup_timeout_s=300.0, **over),
        argv_for(standin, run_dir),
        config_hash="h1",
        gpu=FakeGpu([Verdict.NO_GPU]),
        smoke=SmokeTest(config) if smoke else None,
        env=worker_env(),
        handle_signals=False,
    )
    assert sup.run() == EXIT_OK
    events = read_jsonl(run_dir / EVENTS_FILE)
    start = max(i for i, e in enumerate(events) if e["event"] == "launch")
    return events_named(events[start:], "stop_save")


def test_the_launch_says_whether_a_save_on_a_stop_fits(corpus, tmp_path, standin):
    """The first launch runs the smoke test, with GCP's notices watched; the relaunches skip it
    and take its figures from the record of the test that passed: without a provider, with a
    stop grace too short, and with a poll that leaves too little of the notice."""
    config = tmp_path / "config.yaml"
    config.write_text(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)).to_yaml())
    run_dir = make_run(tmp_path, [{"steps": 2}])
    with FakeMetadataServer("gcp") as srv:
        (watched,) = _launch(
            run_dir,
            config,
            standin,
            preemption_provider="gcp",
            metadata_url=srv.base_url,
            preemption_poll_s=0.1,
        )
    figures = SmokeVerdict.from_dict(read_json(run_dir / SMOKE_FILE)).stop_save
    assert figures is not None and figures.checkpoint_bytes > 0 and figures.write_bytes_per_s > 0
    assert read_json(run_dir / STATE_FILE)["smoke_passed"]["stop_save"] == figures.to_dict()
    assert watched["fits"] and watched["provider"] == "gcp", watched
    assert watched["checkpoint_bytes"] == figures.checkpoint_bytes
    line = watched["reason"]
    assert line.startswith("a save on a preemption notice takes about "), line
    assert "the notice seen within 0.1 s" in line and "it fits in the 30 s a gcp notice" in line
    assert "MB/s the smoke test measured on this run dir's disk" in line

    (unwatched,) = _launch(run_dir, config, standin)  # provider "none", a stop grace of 2 s
    smoke = events_named(read_jsonl(run_dir / EVENTS_FILE), "smoke")
    assert [e["reason"].startswith("skipped") for e in smoke] == [False, True]
    assert unwatched["fits"] and unwatched["provider"] is None, unwatched
    assert unwatched["reason"].startswith("a save on a stop takes about ")
    assert "it fits in the 2 s stop grace (supervisor.stop_grace_s)" in unwatched["reason"]
    assert "notice" not in unwatched["reason"]

    (tight,) = _launch(run_dir, config, standin, stop_grace_s=1e-6)
    assert not tight["fits"], tight
    assert "more than the 1e-06 s stop grace (supervisor.stop_grace_s)" in tight["reason"]
    assert "Fix:" in tight["reason"] and "raise supervisor.stop_grace_s" in tight["reason"]
    logged = [json.loads(line) for line in (run_dir / SUPERVISOR_LOG).read_text().splitlines()]
    levels = [r["level"] for r in logged if r.get("event") == "stop_save"]
    assert levels == ["info", "info", "warning"], levels

    with FakeMetadataServer("gcp") as srv:  # a notice seen 25 s late leaves no time to save
        (late,) = _launch(
            run_dir,
            config,
            standin,
            preemption_provider="gcp",
            metadata_url=srv.base_url,
            preemption_poll_s=25.0,
        )
    assert not late["fits"] and "the notice seen within 25 s" in late["reason"], late
    assert "most of the 30 s a gcp notice gives" in late["reason"]
    assert "lower supervisor.preemption_poll_s" in late["reason"]


def test_without_measured_figures_the_launch_says_nothing(corpus, tmp_path, standin):
    """A passing record from before the figures were measured (an older m3run's) skips the
    smoke test as before and says nothing of a stop save; so does a launch without a smoke
    test."""
    config = tmp_path / "config.yaml"
    config.write_text(load_config(DEMO_CONFIG, tiny_run_overrides(corpus)).to_yaml())
    run_dir = make_run(tmp_path, [{"steps": 2}])
    assert len(_launch(run_dir, config, standin)) == 1
    state = read_json(run_dir / STATE_FILE)
    del state["smoke_passed"]["stop_save"]
    atomic_write_json(run_dir / STATE_FILE, state)
    assert _launch(run_dir, config, standin) == []
    assert events_named(read_jsonl(run_dir / EVENTS_FILE), "smoke")[-1]["reason"].startswith(
        "skipped"
    )
    assert _launch(run_dir, config, standin, smoke=False) == []
