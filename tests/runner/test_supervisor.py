"""The supervisor against stand-in workers: small scripts that follow the worker protocol
(heartbeat.json, checkpoints/, exit codes, SIGTERM → save → 75) and misbehave on cue. The
supervisor is what is under test; the real worker is exercised by tests/chaos/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from runner import runstate
from runner.checkpoint.layout import list_checkpoints
from runner.files import read_json, read_jsonl
from runner.protocol import (
    EVENTS_FILE,
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
    FAULT_ENV,
    FAULT_SCOPE_ENV,
    STATE_FILE,
    WORKER_LOG,
)
from runner.supervisor import (
    EXIT_REFUSED,
    LaunchError,
    LaunchOptions,
    RunLock,
    Supervisor,
    SupervisorSettings,
    freeze_config,
)

REPO = Path(__file__).resolve().parents[2]

# A stand-in worker. argv: RUN_DIR RESUME LR_SCALE. Attempt n follows plan.json[n] (the last
# entry repeats). Plan keys: steps, step_time, ckpt_every, exit, hang_at (stop heartbeating at
# that step), ignore_term, no_heartbeat, vram, torn_at (write a checkpoint with a bad hash),
# hang_on_exit (report phase "finished", then never exit).
STANDIN = textwrap.dedent("""
    import hashlib, json, os, signal, sys, time
    from pathlib import Path

    run_dir, resume, lr_scale = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    plan = json.loads((run_dir / "plan.json").read_text())
    log = run_dir / "attempts.jsonl"
    n = len(log.read_text().splitlines()) if log.exists() else 0
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "resume": resume, "lr_scale": lr_scale,
                            "fault": os.environ.get("M3RUN_FAULT")}) + "\\n")
    spec = plan[min(n, len(plan) - 1)]
    stop = []
    if spec.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))

    def heartbeat(phase, step, **kw):
        hb = {"pid": os.getpid(), "phase": phase, "step": step, "total_steps": 1000,
              "loss": 5.0 - step / 100, "lr": 1e-3 * lr_scale, "ts": time.time(), **kw}
        tmp = run_dir / f".hb.{os.getpid()}"
        tmp.write_text(json.dumps(hb))
        os.replace(tmp, run_dir / "heartbeat.json")

    def save(step, torn=False):
        root = run_dir / "checkpoints"
        root.mkdir(exist_ok=True)
        tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
        tmp.mkdir()
        files = {}
        for name in ("model.safetensors", "optim.pt"):
            data = os.urandom(256)
            (tmp / name).write_bytes(data)
            digest = hashlib.sha256(data).hexdigest()
            files[name] = {"sha256": "0" * 64 if torn else digest, "bytes": len(data)}
        (tmp / "meta.json").write_text(json.dumps(
            {"format_version": 1, "step": step, "files": files, "saved_at": time.time(),
             "lr_scale": scale}))
        final = root / f"step_{step:08d}"
        if final.exists():
            os.rename(final, root / f".del-{final.name}-{os.getpid()}")
        os.rename(tmp, final)

    if resume.isdigit():
        step = int(resume)
    elif resume == "latest" and (run_dir / "checkpoints").is_dir():
        steps = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")]
        step = max(steps, default=0)
    else:
        step = 0
    # Like the real worker: the scale it trains at is its checkpoint's times --lr-scale.
    meta = run_dir / "checkpoints" / f"step_{step:08d}" / "meta.json"
    stored = json.loads(meta.read_text()).get("lr_scale", 1.0) if meta.exists() else 1.0
    scale = lr_scale * stored
    if spec.get("no_heartbeat"):
        time.sleep(1e9)
    heartbeat("startup", step)
    print(f"stand-in worker attempt {n} resume={resume} lr_scale={lr_scale}", flush=True)
    step_time = spec.get("step_time", 0.02)
    for _ in range(spec.get("steps", 5)):
        if spec.get("hang_at") == step:
            print(f"hanging at step {step}", flush=True)
            time.sleep(1e9)
        time.sleep(step_time)
        step += 1
        heartbeat("training", step, step_time_s=step_time, vram_bytes=spec.get("vram"))
        print(f"step {step}", flush=True)
        if spec.get("torn_at") == step:
            save(step, torn=True)
        elif spec.get("ckpt_every") and step % spec["ckpt_every"] == 0:
            heartbeat("checkpointing", step, step_time_s=step_time)
            save(step)
        if stop:
            heartbeat("stopping", step)
            save(step)
            print(f"saved step {step} on SIGTERM", flush=True)
            sys.exit(75)
    if spec.get("hang_on_exit"):
        heartbeat("finished", step)
        time.sleep(1e9)
    sys.exit(spec.get("exit", 0))
