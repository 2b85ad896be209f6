"""The `m3run` commands launch, status, logs, health and plot, on run directories written by the
tests or supervised live over a stand-in worker (see test_supervisor.py); `stop` has
test_cli_stop.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.run_dirs import invoke, write_run
from helpers.runs import DEMO_CONFIG as DEMO
from helpers.runs import REPO
from helpers.supervision import FAST

from m3run.runner import runstate
from m3run.runner.files import read_json
from m3run.runner.protocol import (
    EXIT_CONFIG,
    HEARTBEAT_FILE,
    STATE_FILE,
    SUPERVISOR_LOG,
    WORKER_LOG,
    SupervisorPhase,
)
from m3run.runner.supervisor.launch import RunLock


def test_every_command_has_help():
    for cmd in ("launch", "status", "stop", "logs", "health", "plot"):
        result = invoke(cmd, "--help")
        assert result.exit_code == 0, (cmd, result.output)
        assert "Usage" in result.output
    assert invoke("--help").exit_code == 0


def test_every_help_text_is_whole_sentences():
    """Each command's description, epilog and option help ends its last sentence (a help
    text cut short reads as a fact about something else), and every command's --help renders."""
    import typer

    from m3run.runner.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        texts = {"description": command.help, "epilog": command.epilog}
        texts.update({f"--{p.name}": getattr(p, "help", None) for p in command.params})
        for what, text in texts.items():
            if text:
                assert text.rstrip().endswith((".", "?", "!")), (name, what, text)
        result = invoke(name, "--help")
        assert result.exit_code == 0 and "Usage" in result.output, (name, result.output)


# --------------------------------------------------------------------------- status


def test_status_json_of_a_running_run(tmp_path):
    run_dir = write_run(tmp_path / "r")
    result = invoke("status", run_dir, "--json", "--no-gpu")
    assert result.exit_code == 0, result.output
    st = json.loads(result.output)
    assert st["phase"] == "running" and st["supervisor_pid"] == os.getpid()
    assert (st["step"], st["total_steps"], st["loss"]) == (25, 100, 2.0)
    assert st["ppl"] == pytest.approx(7.389, rel=1e-3)
    assert st["eta_s"] == pytest.approx(37.5)
    assert st["last_checkpoint_step"] == 20 and len(st["restarts"]) == 1
    assert st["heartbeat_age_s"] == pytest.approx(1.0, abs=0.5)
    for key in ("lr", "tokens_per_s", "mfu", "worker_pid", "heartbeat_timeout_s"):
        assert key in st


def test_status_text_shows_progress_and_restarts(tmp_path):
    result = invoke("status", write_run(tmp_path / "r"), "--no-gpu")
    assert result.exit_code == 0
    out = result.output
    assert "phase      running" in out and "step       25/100" in out
    assert "MFU 41.0%" in out and "worker crashed (exit 1)" in out
    assert "last complete step 20" in out


def test_status_reports_a_dead_supervisor(tmp_path):
    run_dir = write_run(tmp_path / "r", alive=False)
    st = json.loads(invoke("status", run_dir, "--json", "--no-gpu").output)
    assert st["phase"] == SupervisorPhase.DEAD and st["recorded_phase"] == "running"
    assert "(not running)" in invoke("status", run_dir, "--no-gpu").output


