"""The supervisor against stand-in workers: small scripts that follow the worker protocol
(heartbeat.json, checkpoints/, exit codes, SIGTERM → save → 75) and misbehave on cue. The
supervisor is what is under test; the real worker is exercised by tests/chaos/."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.supervision import (
    FakeGpu,
    argv_for,
    attempts,
    events_named,
    hold_lock,
    make_run,
    settings,
    spawn_driver,
    supervise,
    unrelated_process,
    wait_for,
)

from m3run.runner.checkpoint.layout import (
    META_FILE,
    VERIFIED_FILE,
    checkpoint_dir,
    list_checkpoints,
)
from m3run.runner.files import read_json, read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
    FAULT_ENV,
    FAULT_SCOPE_ENV,
    STATE_FILE,
    WORKER_LOCK_FILE,
    WORKER_LOG,
    Heartbeat,
    SupervisorPhase,
)
from m3run.runner.supervisor.checkpoints import CheckpointTracker
from m3run.runner.supervisor.hang import HangDetector
from m3run.runner.supervisor.launch import LaunchError, RunLock
from m3run.runner.supervisor.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- outcomes


def test_finished_run_exits_0_and_records_state(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 4, "ckpt_every": 2}])
    code, state, events = supervise(run_dir, standin)
    assert code == EXIT_OK
    assert state["phase"] == SupervisorPhase.FINISHED
    assert state["supervisor_pid"] == os.getpid()
    assert state["worker_pid"] is None and state["restarts"] == []
    assert state["last_checkpoint_step"] == 4
    assert [e["event"] for e in events][:2] == ["launch", "worker_start"]
    assert {e["step"] for e in events_named(events, "checkpoint")} == {2, 4}
    assert events[-1]["event"] == "finished"
    # The worker's output is appended to worker.log with an attempt header.
    log = (run_dir / WORKER_LOG).read_text()
    assert "worker attempt 1" in log and "step 4" in log
    for key in (
        "supervisor_create_time",
        "config_hash",
        "started_at",
        "updated_at",
        "peak_vram_bytes",
        "heartbeat_timeout_s",
        "last_exit",
        "reason",
    ):
        assert key in state


def test_crash_is_restarted_from_latest_checkpoint(tmp_path, standin):
    run_dir = make_run(
        tmp_path, [{"steps": 3, "ckpt_every": 2, "exit": 1}, {"steps": 2, "exit": 0}]
    )
    code, state, events = supervise(run_dir, standin)
    assert code == EXIT_OK and state["phase"] == SupervisorPhase.FINISHED
    assert [a["resume"] for a in attempts(run_dir)] == ["latest", "latest"]
    (restart,) = state["restarts"]
    assert restart["exit_code"] == 1 and "crashed (exit 1)" in restart["reason"]
    assert restart["resume_step"] == 2
    assert restart["backoff_s"] == 0.0  # the first restart since a new checkpoint: at once
    assert events_named(events, "restart")[0]["kind"] == "crash"
    assert all(e["settle_s"] >= 0 for e in events_named(events, "worker_exit"))
    # The supervisor recorded its hash check of step 2 before the restart: the record a
    # restarted worker trusts instead of hashing the files again.
    record = json.loads((checkpoint_dir(run_dir, 2) / VERIFIED_FILE).read_text())
    meta = json.loads((checkpoint_dir(run_dir, 2) / META_FILE).read_text())
    assert {n: r["sha256"] for n, r in record["files"].items()} == {
        n: r["sha256"] for n, r in meta["files"].items()
    }


def test_the_backoff_counts_from_the_exit_so_a_slow_checkpoint_check_is_part_of_it(
    tmp_path, standin, monkeypatch
):
    """The supervisor's hash of what the dead worker left (1.5 s here, made slow on purpose)
    overlaps the 2 s backoff instead of being added to it (the second crash in a row without a
    new checkpoint: the first restart is immediate)."""
    settle = CheckpointTracker.settle

    def slow_settle(self):
        time.sleep(1.5)
        return settle(self)

    monkeypatch.setattr(CheckpointTracker, "settle", slow_settle)
    run_dir = make_run(
        tmp_path, [{"steps": 1, "exit": 1}, {"steps": 1, "exit": 1}, {"steps": 1, "exit": 0}]
    )
    code, _, events = supervise(run_dir, standin, backoff_initial_s=2.0, backoff_max_s=2.0)
    assert code == EXIT_OK
    first, restart = events_named(events, "restart")
    assert first["backoff_s"] == 0.0
    assert restart["backoff_s"] == 2.0 and restart["wait_s"] < 1.0
    exited, started = (
        events_named(events, "worker_exit")[1],
        events_named(events, "worker_start")[2],
    )
    # the exit event comes after the settle; from there only the rest of the backoff (0.5 s) is
    # waited, where a backoff added after the settle would wait all 2 s of it
    assert started["time"] - exited["time"] < 2.0


def test_always_crashing_worker_backs_off_then_exits_70(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 3}])
    code, state, events = supervise(run_dir, standin, no_progress_restarts=3)
    assert code == EXIT_SOFTWARE
    assert state["phase"] == SupervisorPhase.FAILED
    assert "no progress: 3 restarts in a row without a new complete checkpoint" in state["reason"]
    assert "supervisor.no_progress_restarts=3" in state["reason"]
    assert len(attempts(run_dir)) == 4
    # At once, then exponential backoff: 0.05, 0.1 (capped at 0.4).
    assert [r["backoff_s"] for r in state["restarts"]] == pytest.approx([0.0, 0.05, 0.1])
    assert events[-1]["event"] == "failed" and events[-1]["exit_code"] == EXIT_SOFTWARE


def test_restart_budget_per_window(tmp_path, standin):
    # Each attempt makes progress (a new checkpoint) and then crashes: only the budget stops it.
    run_dir = make_run(tmp_path, [{"steps": 2, "ckpt_every": 1, "exit": 1}])
    code, state, _ = supervise(run_dir, standin, max_restarts=2, restart_window_s=60.0)
    assert code == EXIT_SOFTWARE
    assert "restart budget spent: 2 restarts in the last 60s" in state["reason"]
    assert "supervisor.max_restarts=2" in state["reason"]
    assert len(attempts(run_dir)) == 3
    # Progress resets the backoff: every restart was immediate.
    assert [r["backoff_s"] for r in state["restarts"]] == [0.0, 0.0]


def test_bad_config_exit_78_is_never_restarted(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 0, "exit": EXIT_CONFIG}])
    code, state, _ = supervise(run_dir, standin)
    assert code == EXIT_CONFIG
    assert state["phase"] == SupervisorPhase.FAILED and "bad config or data" in state["reason"]
    assert len(attempts(run_dir)) == 1 and state["restarts"] == []


def test_nan_exit_rolls_back_past_latest_checkpoint_with_lower_lr(tmp_path, standin):
    run_dir = make_run(
        tmp_path,
        [
            {"steps": 6, "ckpt_every": 2, "exit": 76},
            {"steps": 1, "exit": 1},  # crashes before saving
            {"steps": 2, "ckpt_every": 1, "exit": 1},  # saves 5, 6
            {"steps": 1, "exit": 0},
        ],
    )
    code, state, events = supervise(run_dir, standin, nan_lr_factor=0.5)
    assert code == EXIT_OK
    runs = [(a["resume"], a["lr_scale"]) for a in attempts(run_dir)]
    # Latest was 6: the rollback goes to 4 with the LR halved.
    assert runs[1] == ("4", 0.5)
    # The crash restart must not jump back onto the suspect step-6 checkpoint, and step 4
    # predates the cut, so the cut is passed again.
    assert runs[2] == ("4", 0.5)
    # The new step-6 checkpoint was written under the cut and carries it: scale 1.0 on top.
    assert runs[3] == ("6", 1.0)
    rollback = events_named(events, "rollback")[0]
    assert "rolling back past checkpoint 6 to 4" in rollback["reason"]
    assert state["restarts"][0]["kind"] == "nan" and state["restarts"][0]["resume_step"] == 4


def test_consecutive_nan_exits_compound_the_lr_cut(tmp_path, standin):
    run_dir = make_run(
        tmp_path,
        [
            {"steps": 4, "ckpt_every": 1, "exit": 76},
            {"steps": 0, "exit": 76},
            {"steps": 0, "exit": 0},
        ],
    )
    code, _, _ = supervise(run_dir, standin, nan_lr_factor=0.5)
    assert code == EXIT_OK
    runs = [(a["resume"], a["lr_scale"]) for a in attempts(run_dir)]
    assert runs[1:] == [("3", 0.5), ("2", 0.25)]


def test_a_nan_cut_is_not_applied_twice_to_a_checkpoint_written_under_it(tmp_path, standin):
    run_dir = make_run(
        tmp_path,
        [
            {"steps": 4, "ckpt_every": 1, "exit": 76},  # saves 1-4 at scale 1
            {"steps": 2, "ckpt_every": 1, "exit": 76},  # from 3: saves 4, 5 at scale 0.5
            {"steps": 1, "ckpt_every": 1, "exit": 0},  # from 4: saves 5
        ],
    )
    code, _, _ = supervise(run_dir, standin, nan_lr_factor=0.5)
    assert code == EXIT_OK
    runs = [(a["resume"], a["lr_scale"]) for a in attempts(run_dir)]
    # Step 4 was written at 0.5 already: halving again needs × 0.5 on top, not × 0.25.
    assert runs[1:] == [("3", 0.5), ("4", 0.5)]
    meta = json.loads((run_dir / "checkpoints" / "step_00000005" / "meta.json").read_text())
    assert meta["lr_scale"] == 0.25


def test_explicit_resume_step_is_kept_across_restarts(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 6, "ckpt_every": 2, "exit": 0}])
    assert supervise(run_dir, standin)[0] == EXIT_OK  # checkpoints 2, 4, 6
    (run_dir / "attempts.jsonl").unlink()
    # Branch from step 2; the worker crashes before saving: the restart must use 2, not 6.
    code, _, _ = supervise(run_dir, standin, [{"steps": 1, "exit": 1}, {"steps": 1}], resume="2")
    assert code == EXIT_OK
    assert [a["resume"] for a in attempts(run_dir)] == ["2", "2"]


def test_fault_scope_first_only_reaches_the_first_worker(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 1}, {"steps": 1}])
    env = {**os.environ, FAULT_ENV: "crash_at_step=1", FAULT_SCOPE_ENV: "first"}
    assert supervise(run_dir, standin, env=env)[0] == EXIT_OK
    assert [a["fault"] for a in attempts(run_dir)] == ["crash_at_step=1", None]


# --------------------------------------------------------------------------- hangs


def test_hung_worker_is_killed_and_restarted(tmp_path, standin):
    # Hangs at step 3 and ignores SIGTERM: the supervisor must SIGKILL after the grace.
    run_dir = make_run(
        tmp_path, [{"steps": 10, "hang_at": 3, "ignore_term": True, "ckpt_every": 2}, {"steps": 2}]
    )
    t0 = time.monotonic()
    code, state, events = supervise(run_dir, standin, heartbeat_timeout_s=1.0, stop_grace_s=0.5)
    assert code == EXIT_OK
    assert time.monotonic() - t0 < 10
    (restart,) = state["restarts"]
    assert restart["kind"] == "hang" and restart["exit_code"] == -signal.SIGKILL
    assert "no heartbeat for" in restart["reason"] and "worker phase training" in restart["reason"]
    assert restart["resume_step"] == 2
    assert (
        not psutil.pid_exists(attempts(run_dir)[0]["pid"])
        or psutil.Process(attempts(run_dir)[0]["pid"]).status() == psutil.STATUS_ZOMBIE
    )
    assert events_named(events, "hang")[0]["allowance_s"] == 1.0


def test_worker_hanging_after_it_finished_counts_as_finished(tmp_path, standin):
    run_dir = make_run(
        tmp_path, [{"steps": 2, "ckpt_every": 2, "hang_on_exit": True, "ignore_term": True}]
    )
    code, state, events = supervise(run_dir, standin, stop_grace_s=0.5)
    assert code == EXIT_OK and state["phase"] == SupervisorPhase.FINISHED
    assert state["restarts"] == [] and len(attempts(run_dir)) == 1
    assert "had reached phase 'finished'" in events_named(events, "hang_on_exit")[0]["reason"]


def test_worker_without_heartbeat_hits_the_startup_timeout(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"no_heartbeat": True}, {"steps": 1}])
    code, state, _ = supervise(run_dir, standin, startup_timeout_s=1.0, stop_grace_s=0.3)
    assert code == EXIT_OK
    (restart,) = state["restarts"]
    assert "no heartbeat yet" in restart["reason"] and "allowance 1s" in restart["reason"]


def _hb(ts: float = 0.0, **fields) -> Heartbeat:
    return Heartbeat.from_dict({"ts": ts, **fields})


def test_calibrated_allowance_follows_observed_times(tmp_path):
    calibrated = settings(
        startup_timeout_s=600.0,
        heartbeat_safety_factor=4.0,
        min_heartbeat_timeout_s=1.0,
        heartbeat_interval_s=0.5,
    )
    hang = HangDetector(tmp_path, calibrated)
    assert hang.allowance(None) == 600.0
    assert hang.allowance(_hb(phase="compiling")) == 600.0
    # Finished, stopped or failed: it only has to exit (stop_grace_s, floored).
    assert hang.allowance(_hb(phase="finished")) == max(calibrated.stop_grace_s, 1.0)
    # First training heartbeat, no step time yet: still the startup allowance (compilation).
    assert hang.allowance(_hb(phase="training")) == 600.0
    assert hang.allowance(_hb(phase="training", step_time_s=2.0)) == 8.0
    # Fast steps: the heartbeat interval bounds the gap, then the floor.
    assert hang.allowance(_hb(phase="training", step_time_s=0.01)) == 2.0
    # A save never observed: startup allowance; with a recorded save time: calibrated.
    assert hang.allowance(_hb(phase="checkpointing", step_time_s=1.0)) == 600.0
    assert (
        hang.allowance(_hb(phase="checkpointing", step_time_s=1.0, checkpoint_time_s=9.0)) == 40.0
    )
    # Observed gaps raise the allowance for their phase (eval seen to take 30 s).
    hang.observe(_hb(100.0, phase="eval"))
    hang.observe(_hb(130.0, phase="training", step_time_s=1.0))
    assert hang.allowance(_hb(phase="eval")) == 120.0
    # A fixed heartbeat_timeout_s replaces calibration after startup.
    fixed = HangDetector(tmp_path, dataclasses.replace(calibrated, heartbeat_timeout_s=50.0))
    assert fixed.allowance(_hb(phase="training", step_time_s=2.0)) == 50.0
    assert fixed.allowance(_hb(phase="startup")) == 600.0


def test_loading_and_compiling_keep_the_full_startup_allowance(tmp_path):
    calibrated = settings(startup_timeout_s=600.0, min_startup_timeout_s=0.5)
    hang = HangDetector(tmp_path, calibrated, longest_startup_s=1.0)
    assert hang.allowance(None) == 5.0  # max(min_startup_timeout_s, 5 × 1.0 s observed)
    assert hang.allowance(_hb(phase="startup")) < 600.0
    assert hang.allowance(_hb(phase="loading")) == 600.0
    assert hang.allowance(_hb(phase="compiling")) == 600.0


# --------------------------------------------------------------------------- stop & preemption


def _request_later(sup: Supervisor, delay: float, kind: str, detail: str) -> None:
    threading.Timer(delay, sup.request_stop, args=(kind, detail)).start()


def test_user_stop_saves_and_exits_0(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "step_time": 0.02}])
    sup = Supervisor(run_dir, settings(), argv_for(standin, run_dir), handle_signals=False)
    _request_later(sup, 1.0, "user", "test stop")
    code = sup.run()
    state = read_json(run_dir / STATE_FILE)
    assert code == EXIT_OK and state["phase"] == SupervisorPhase.STOPPED
    assert "worker saved and exited 75" in state["reason"]
    saved = [c.step for c in list_checkpoints(run_dir) if c.complete]
    assert saved and state["last_checkpoint_step"] == saved[-1]
    assert state["restarts"] == []


def test_stop_kills_a_worker_that_does_not_save_within_the_grace(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "ignore_term": True}])
    sup = Supervisor(
        run_dir, settings(stop_grace_s=0.5), argv_for(standin, run_dir), handle_signals=False
    )
    _request_later(sup, 0.8, "user", "test stop")
    t0 = time.monotonic()
    assert sup.run() == EXIT_OK
    assert time.monotonic() - t0 < 5
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == SupervisorPhase.STOPPED
    assert "did not exit 75 within the 0.5s stop grace (killed by SIGKILL)" in state["reason"]


def test_a_supervisor_error_asks_the_worker_to_save_before_the_run_fails(tmp_path, standin):
    # No periodic checkpoints: whatever checkpoint there is, the worker wrote on the SIGTERM.
    run_dir = make_run(tmp_path, [{"steps": 10**6, "step_time": 0.02, "vram": 1000}])
    sup = Supervisor(run_dir, settings(), argv_for(standin, run_dir), handle_signals=False)
    note = sup.vram.note

    def broken(used: int, source: str) -> None:
        # A bug in the watch loop once the worker trains: the catch-all handles it.
        if (read_json(run_dir / "heartbeat.json") or {}).get("step", 0) >= 3:
            raise RuntimeError("injected supervisor bug")
        note(used, source)

    sup.vram.note = broken
    assert sup.run() == EXIT_SOFTWARE
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == SupervisorPhase.FAILED
    assert "injected supervisor bug" in state["reason"]
    assert "was asked to save and stop: exit 75" in state["reason"], state["reason"]
    assert [c.complete for c in list_checkpoints(run_dir)] == [True]
    assert "saved step" in (run_dir / WORKER_LOG).read_text()


def test_preemption_request_saves_and_exits_75(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    sup = Supervisor(run_dir, settings(), argv_for(standin, run_dir), handle_signals=False)
    _request_later(sup, 0.8, "preempted", "aws preemption notice (terminate, 120s left)")
    assert sup.run() == EXIT_STOPPED
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == SupervisorPhase.PREEMPTED
    assert state["reason"].startswith("aws preemption notice")


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_metadata_preemption_notice_stops_the_run(tmp_path, standin, provider):
    from helpers.metadata_server import FakeMetadataServer

    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    with FakeMetadataServer(provider) as srv:
        sup = Supervisor(
            run_dir,
            settings(preemption_provider="auto", metadata_url=srv.base_url, preemption_poll_s=0.1),
            argv_for(standin, run_dir),
            handle_signals=False,
        )
        threading.Timer(1.0, srv.announce).start()
        code = sup.run()
    assert code == EXIT_STOPPED
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == SupervisorPhase.PREEMPTED
    assert state["reason"].startswith(f"{provider} preemption notice")
    assert "worker saved and exited 75" in state["reason"]
    watch = events_named(read_jsonl(run_dir / EVENTS_FILE), "preemption_watch")[0]
    assert watch["provider"] == provider


@pytest.mark.parametrize("write_s, warned", [(40.0, True), (2.0, False)])
def test_a_checkpoint_too_slow_for_a_preemption_notice_is_warned_about_once(
    tmp_path, standin, write_s, warned
):
    """With GCP's 30 s notice watched, a worker whose checkpoints take 40 s to write could not
    save on a notice: one warning event names the numbers and the fixes; 2 s fits, no event."""
    from helpers.metadata_server import FakeMetadataServer

    run_dir = make_run(
        tmp_path, [{"steps": 12, "step_time": 0.1, "ckpt_every": 3, "write_s": write_s}]
    )
    with FakeMetadataServer("gcp") as srv:
        sup = Supervisor(
            run_dir,
            settings(preemption_provider="auto", metadata_url=srv.base_url, preemption_poll_s=0.1),
            argv_for(standin, run_dir),
            handle_signals=False,
        )
        assert sup.run() == EXIT_OK
    found = events_named(read_jsonl(run_dir / EVENTS_FILE), "preemption_budget")
    if not warned:
        assert found == []
        return
    assert len(found) == 1, found
    reason = found[0]["reason"]
    assert "40.0 s to write" in reason and "the 30 s a gcp notice gives" in reason
    assert "more than" in reason and "Fix:" in reason and "checkpoint.interval_steps" in reason


def test_stop_during_backoff_needs_no_worker(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 1}])
    sup = Supervisor(
        run_dir,
        settings(backoff_initial_s=30.0, backoff_max_s=30.0),
        argv_for(standin, run_dir),
        handle_signals=False,
    )

    def stop_in_the_backoff():  # the second restart in a row waits 30 s
        wait_for(
            lambda: any(
                e["event"] == "restart" and e["backoff_s"] == 30.0
                for e in read_jsonl(run_dir / EVENTS_FILE)
            ),
            timeout=60,
            what="a restart that waits 30 s",
        )
        sup.request_stop("user", "test stop")

    threading.Thread(target=stop_in_the_backoff, daemon=True).start()
    t0 = time.monotonic()
    assert sup.run() == EXIT_OK
    assert time.monotonic() - t0 < 10
    assert read_json(run_dir / STATE_FILE)["phase"] == SupervisorPhase.STOPPED


def test_sigterm_to_supervisor_is_forwarded_and_worker_saves(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    proc = spawn_driver(run_dir)
    wait_for(
        lambda: (read_json(run_dir / "heartbeat.json") or {}).get("step", 0) >= 3,
        what="the worker to train",
    )
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_OK, out
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == SupervisorPhase.STOPPED and "received SIGTERM" in state["reason"]
    assert "saved step" in out  # the worker's output was echoed in the foreground
    hb_step = read_json(run_dir / "heartbeat.json")["step"]
    assert state["last_checkpoint_step"] == hb_step


def test_second_sigint_kills_the_worker_at_once(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "ignore_term": True}])
    proc = spawn_driver(run_dir, stop_grace_s=60.0)
    wait_for(
        lambda: (read_json(run_dir / STATE_FILE) or {}).get("worker_pid"),
        what="the worker to start",
    )
    wait_for(
        lambda: (read_json(run_dir / "heartbeat.json") or {}).get("step", 0) >= 1,
        what="the worker to train",
    )
    proc.send_signal(signal.SIGINT)
    wait_for(
        lambda: (read_json(run_dir / STATE_FILE) or {}).get("phase") == SupervisorPhase.STOPPING,
        what="phase stopping",
    )
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 5, "the second SIGINT should not wait out the 60 s grace"
    assert proc.returncode == EXIT_OK, out
    events = read_jsonl(run_dir / EVENTS_FILE)
    assert "force_kill" in [e["event"] for e in events]
    # The ending says what happened: a kill at the second Ctrl-C, not a grace that ran out.
    ending = events[-1]["reason"]
    assert "killed at a second Ctrl-C" in ending and "stop grace" not in ending, ending


# --------------------------------------------------------------------------- GPU gate & VRAM


def test_unhealthy_gpu_at_launch_exits_69_without_a_worker(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, gpu=FakeGpu(["unhealthy"]))
    assert code == EXIT_UNAVAILABLE
    assert (
        state["phase"] == SupervisorPhase.FAILED and "GPU unhealthy (preflight)" in state["reason"]
    )
    assert not (run_dir / "attempts.jsonl").exists()


def test_gpu_gate_before_restart_waits_for_memory_release(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 1}])
    gpu = FakeGpu(["healthy", "unhealthy"])
    code, state, _ = supervise(run_dir, standin, gpu=gpu)
    assert code == EXIT_UNAVAILABLE
    assert "GPU unhealthy (before restart)" in state["reason"]
    assert gpu.released == [[attempts(run_dir)[0]["pid"]]]
    assert len(attempts(run_dir)) == 1


def test_real_health_probe_with_fake_nvml_unhealthy(tmp_path, standin, monkeypatch):
    from m3run.runner.supervisor.preflight import NvmlProbe

    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"devices": [{"ecc_uncorrected": 4}]}))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, gpu=NvmlProbe(20.0))
    assert code == EXIT_UNAVAILABLE
    assert "ECC" in state["reason"] or "ecc" in state["reason"]


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("cuda", "train.device=cuda asks for a CUDA GPU, so the run cannot train here"),
        ("auto", "the run trains on CPU (train.device=auto)"),
    ],
)
def test_the_gate_line_without_a_gpu_follows_the_device_the_run_asks_for(
    tmp_path, standin, monkeypatch, device, says
):
    from m3run.runner.supervisor.preflight import NvmlProbe

    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"errors": {"nvmlInit": "LIBRARY_NOT_FOUND"}}))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, _, events = supervise(run_dir, standin, gpu=NvmlProbe(20.0), train_device=device)
    assert code == EXIT_OK
    (health,) = events_named(events, "health")
    assert health["verdict"] == "no_gpu" and says in health["reason"], health["reason"]
    assert "proceeds on CPU" not in health["reason"]


def test_vram_peak_recorded_and_warned_near_capacity(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 5, "vram": 990 * 2**20}])
    code, state, events = supervise(run_dir, standin, gpu=FakeGpu(["healthy"], 1000))
    assert code == EXIT_OK
    assert state["peak_vram_bytes"] == 990 * 2**20
    (warn,) = events_named(events, "vram_warn")
    assert "99%" in warn["reason"] and "micro_batch_size" in warn["reason"]


# --------------------------------------------------------------------------- checkpoints & lock


def test_torn_checkpoint_is_reported_and_not_counted_as_progress(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 2, "torn_at": 2, "exit": 1}])
    code, state, events = supervise(run_dir, standin, no_progress_restarts=1)
    assert code == EXIT_SOFTWARE
    torn = events_named(events, "checkpoint_incomplete")
    assert torn and torn[0]["step"] == 2 and "sha256 mismatch" in torn[0]["reason"]
    assert state["last_checkpoint_step"] is None


def test_second_lock_is_refused_with_the_holders_pid(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(LaunchError) as err:
            RunLock(tmp_path).acquire()
        assert err.value.exit_code == EXIT_REFUSED
        assert f"supervisor pid {os.getpid()} holds" in str(err.value)
        assert "m3run stop" in str(err.value)
    finally:
        first.release()
    second = RunLock(tmp_path)
    second.acquire()  # released locks can be taken again
    second.release()


def test_stale_worker_of_a_killed_supervisor_is_stopped_first(tmp_path, standin):
    # The orphan is found by the worker.lock it holds: state.json is torn here.
    run_dir = make_run(tmp_path, [{"steps": 1}])
    orphan = hold_lock(run_dir / WORKER_LOCK_FILE)
    try:
        (run_dir / STATE_FILE).write_text('{"phase": "running", "worker_pid": ')
        code, _, events = supervise(run_dir, standin)
        assert code == EXIT_OK
        assert orphan.wait(timeout=5) == -signal.SIGTERM
        assert events_named(events, "stale_worker")[0]["pid"] == orphan.pid
    finally:
        orphan.kill()


def test_an_unrelated_pid_in_state_json_is_never_signalled(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1}])
    bystander = unrelated_process()
    try:
        (run_dir / STATE_FILE).write_text(
            json.dumps(
                {
                    "phase": "running",
                    "supervisor_pid": 999999,
                    "worker_pid": bystander.pid,
                    "worker_create_time": psutil.Process(bystander.pid).create_time(),
                }
            )
        )
        code, _, events = supervise(run_dir, standin)
        assert code == EXIT_OK
        assert bystander.poll() is None, "the supervisor signalled a process that is not its worker"
        assert not events_named(events, "stale_worker")
    finally:
        bystander.kill()