""")

# Runs a Supervisor over the stand-in in its own process (real signal handling).
DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from runner.supervisor import Supervisor, SupervisorSettings

    run_dir, settings, standin = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    argv = lambda resume, lr: [sys.executable, standin, str(run_dir), resume, repr(lr)]
    code = Supervisor(run_dir, SupervisorSettings(**settings), argv, console=True).run()
    assert "torch" not in sys.modules, "the supervisor imported torch"
    sys.exit(code)
""")

FAST = dict(
    backoff_initial_s=0.05,
    backoff_max_s=0.4,
    startup_timeout_s=5.0,
    stop_grace_s=2.0,
    preemption_provider="none",
    smoke=False,
    min_heartbeat_timeout_s=0.5,
    poll_s=0.05,
    heartbeat_interval_s=0.05,
)


def settings(**over) -> SupervisorSettings:
    return SupervisorSettings(**{**FAST, **over})


@pytest.fixture
def standin(tmp_path) -> Path:
    path = tmp_path / "standin_worker.py"
    path.write_text(STANDIN)
    return path


def make_run(tmp_path: Path, plan: list[dict]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "plan.json").write_text(json.dumps(plan))
    return run_dir


def argv_for(standin: Path, run_dir: Path):
    return lambda resume, lr: [sys.executable, str(standin), str(run_dir), resume, repr(lr)]


def supervise(
    run_dir: Path,
    standin: Path,
    plan: list[dict] | None = None,
    *,
    resume: str = "latest",
    env: dict | None = None,
    gpu=None,
    **over,
) -> tuple[int, dict, list[dict]]:
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan))
    sup = Supervisor(
        run_dir,
        settings(**over),
        argv_for(standin, run_dir),
        resume=resume,
        env=env,
        gpu=gpu,
        handle_signals=False,
    )
    code = sup.run()
    return code, read_json(run_dir / STATE_FILE), read_jsonl(run_dir / EVENTS_FILE)


def attempts(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "attempts.jsonl")


def events_named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


# --------------------------------------------------------------------------- outcomes


def test_finished_run_exits_0_and_records_state(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 4, "ckpt_every": 2}])
    code, state, events = supervise(run_dir, standin)
    assert code == EXIT_OK
    assert state["phase"] == runstate.FINISHED
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
    assert code == EXIT_OK and state["phase"] == runstate.FINISHED
    assert [a["resume"] for a in attempts(run_dir)] == ["latest", "latest"]
    (restart,) = state["restarts"]
    assert restart["exit_code"] == 1 and "crashed (exit 1)" in restart["reason"]
    assert restart["resume_step"] == 2
    assert restart["backoff_s"] == pytest.approx(0.05)
    assert events_named(events, "restart")[0]["kind"] == "crash"


def test_always_crashing_worker_backs_off_then_exits_70(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 3}])
    code, state, events = supervise(run_dir, standin, no_progress_restarts=3)
    assert code == EXIT_SOFTWARE
    assert state["phase"] == runstate.FAILED
    assert "no progress: 3 restarts in a row without a new complete checkpoint" in state["reason"]
    assert "supervisor.no_progress_restarts=3" in state["reason"]
    assert len(attempts(run_dir)) == 4
    # Exponential backoff: 0.05, 0.1, 0.2 (capped at 0.4).
    assert [r["backoff_s"] for r in state["restarts"]] == pytest.approx([0.05, 0.1, 0.2])
    assert events[-1]["event"] == "failed" and events[-1]["exit_code"] == EXIT_SOFTWARE


def test_restart_budget_per_window(tmp_path, standin):
    # Each attempt makes progress (a new checkpoint) and then crashes: only the budget stops it.
    run_dir = make_run(tmp_path, [{"steps": 2, "ckpt_every": 1, "exit": 1}])
    code, state, _ = supervise(run_dir, standin, max_restarts=2, restart_window_s=60.0)
    assert code == EXIT_SOFTWARE
    assert "restart budget spent: 2 restarts in the last 60s" in state["reason"]
    assert "supervisor.max_restarts=2" in state["reason"]
    assert len(attempts(run_dir)) == 3
    # Progress resets the backoff: every restart waited the initial delay.
    assert [r["backoff_s"] for r in state["restarts"]] == pytest.approx([0.05, 0.05])