def test_status_and_liveness_never_call_a_run_that_just_ended_dead(tmp_path, monkeypatch):
    # The interleaving of a clean end: a reader takes state.json ("running"), then the
    # supervisor writes its final phase and exits, then the reader finds its pid gone. Played
    # here by a gone pid and the final write, made on disk right after the reader's first read.
    real_read = runstate.read_state
    reads: list[str | None] = []

    def ended_after_first_read(run_dir: Path) -> Path:
        reads.clear()
        return write_run(run_dir, alive=False)

    def read_then_end(run_dir):
        state = real_read(run_dir)
        if not reads:
            record = read_json(Path(run_dir) / STATE_FILE)
            record.update(phase="stopped", reason="received SIGTERM")
            (Path(run_dir) / STATE_FILE).write_text(json.dumps(record))
        reads.append(state.phase if state else None)
        return state

    monkeypatch.setattr(runstate, "read_state", read_then_end)
    run_dir = ended_after_first_read(tmp_path / "status")
    st = json.loads(invoke("status", run_dir, "--json", "--no-gpu").output)
    assert reads == ["running", "stopped"] and st["phase"] == "stopped"
    healthy, why = runstate.liveness(ended_after_first_read(tmp_path / "liveness"))
    assert reads == ["running", "stopped"] and not healthy
    assert "phase stopped: received SIGTERM" in why, why


def test_status_finds_runs_by_name_and_latest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("status")
    assert result.exit_code == 1 and "no run found under runs/" in result.output
    write_run(tmp_path / "runs" / "old", phase="finished")
    time.sleep(0.01)
    write_run(tmp_path / "runs" / "new", phase="stopped")
    assert json.loads(invoke("status", "old", "--json", "--no-gpu").output)["phase"] == "finished"
    assert json.loads(invoke("status", "--json", "--no-gpu").output)["phase"] == "stopped"
    # A data folder beside the runs is not a run to suggest.
    (tmp_path / "runs" / "demo-data" / "train").mkdir(parents=True)
    (tmp_path / "runs" / "demo-data" / "tokenizer.json").write_text("{}")
    result = invoke("status", "nope")
    assert result.exit_code == 1 and "run 'nope' not found" in result.output
    assert "one of the names under ./runs/ (new, old)" in result.output, result.output
    assert "neither nope nor runs/nope is a directory" in result.output
    gone = tmp_path / "gone"
    result = invoke("status", str(gone))
    assert result.exit_code == 1 and f"{gone} is not a directory;" in result.output


def test_status_watch_ends_with_the_run(tmp_path):
    run_dir = write_run(tmp_path / "r", phase="finished")
    result = invoke("status", run_dir, "--watch", "--json", "--no-gpu")
    assert result.exit_code == 0 and json.loads(result.output)["phase"] == "finished"


# --------------------------------------------------------------------------- liveness


@pytest.mark.parametrize(
    ("phase", "alive", "hb_age", "expect"),
    [
        ("running", True, 1.0, 0),
        ("running", True, 10.0 + runstate.LIVENESS_SLACK_S + 5, 1),  # stale heartbeat
        ("running", False, 1.0, 1),  # supervisor gone
        ("restarting", True, 999.0, 0),  # between workers the heartbeat is old by design
        ("finished", True, 1.0, 1),
    ],
)
def test_health_liveness(tmp_path, phase, alive, hb_age, expect):
    run_dir = write_run(tmp_path / "r", phase=phase, alive=alive, hb_age=hb_age)
    result = invoke("health", "--liveness", run_dir)
    assert result.exit_code == expect, result.output
    assert ("alive:" if expect == 0 else "NOT ALIVE:") in result.output


def test_health_liveness_never_touches_the_gpu(tmp_path, monkeypatch):
    # A fake NVML that would hang forever if anything probed it.
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"hang": True, "devices": [{}]}))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    run_dir = write_run(tmp_path / "r")
    t0 = time.monotonic()
    assert invoke("health", "--liveness", run_dir).exit_code == 0
    assert invoke("status", run_dir, "--json", "--no-gpu").exit_code == 0
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    ("spec", "code", "verdict"),
    [
        ({"devices": [{}]}, 0, "healthy"),
        ({"devices": [{"ecc_uncorrected": 2}]}, 69, "unhealthy"),
    ],
)
def test_health_one_shot(tmp_path, monkeypatch, spec, code, verdict):
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps(spec))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    result = invoke("health", "--json")
    assert result.exit_code == code, result.output
    assert json.loads(result.output)["verdict"] == verdict


# --------------------------------------------------------------------------- logs & plot


