"""docker/entrypoint, the image's wrapper around `m3run`, run by /bin/sh as in the image with a
stand-in `m3run` first on PATH (the wrapper is what is under test, not the supervisor)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m3run.runner.protocol import EXIT_CONFIG, EXIT_SOFTWARE, EXIT_STOPPED, EXIT_UNAVAILABLE

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint"

# The stand-in: records each call, then behaves as STANDIN_MODE says:
#   exit:N   exit N at once
#   wait     write `ready`, wait for a signal, record it, exit STANDIN_EXIT (default 0)
STANDIN = f"""#!{sys.executable}
import os, signal, sys, time
from pathlib import Path
d = Path(os.environ["STANDIN_DIR"])
with open(d / "calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
mode = os.environ.get("STANDIN_MODE", "exit:0")
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
def on_signal(signum, frame):
    (d / "signal").write_text(signal.Signals(signum).name)
    sys.exit(int(os.environ.get("STANDIN_EXIT", "0")))
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_signal)
(d / "ready").write_text(str(os.getpid()))
time.sleep(60)
sys.exit(99)
"""


@pytest.fixture
def box(tmp_path):
    """A PATH with the stand-in m3run, and the environment the wrapper runs in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "m3run").write_text(STANDIN)
    (bin_dir / "m3run").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STANDIN_DIR": str(tmp_path),
        "M3RUN_HALT_FILE": str(tmp_path / "halted"),
    }
    return tmp_path, env


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _signals_as_tini_leaves_them() -> None:
    """In the child before exec: SIGINT, SIGTERM and SIGHUP at their defaults and unblocked, as
    the entrypoint finds them in a fresh container under tini. The test process may carry them
    ignored or blocked (a library's doing, inherited across fork and exec), and sh cannot trap a
    signal ignored on entry: that would test the harness, not the wrapper."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def run(env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/sh", str(ENTRYPOINT), *args],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=_signals_as_tini_leaves_them,
    )


def _spawn(script: Path, env: dict, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["/bin/sh", str(script), "launch", "cfg.yaml"],
        env={**env, "STANDIN_MODE": "wait", **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_signals_as_tini_leaves_them,
    )


def _wait_ready(proc: subprocess.Popen, d: Path) -> None:
    deadline = time.monotonic() + 20
    while not (d / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def calls(d: Path) -> list[str]:
    path = d / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_halt_codes_are_the_protocols_verdicts():
    line = re.search(r'^HALT_CODES="([^"]*)"', ENTRYPOINT.read_text(), re.M).group(1)
    assert {int(c) for c in line.split()} == {EXIT_UNAVAILABLE, EXIT_SOFTWARE, EXIT_CONFIG}


@pytest.mark.parametrize("code", [EXIT_UNAVAILABLE, EXIT_SOFTWARE, EXIT_CONFIG])
def test_a_verdict_latches_and_later_starts_exit_without_launching(box, code):
    d, env = box
    first = run(env, "launch", "cfg.yaml", "--run-dir", "/runs/x", STANDIN_MODE=f"exit:{code}")
    assert first.returncode == code
    assert calls(d) == ["launch cfg.yaml --run-dir /runs/x"]
    record = (d / "halted").read_text()
    assert f"exit_code={code}" in record and "command=m3run launch cfg.yaml" in record

    again = run(env, "launch", "cfg.yaml", "--run-dir", "/runs/x", STANDIN_MODE="exit:0")
    assert again.returncode == code
    assert len(calls(d)) == 1  # the second start never ran m3run
    assert "not launching" in again.stderr and "--force-recreate" in again.stderr
    # other commands (status, stop, health) still work in a halted container
    assert run(env, "status", "/runs/x").returncode == 0
    assert calls(d)[-1] == "status /runs/x"


@pytest.mark.parametrize("code", [0, 1, EXIT_STOPPED, 137])
def test_other_exits_pass_through_without_latching(box, code):
    d, env = box
    assert run(env, "launch", "cfg.yaml", STANDIN_MODE=f"exit:{code}").returncode == code
    assert not (d / "halted").exists()
    assert run(env, "launch", "cfg.yaml", STANDIN_MODE="exit:0").returncode == 0
    assert len(calls(d)) == 2


def test_non_launch_commands_are_plain_m3run(box):
    d, env = box
    r = run(env, "health", "--liveness", "/runs/x", STANDIN_MODE="exit:1")
    assert r.returncode == 1 and calls(d) == ["health --liveness /runs/x"]


def _start_waiting(env: dict, d: Path, **extra: str) -> subprocess.Popen:
    proc = _spawn(ENTRYPOINT, env, **extra)
    _wait_ready(proc, d)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_reach_m3run_and_its_exit_code_comes_back(box, sig):
    d, env = box
    proc = _start_waiting(env, d, STANDIN_EXIT="0")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert (d / "signal").read_text() == sig.name
    assert proc.returncode == 0, err  # no M3RUN_SIGNAL_EXIT: a stop is a stop


def test_a_signal_between_the_fork_and_knowing_the_childs_pid_is_forwarded(box, tmp_path):
    """The shell runs a trap between two commands, so one for a signal that arrives right after
    `m3run &` forks finds no pid to forward to yet. A copy of the entrypoint that sleeps there
    holds that window open while the stand-in starts: the signal must still reach m3run."""
    d, env = box
    text = ENTRYPOINT.read_text()
    assert text.count('m3run "$@" &\n') == 1
    slow = tmp_path / "entrypoint"
    slow.write_text(text.replace('m3run "$@" &\n', 'm3run "$@" &\nsleep 1\n'))
    proc = _spawn(slow, env, STANDIN_EXIT="0")
    _wait_ready(proc, d)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert (d / "signal").read_text() == "SIGINT"
    assert proc.returncode == 0, err


def test_signal_exit_turns_a_platform_stop_into_a_reschedule(box):
    d, env = box
    proc = _start_waiting(env, d, STANDIN_EXIT="0", M3RUN_SIGNAL_EXIT=str(EXIT_STOPPED))
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == EXIT_STOPPED and "rescheduled" in err
    assert not (d / "halted").exists()


def test_signal_exit_leaves_failures_alone(box):
    d, env = box
    proc = _start_waiting(
        env, d, STANDIN_EXIT=str(EXIT_CONFIG), M3RUN_SIGNAL_EXIT=str(EXIT_STOPPED)
    )
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == EXIT_CONFIG and (d / "halted").exists()


def test_without_a_signal_exit_0_stays_0_even_with_signal_exit_set(box):
    _, env = box
    r = run(env, "launch", "cfg.yaml", STANDIN_MODE="exit:0", M3RUN_SIGNAL_EXIT="75")
    assert r.returncode == 0