def test_bad_config_exit_78_is_never_restarted(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 0, "exit": EXIT_CONFIG}])
    code, state, _ = supervise(run_dir, standin)
    assert code == EXIT_CONFIG
    assert state["phase"] == runstate.FAILED and "bad config or data" in state["reason"]
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
    assert code == EXIT_OK and state["phase"] == runstate.FINISHED
    assert state["restarts"] == [] and len(attempts(run_dir)) == 1
    assert "had reached phase 'finished'" in events_named(events, "hang_on_exit")[0]["reason"]


def test_worker_without_heartbeat_hits_the_startup_timeout(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"no_heartbeat": True}, {"steps": 1}])
    code, state, _ = supervise(run_dir, standin, startup_timeout_s=1.0, stop_grace_s=0.3)
    assert code == EXIT_OK
    (restart,) = state["restarts"]
    assert "no heartbeat yet" in restart["reason"] and "allowance 1s" in restart["reason"]


def test_calibrated_allowance_follows_observed_times(tmp_path):
    sup = Supervisor(
        tmp_path,
        settings(
            startup_timeout_s=600.0,
            heartbeat_safety_factor=4.0,
            min_heartbeat_timeout_s=1.0,
            heartbeat_interval_s=0.5,
        ),
        lambda r, lr: ["true"],
        handle_signals=False,
    )
    assert sup._allowance(None) == 600.0
    assert sup._allowance({"phase": "compiling"}) == 600.0
    # Finished, stopped or failed: it only has to exit (stop_grace_s, floored).
    assert sup._allowance({"phase": "finished"}) == max(sup.s.stop_grace_s, 1.0)
    # First training heartbeat, no step time yet: still the startup allowance (compilation).
    assert sup._allowance({"phase": "training"}) == 600.0
    assert sup._allowance({"phase": "training", "step_time_s": 2.0}) == 8.0
    # Fast steps: the heartbeat interval bounds the gap, then the floor.
    assert sup._allowance({"phase": "training", "step_time_s": 0.01}) == 2.0
    # A save never observed: startup allowance; with a recorded save time: calibrated.
    assert sup._allowance({"phase": "checkpointing", "step_time_s": 1.0}) == 600.0
    assert (
        sup._allowance({"phase": "checkpointing", "step_time_s": 1.0, "checkpoint_time_s": 9.0})
        == 40.0
    )
    # Observed gaps raise the allowance for their phase (eval seen to take 30 s).
    sup._observe({"phase": "eval", "ts": 100.0})
    sup._observe({"phase": "training", "ts": 130.0, "step_time_s": 1.0})
    assert sup._allowance({"phase": "eval"}) == 120.0
    # A fixed heartbeat_timeout_s replaces calibration after startup.
    sup.s.heartbeat_timeout_s = 50.0
    assert sup._allowance({"phase": "training", "step_time_s": 2.0}) == 50.0
    assert sup._allowance({"phase": "startup"}) == 600.0
    sup.log.close()


# --------------------------------------------------------------------------- stop & preemption


def _request_later(sup: Supervisor, delay: float, kind: str, detail: str) -> None:
    threading.Timer(delay, sup.request_stop, args=(kind, detail)).start()


def test_user_stop_saves_and_exits_0(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "step_time": 0.02}])
    sup = Supervisor(run_dir, settings(), argv_for(standin, run_dir), handle_signals=False)
    _request_later(sup, 1.0, "user", "test stop")
    code = sup.run()
    state = read_json(run_dir / STATE_FILE)
    assert code == EXIT_OK and state["phase"] == runstate.STOPPED
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
    assert state["phase"] == runstate.STOPPED
    assert "did not exit 75 within the 0.5s stop grace (killed by SIGKILL)" in state["reason"]


def test_preemption_request_saves_and_exits_75(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    sup = Supervisor(run_dir, settings(), argv_for(standin, run_dir), handle_signals=False)
    _request_later(sup, 0.8, "preempted", "aws preemption notice (terminate, 120s left)")
    assert sup.run() == EXIT_STOPPED
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == runstate.PREEMPTED
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
    assert state["phase"] == runstate.PREEMPTED
    assert state["reason"].startswith(f"{provider} preemption notice")
    assert "worker saved and exited 75" in state["reason"]
    watch = events_named(read_jsonl(run_dir / EVENTS_FILE), "preemption_watch")[0]
    assert watch["provider"] == provider


def test_stop_during_backoff_needs_no_worker(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1, "exit": 1}])
    sup = Supervisor(
        run_dir,
        settings(backoff_initial_s=30.0, backoff_max_s=30.0),
        argv_for(standin, run_dir),
        handle_signals=False,
    )
    _request_later(sup, 1.0, "user", "test stop")
    t0 = time.monotonic()
    assert sup.run() == EXIT_OK
    assert time.monotonic() - t0 < 10
    assert read_json(run_dir / STATE_FILE)["phase"] == runstate.STOPPED