def test_logs_tail_and_follow(tmp_path):
    run_dir = write_run(tmp_path / "r", phase="finished")
    (run_dir / WORKER_LOG).write_text("".join(f"line {i}\n" for i in range(100)))
    (run_dir / SUPERVISOR_LOG).write_text('{"event": "launch"}\n')
    result = invoke("logs", run_dir, "-n", "3")
    assert result.exit_code == 0 and result.output == "line 97\nline 98\nline 99\n"
    assert invoke("logs", run_dir, "--supervisor").output == '{"event": "launch"}\n'
    # -f on a run that is over prints the tail and returns.
    assert invoke("logs", run_dir, "-f", "-n", "1").output == "line 99\n"
    result = invoke("logs", write_run(tmp_path / "empty"))
    assert result.exit_code == 1 and "does not exist yet" in result.output


def test_logs_follow_streams_until_the_run_ends(tmp_path):
    run_dir = write_run(tmp_path / "r", phase="running")
    log = run_dir / WORKER_LOG
    log.write_text("first\n")
    seen: list[str] = []

    def writer():
        time.sleep(0.5)
        with open(log, "a") as f:
            f.write("second\n")
        time.sleep(0.5)
        state = read_json(run_dir / STATE_FILE)
        (run_dir / STATE_FILE).write_text(json.dumps({**state, "phase": "finished"}))

    t = threading.Thread(target=writer)
    t.start()
    runstate.follow(
        log, run_dir, offset=log.stat().st_size, write=seen.append, poll_s=0.05, idle_exit_s=0.2
    )
    t.join()
    assert "".join(seen) == "second\n"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="m3run plot needs matplotlib (not a declared dep)")
    run_dir = write_run(tmp_path / "r", phase="finished")
    result = invoke("plot", run_dir)
    assert result.exit_code == 0, result.output
    png = Path(result.output.strip())
    assert png == run_dir / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "x.png"
    assert invoke("plot", run_dir, "--out", out).exit_code == 0 and out.is_file()


def test_plot_without_metrics_fails_clearly(tmp_path):
    (tmp_path / "r").mkdir()
    result = invoke("plot", tmp_path / "r")
    assert result.exit_code == 1 and "no metrics to plot" in result.output


# --------------------------------------------------------------------------- launch


def test_launch_refuses_a_busy_run_dir(tmp_path):
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        result = invoke("launch", DEMO, "--run-dir", run_dir)
        assert result.exit_code == 1
        assert f"supervisor pid {os.getpid()} holds" in result.output
        # The detached path reports the daemon's refusal the same way.
        result = invoke("launch", DEMO, "--run-dir", run_dir, "--detach")
        assert result.exit_code == 1, result.output
        assert f"supervisor pid {os.getpid()} holds" in result.output
    finally:
        lock.release()


def test_launch_argument_errors(tmp_path):
    result = invoke("launch", DEMO, "--run-dir", tmp_path / "a", "--name", "b")
    assert result.exit_code == 2 and "not both" in result.output
    result = invoke("launch", DEMO, "--run-dir", tmp_path / "a", "--resume", "newest")
    assert (
        result.exit_code == 2 and "--resume must be latest, none or a step number" in result.output
    )
    result = invoke("launch", DEMO, "--name", "a/b")
    assert result.exit_code == 2 and "plain directory name" in result.output


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\x1bb", "a\\b", "a\tb"])
def test_launch_refuses_a_name_with_a_control_character_or_separator(tmp_path, monkeypatch, name):
    monkeypatch.setenv("M3RUN_RUNS", str(tmp_path / "runs"))
    result = invoke("launch", DEMO, "--name", name)
    assert result.exit_code == 2, result.output
    assert "plain directory name" in result.output
    assert result.output.strip().count("\n") == 0  # one line: the name is shown escaped
    assert not (tmp_path / "runs").exists()