def _spawn_driver(tmp_path: Path, run_dir: Path, standin: Path, **over) -> subprocess.Popen:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(driver), str(run_dir), json.dumps({**FAST, **over}), str(standin)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_sigterm_to_supervisor_is_forwarded_and_worker_saves(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6}])
    proc = _spawn_driver(tmp_path, run_dir, standin)
    wait_for(
        lambda: (read_json(run_dir / "heartbeat.json") or {}).get("step", 0) >= 3,
        what="the worker to train",
    )
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_OK, out
    state = read_json(run_dir / STATE_FILE)
    assert state["phase"] == runstate.STOPPED and "received SIGTERM" in state["reason"]
    assert "saved step" in out  # the worker's output was echoed in the foreground
    hb_step = read_json(run_dir / "heartbeat.json")["step"]
    assert state["last_checkpoint_step"] == hb_step


def test_second_sigint_kills_the_worker_at_once(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 10**6, "ignore_term": True}])
    proc = _spawn_driver(tmp_path, run_dir, standin, stop_grace_s=60.0)
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
        lambda: (read_json(run_dir / STATE_FILE) or {}).get("phase") == runstate.STOPPING,
        what="phase stopping",
    )
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert time.monotonic() - t0 < 5, "the second SIGINT should not wait out the 60 s grace"
    assert proc.returncode == EXIT_OK, out
    assert "force_kill" in [e["event"] for e in read_jsonl(run_dir / EVENTS_FILE)]


# --------------------------------------------------------------------------- GPU gate & VRAM


class FakeGpu:
    """A GpuProbe stand-in: verdicts per call, per-process memory, release waits."""

    def __init__(self, verdicts: list[str], mem_total_mib: int = 1000, process_bytes=None):
        self.verdicts, self.calls, self.released = list(verdicts), [], []
        self.mem_total_mib, self.process_bytes = mem_total_mib, process_bytes

    def check(self, allowed_pids):
        verdict = self.verdicts.pop(0) if len(self.verdicts) > 1 else self.verdicts[0]
        self.calls.append(verdict)
        mem = self.mem_total_mib

        class Report:
            def summary(self):
                return f"GPU health: {verdict}"

            def to_dict(self):
                return {"verdict": verdict, "devices": [{"index": 0, "mem_total_mib": mem}]}

        report = Report()
        report.verdict = verdict
        return report

    def process_memory(self, pid):
        return self.process_bytes

    def wait_released(self, pids, timeout_s):
        self.released.append(list(pids))
        return True


def test_unhealthy_gpu_at_launch_exits_69_without_a_worker(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, gpu=FakeGpu(["unhealthy"]))
    assert code == EXIT_UNAVAILABLE
    assert state["phase"] == runstate.FAILED and "GPU unhealthy (preflight)" in state["reason"]
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
    from runner.supervisor import GpuProbe

    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"devices": [{"ecc_uncorrected": 4}]}))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, gpu=GpuProbe(20.0))
    assert code == EXIT_UNAVAILABLE
    assert "ECC" in state["reason"] or "ecc" in state["reason"]


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
    run_dir = make_run(tmp_path, [{"steps": 1}])
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        (run_dir / STATE_FILE).write_text(
            json.dumps(
                {
                    "phase": "running",
                    "supervisor_pid": 999999,
                    "worker_pid": orphan.pid,
                    "worker_create_time": psutil.Process(orphan.pid).create_time(),
                }
            )
        )
        code, _, events = supervise(run_dir, standin)
        assert code == EXIT_OK
        assert orphan.wait(timeout=5) == -signal.SIGTERM
        assert events_named(events, "stale_worker")[0]["pid"] == orphan.pid
    finally:
        orphan.kill()


# --------------------------------------------------------------------------- config freezing


def _demo_opts(run_dir: Path, *overrides: str, force: bool = False) -> LaunchOptions:
    return LaunchOptions(
        config=REPO / "configs" / "demo_cpu.yaml",
        run_dir=run_dir,
        overrides=list(overrides),
        force=force,
    )


def test_config_is_frozen_and_a_changed_one_refused_unless_forced(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, first_hash = freeze_config(_demo_opts(run_dir, "train.lr=0.001"))
    frozen = (run_dir / "config.yaml").read_text()
    assert "lr: 0.001" in frozen
    # Same config again: accepted, unchanged.
    assert freeze_config(_demo_opts(run_dir, "train.lr=0.001"))[1] == first_hash
    with pytest.raises(LaunchError) as err:
        freeze_config(_demo_opts(run_dir, "train.lr=0.002"))
    assert err.value.exit_code == EXIT_CONFIG
    assert "train.lr: 0.001 -> 0.002" in str(err.value) and "--force" in str(err.value)
    assert (run_dir / "config.yaml").read_text() == frozen
    _, forced_hash = freeze_config(_demo_opts(run_dir, "train.lr=0.002", force=True))
    assert forced_hash != first_hash and "lr: 0.002" in (run_dir / "config.yaml").read_text()
    assert events_named(read_jsonl(run_dir / EVENTS_FILE), "config_replaced")


def test_bad_config_is_refused_with_exit_78(tmp_path):
    with pytest.raises(LaunchError) as err:
        freeze_config(_demo_opts(tmp_path, "train.lr=-1"))
    assert err.value.exit_code == EXIT_CONFIG and "train.lr" in str(err.value)


def test_supervisor_modules_never_import_torch():
    code = (
        "import sys\n"
        "import runner.supervisor, runner.runstate, runner.cli, runner.plot\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr


def test_corrupt_newest_existing_checkpoint_is_reported_at_launch(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 4, "ckpt_every": 2}])
    assert supervise(run_dir, standin)[0] == EXIT_OK
    model = run_dir / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[10] ^= 0xFF
    model.write_bytes(bytes(data))
    code, state, events = supervise(run_dir, standin, [{"steps": 0}])
    assert code == EXIT_OK
    (bad,) = [e for e in events_named(events, "checkpoint_incomplete") if e["step"] == 4]
    assert "newest existing checkpoint, step 4" in bad["reason"] and "sha256" in bad["reason"]
    assert state["last_checkpoint_step"] == 2


def test_a_stale_local_rank_heartbeat_is_a_hang(tmp_path, standin):
    # Rank 0 keeps beating; local rank 1 stopped (its file is fresh for this worker but old).
    run_dir = make_run(tmp_path, [{"steps": 10**6}, {"steps": 1}])
    sup = Supervisor(
        run_dir,
        settings(heartbeat_timeout_s=1.0, stop_grace_s=0.5),
        argv_for(standin, run_dir),
        handle_signals=False,
    )

    def rank1_beats_once():
        wait_for(lambda: (read_json(run_dir / STATE_FILE) or {}).get("worker_pid"))
        (run_dir / "heartbeat.local1.json").write_text(
            json.dumps({"pid": 1, "phase": "training", "step": 1, "ts": time.time()})
        )

    threading.Thread(target=rank1_beats_once).start()
    assert sup.run() == EXIT_OK
    (restart,) = read_json(run_dir / STATE_FILE)["restarts"]
    assert restart["kind"] == "hang" and "in heartbeat.local1.json" in restart["reason"]


def test_worker_command_line_single_process_and_torchrun(tmp_path):
    from runner.config import DistributedConfig
    from runner.supervisor import worker_argv

    single = worker_argv(tmp_path)("latest", 1.0)
    assert single == [
        sys.executable,
        "-m",
        "runner.train",
        str(tmp_path / "config.yaml"),
        "--run-dir",
        str(tmp_path),
        "--resume",
        "latest",
    ]
    assert worker_argv(tmp_path)("4", 0.5)[-2:] == ["--lr-scale", "0.5"]
    two = worker_argv(tmp_path, DistributedConfig(nproc_per_node=2))("7", 1.0)
    assert two[:2] == [sys.executable, "-m"] and "torch.distributed.run" in two
    assert two[two.index("--nproc-per-node") + 1] == "2" and "--standalone" in two
    assert two[two.index("--max-restarts") + 1] == "0"
    assert two[-8:] == [
        "-m",
        "runner.supervisor",
        "rank",
        str(tmp_path / "config.yaml"),
        "--run-dir",
        str(tmp_path),
        "--resume",
        "7",
    ]
    multi = worker_argv(
        tmp_path,
        DistributedConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29500"),
    )("latest", 1)
    assert "--standalone" not in multi
    assert multi[multi.index("--rdzv-endpoint") + 1] == "10.0.0.1:29500"
    assert multi[multi.index("--rdzv-id") + 1] == tmp_path.name
    assert multi[multi.index("--node-rank") + 1] == "1"