def test_launch_bad_and_changed_config_exit_78(tmp_path):
    run_dir = tmp_path / "r"
    result = invoke("launch", DEMO, "--run-dir", run_dir, "--set", "train.lr=-1")
    assert result.exit_code == EXIT_CONFIG and "train.lr" in result.output
    run_dir.mkdir()  # the refused launch left nothing behind
    (run_dir / "config.yaml").write_text(DEMO.read_text())
    result = invoke("launch", DEMO, "--run-dir", run_dir, "--set", "train.lr=0.01")
    assert result.exit_code == EXIT_CONFIG
    assert "config changed" in result.output and "train.lr: 0.003 -> 0.01" in result.output


def test_light_commands_never_import_torch(tmp_path):
    run_dir = write_run(tmp_path / "r", phase="finished")
    (run_dir / WORKER_LOG).write_text("x\n")
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from m3run.runner.cli import app\n"
        f"d = {str(run_dir)!r}\n"
        "for args in (['status', d, '--json'], ['status', d], ['stop', d], ['logs', d],\n"
        "             ['health', '--liveness', d], ['health']):\n"
        "    CliRunner().invoke(app, args, catch_exceptions=False)\n"
        "assert 'torch' not in sys.modules, 'a light command imported torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_fast_settings_are_plain_config_fields():
    # The stand-in driver passes FAST to SupervisorSettings; all but the internal knobs are
    # real config fields, so what the tests exercise is what a config can set.
    from m3run.runner.config import SupervisorConfig

    internal = {"min_heartbeat_timeout_s", "poll_s", "heartbeat_interval_s"}
    assert set(FAST) - internal <= set(SupervisorConfig.model_fields)


def test_health_liveness_catches_a_stuck_supervisor(tmp_path):
    # Alive pid, fresh heartbeat, but the supervisor stopped refreshing state.json long ago.
    run_dir = write_run(
        tmp_path / "r",
        phase="restarting",
        updated_at=time.time() - runstate.SUPERVISOR_STALE_S - 60,
    )
    result = invoke("health", "--liveness", run_dir)
    assert result.exit_code == 1 and "it is stuck" in result.output


def test_health_one_shot_can_tolerate_a_training_run_on_the_gpu(tmp_path, monkeypatch):
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"devices": [{"processes": [{"pid": 4242, "used_mib": 1000}]}]}))
    monkeypatch.setenv("M3RUN_FAKE_NVML", str(fake))
    assert invoke("health").exit_code == 69  # what a launch would see: the GPU is taken
    assert invoke("health", "--allow-processes").exit_code == 0


# --------------------------------------------------------------------------- odd input


def test_resume_with_a_non_ascii_digit_is_a_usage_error(tmp_path):
    result = invoke("launch", DEMO, "--run-dir", tmp_path / "r", "--resume", "²")
    assert result.exit_code == 2, result.output
    assert "--resume must be latest, none or a step number" in result.output


def test_a_run_dir_path_that_is_not_utf8_is_refused(tmp_path):
    run_dir = Path(os.fsdecode(bytes(tmp_path) + b"/run-\xff"))
    result = invoke("launch", DEMO, "--run-dir", run_dir)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "not a valid UTF-8 path" in result.output
    assert not os.path.exists(run_dir)


def test_status_and_checkpoints_of_a_directory_that_is_not_a_run(tmp_path):
    elsewhere = tmp_path / "etc"
    elsewhere.mkdir()
    (elsewhere / "passwd").write_text("root:x:0:0\n")
    for command in ("status", "checkpoints"):
        result = invoke(command, elsewhere)
        assert result.exit_code != 0, (command, result.output)
        assert "is not a run directory" in result.output, (command, result.output)


def test_status_names_an_unreadable_state_file(tmp_path):
    run_dir = write_run(tmp_path / "r")
    (run_dir / STATE_FILE).write_text('{"phase": "runn')
    result = invoke("status", run_dir, "--no-gpu")
    assert "not valid JSON" in result.output and "never launched" not in result.output