def test_torchrun_exit_1_is_mapped_to_the_ranks_protocol_code(tmp_path):
    sup = Supervisor(tmp_path, settings(), lambda r, lr: ["true"], handle_signals=False)
    sup._torchrun, sup._local_ranks, sup._spawn_wall = True, 2, time.time()
    for rank, code in ((0, 75), (1, 75)):
        (tmp_path / f"worker_exit.local{rank}.json").write_text(
            json.dumps({"code": code, "time": time.time()})
        )
    assert sup._exit_code(1) == EXIT_STOPPED
    (tmp_path / "worker_exit.local1.json").write_text(json.dumps({"code": 78, "time": time.time()}))
    assert sup._exit_code(1) == EXIT_CONFIG
    # A rank that died without a record (or records from an older attempt): a crash.
    (tmp_path / "worker_exit.local1.json").write_text(json.dumps({"code": 75, "time": 0}))
    assert sup._exit_code(1) == 1
    sup.log.close()


def test_checkpoints_are_mirrored_and_restored_onto_a_new_disk(tmp_path, standin):
    mirror = tmp_path / "mirror"
    url = f"file://{mirror}"
    first = tmp_path / "first"
    first.mkdir()
    (first / "plan.json").write_text(json.dumps([{"steps": 4, "ckpt_every": 2}]))
    code, state, events = supervise(first, standin, mirror_url=url, mirror_keep_last=2)
    assert code == EXIT_OK
    assert "mirror_flush" in [e["event"] for e in events]
    # The newest checkpoint reached the mirror before the supervisor exited (meta.json last).
    assert (mirror / "checkpoints" / "step_00000004" / "meta.json").is_file()
    assert runstate.collect_status(first)["mirror"]["remote_step"] == 4  # `m3run status` shows it
    # A new, empty run dir (another node after preemption) resumes from the mirror.
    second = tmp_path / "second"
    second.mkdir()
    (second / "plan.json").write_text(json.dumps([{"steps": 0}]))
    code, state, events = supervise(second, standin, mirror_url=url)
    assert code == EXIT_OK
    (restore,) = events_named(events, "mirror_restore")
    assert restore["step"] == 4 and state["last_checkpoint_step"] == 4
    assert [c.step for c in list_checkpoints(second) if c.complete] == [4]
    # `--resume none` into an empty run dir starts over: nothing is restored from the mirror.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "plan.json").write_text(json.dumps([{"steps": 0}]))
    code, _, events = supervise(fresh, standin, resume="none", mirror_url=url)
    assert code == EXIT_OK
    assert not events_named(events, "mirror_restore")
    assert not list_checkpoints(fresh)


def test_an_unreadable_mirror_ends_the_launch_with_78(tmp_path, standin):
    run_dir = make_run(tmp_path, [{"steps": 1}])
    code, state, _ = supervise(run_dir, standin, mirror_url="s3x://nowhere/prefix")
    assert code == EXIT_CONFIG
    assert state["reason"].startswith("checkpoint mirror:") and "fix:" in state["reason"]
    assert not (run_dir / "attempts.jsonl").exists()


def test_supervisor_settings_defaults_match_the_config_schema():
    """The supervisor's own defaults (used when it is driven without a config file) are the
    config schema's, field by field, so the two cannot drift apart."""
    import dataclasses

    from runner.config import CheckpointConfig, LogConfig, SupervisorConfig

    fields = {f.name: f.default for f in dataclasses.fields(SupervisorSettings)}
    schema = {name: f.default for name, f in SupervisorConfig.model_fields.items()}
    shared = fields.keys() & schema.keys()
    assert len(shared) >= 15, sorted(shared)
    assert {n: fields[n] for n in shared} == {n: schema[n] for n in shared}
    assert fields["heartbeat_interval_s"] == LogConfig.model_fields["heartbeat_interval_s"].default
    ck = CheckpointConfig.model_fields
    assert fields["mirror_keep_last"] == ck["keep_last"].default
    assert fields["mirror_flush_s"] == ck["mirror_flush_s"].default
    assert fields["mirror_url"] == ck["mirror_url"].default