def test_an_empty_step_directory_does_not_fail_checkpoints_for_good(tmp_path):
    from m3run.runner.checkpoint.io import save_checkpoint

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    save_checkpoint(run_dir, 4, {"w": torch_zeros()}, {"state": {}, "param_groups": []}, {})
    (run_dir / "checkpoints" / "step_99999999").mkdir()
    result = invoke("checkpoints", run_dir)
    assert result.exit_code == 0, result.output
    assert "99999999" in result.output and "torn" in result.output


def test_checkpoints_verify_says_the_hashes_matched(tmp_path):
    from m3run.runner.checkpoint.io import save_checkpoint

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for step in (4, 8):
        save_checkpoint(run_dir, step, {"w": torch_zeros()}, {"state": {}, "param_groups": []}, {})
    weights = run_dir / "checkpoints" / "step_00000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    result = invoke("checkpoints", run_dir, "--verify")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()[1:3]}
    assert rows["4"].split()[1] == "verified"
    assert "torn: sha256 mismatch in model.safetensors" in rows["8"]
    assert "the sha256 of every file matched meta.json in 1 of 2 checkpoints" in result.output
    listed = json.loads(invoke("checkpoints", run_dir, "--verify", "--json").output)
    assert [(r["step"], r["verified"]) for r in listed] == [(4, True), (8, False)]
    # Without --verify only the sizes were checked: nothing is called verified.
    result = invoke("checkpoints", run_dir)
    assert "verified" not in result.output.replace("--verify", "")
    assert result.output.splitlines()[1].split()[1] == "complete"
    listed = json.loads(invoke("checkpoints", run_dir, "--json").output)
    assert not any(r["verified"] for r in listed)


def torch_zeros():
    import torch

    return torch.zeros(4)


def test_status_of_a_failed_cpu_run_shows_its_error_and_no_gpu_rows(tmp_path):
    run_dir = write_run(
        tmp_path / "r", phase="failed", reason="worker exit 78: bad config", peak_vram_bytes=None
    )
    cpu_beat = {"phase": "failed", "step": 3, "total_steps": 10, "step_time_s": 0.5}
    (run_dir / HEARTBEAT_FILE).write_text(json.dumps({**cpu_beat, "ts": time.time()}))
    (run_dir / WORKER_LOG).write_text(
        "step 3/10 | loss 5.0\nerror: token ids out of range in shard-00001.bin\nFix: re-run\n"
    )
    out = invoke("status", run_dir, "--no-gpu").output
    assert "error: token ids out of range in shard-00001.bin" in out
    assert "ETA" not in out and "vram" not in out and "MFU" not in out, out


def test_status_watch_off_a_terminal_prints_a_frame_per_interval(tmp_path):
    # Into a pipe, as `m3run status --watch | tee` has it: each frame arrives as it is drawn.
    # The run finishes once three frames were read, whatever the machine's pace.
    run_dir = write_run(tmp_path / "r")
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "m3run.runner.cli",
            "status",
            str(run_dir),
            "--watch",
            "--interval",
            "0.2",
            "--no-gpu",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        seen: list[str] = []
        while sum(line.startswith("phase      ") for line in seen) < 3:
            line = watch.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        state = read_json(run_dir / STATE_FILE)
        (run_dir / STATE_FILE).write_text(json.dumps({**state, "phase": "finished"}))
        out = "".join(seen) + watch.communicate(timeout=60)[0]
    finally:
        watch.kill()
    assert watch.returncode == 0, out
    assert out.splitlines()[1].startswith("phase      running")
    assert "phase      finished" in out


@pytest.mark.parametrize("detach", [False, True], ids=["foreground", "detached"])
def test_launch_refuses_a_too_deep_config_without_making_the_run_dir(tmp_path, detach):
    config = tmp_path / "deep.yaml"
    config.write_text("model: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    run_dir = tmp_path / "r"
    args = ["--detach"] if detach else []
    result = invoke("launch", config, "--run-dir", run_dir, *args)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "more than" in result.output and "Traceback" not in result.output
    assert not run_dir.exists()
