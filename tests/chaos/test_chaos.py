"""Chaos: kill, hang, poison and preempt real supervised training runs (`m3run launch` over the
real worker, configs/demo_cpu.yaml shrunk to a seconds-long run) and check the run heals.

Every run here is the same tiny deterministic config, so the uninterrupted reference run's
final weights (the sha256 recorded in its last checkpoint's meta.json) are what every healed
run must end with, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from helpers.launching import INTERVAL, TOTAL_STEPS, Run, overrides
from helpers.runs import worker_env

from m3run.runner.checkpoint.layout import list_checkpoints
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import (
    EVENTS_FILE,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    FAULT_ENV,
    FAULT_SCOPE_ENV,
    METRICS_FILE,
    SPARE_DISCARDED_EVENT,
    SPARE_FAILED_EVENT,
    SPARE_FAULT_ENV,
    SPARES_OFF_EVENT,
    STANDBY_ARG,
    SUPERVISOR_PID_ENV,
    WORKER_LOG,
)
from m3run.runner.supervisor.spare import MAX_SPARE_FAILURES

pytestmark = pytest.mark.slow


def final_weights(run_dir: Path) -> dict:
    """The tensors of the checkpoint of the last step (compared with torch.equal: the
    safetensors header may order its metadata differently between processes)."""
    from safetensors.torch import load_file

    info = [c for c in list_checkpoints(run_dir) if c.complete][-1]
    assert info.step == TOTAL_STEPS, f"last checkpoint is step {info.step}"
    return load_file(str(info.path / "model.safetensors"))


def assert_same_weights(run_dir: Path, reference: Path, context: str = "") -> None:
    import torch

    a, b = final_weights(run_dir), final_weights(reference)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"tensors differ from the uninterrupted run: {differ} {context}"


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the last train record for each step (a re-trained step overwrites)."""
    return {
        r["step"]: r["loss"] for r in read_jsonl(run_dir / METRICS_FILE) if r.get("kind") == "train"
    }


def resumed_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / METRICS_FILE) if r.get("kind") == "resume"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run = Run(run_dir, overrides(corpus))
    assert run.wait() == EXIT_OK, run.output()
    assert run.state()["phase"] == "finished"
    return run_dir


def test_sigkill_worker_three_times_ends_bitwise_equal(corpus, reference, tmp_path):
    rng = random.Random(os.getpid())
    run = Run(tmp_path / "run", overrides(corpus))
    pid, killed_at = None, []
    for low, high in ((2, 6), (8, 12), (14, 17)):
        pid = run.worker_at(rng.randint(low, high), after_pid=pid)
        killed_at.append(run.heartbeat()["step"])
        os.kill(pid, signal.SIGKILL)
    assert run.wait() == EXIT_OK, run.output()
    state = run.state()
    assert state["phase"] == "finished"
    assert [r["kind"] for r in state["restarts"]] == ["crash"] * 3, state["restarts"]
    assert all("killed by SIGKILL" in r["reason"] for r in state["restarts"])
    # A SIGKILL the supervisor did not send is weighed against the out-of-memory killer, with
    # the worker's peak memory.
    assert all("out-of-memory killer" in r["reason"] for r in state["restarts"]), state["restarts"]
    assert all("peak RSS at least" in r["reason"] for r in state["restarts"])
    assert_same_weights(run.run_dir, reference, f"(killed at steps {killed_at})")
    ref = train_losses(reference)
    assert train_losses(run.run_dir) == ref


def _spares_of(supervisor_pid: int) -> list[psutil.Process]:
    """The warm spares (`python -m m3run.runner.train --standby`) that supervisor started, alive."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            mine = proc.environ().get(SUPERVISOR_PID_ENV) == str(supervisor_pid)
            if STANDBY_ARG in (proc.info["cmdline"] or []) and mine and proc.is_running():
                found.append(proc)
    return found


def test_sigkill_hands_the_run_to_the_warm_spare(corpus, reference, tmp_path):
    """supervisor.warm_spare true: once the worker trains, its successor waits, imported; a
    SIGKILL makes that process the worker, which resumes and ends bitwise equal to the
    uninterrupted run. The first worker holds before step 6, its heartbeat going (a fault for it
    alone), which paces the test: the spare is found before the kill. (A hang fault would not
    do: its last heartbeat can name step 4, heartbeats being at most one per interval, and the
    supervisor would end it as hung.) Every spare is gone when the run ends."""
    env = worker_env(**{FAULT_ENV: "hold_at_step=6", FAULT_SCOPE_ENV: "first"})
    run = Run(tmp_path / "run", overrides(corpus, **{"supervisor.warm_spare": "true"}), env=env)
    sup = run.proc.pid
    first = run.worker_at(5)
    spare = run.wait_for(lambda: _spares_of(sup), "a warm spare")[0]
    os.kill(first, signal.SIGKILL)
    assert run.worker_at(6, after_pid=first) == spare.pid
    assert run.wait() == EXIT_OK, run.output()
    starts = [e for e in read_jsonl(run.run_dir / EVENTS_FILE) if e["event"] == "worker_start"]
    assert [e["warm_spare"] for e in starts] == [False, True], starts
    assert train_losses(run.run_dir) == train_losses(reference)
    assert_same_weights(run.run_dir, reference, "(the spare resumed the run)")
    assert not _spares_of(sup), "a spare outlived its supervisor's run"


def _events(run: Run, name: str) -> list[dict]:
    return [e for e in read_jsonl(run.run_dir / EVENTS_FILE) if e["event"] == name]


def test_spares_that_cannot_start_are_given_up_and_restarts_spawn_plainly(
    corpus, reference, tmp_path
):
    """Every spare exits 1 during its imports (M3RUN_SPARE_FAULT, which reaches spares whatever
    the fault scope). The first worker holds before step 6, its heartbeat going, so a spare is
    due at every poll: after MAX_SPARE_FAILURES failures the supervisor says it gives up and
    starts no more. A SIGKILL then restarts the run with a plain worker, and the run ends
    bitwise equal to the uninterrupted one."""
    env = worker_env(
        **{
            FAULT_ENV: "hold_at_step=6",
            FAULT_SCOPE_ENV: "first",
            SPARE_FAULT_ENV: "crash_at_import",
        }
    )
    run = Run(tmp_path / "run", overrides(corpus, **{"supervisor.warm_spare": "true"}), env=env)
    first = run.worker_at(5)
    run.wait_for(lambda: _events(run, SPARES_OFF_EVENT), "spares given up", timeout=240)
    os.kill(first, signal.SIGKILL)
    assert run.wait(timeout=240) == EXIT_OK, run.output()
    assert len(_events(run, SPARE_FAILED_EVENT)) == MAX_SPARE_FAILURES
    assert len(_events(run, SPARES_OFF_EVENT)) == 1
    assert [e["warm_spare"] for e in _events(run, "worker_start")] == [False, False]
    crashes = (run.run_dir / WORKER_LOG).read_text().count("[fault] warm spare crash")
    assert crashes == MAX_SPARE_FAILURES, crashes
    assert_same_weights(run.run_dir, reference, "(restarted without spares)")


def test_a_stopped_spare_is_discarded_and_the_restart_is_immediate(corpus, reference, tmp_path):
    """The waiting spare is SIGSTOPped, then the worker SIGKILLed: the supervisor finds the
    spare stopped at the handover, kills it and spawns a plain worker at once, instead of
    handing it the run and waiting out the startup allowance for a heartbeat that never comes
    (no hang is ever reported). The run ends bitwise equal to the uninterrupted one."""
    env = worker_env(**{FAULT_ENV: "hold_at_step=6", FAULT_SCOPE_ENV: "first"})
    run = Run(tmp_path / "run", overrides(corpus, **{"supervisor.warm_spare": "true"}), env=env)
    sup = run.proc.pid
    first = run.worker_at(5)
    spare = run.wait_for(lambda: _spares_of(sup), "a warm spare")[0]
    spare.suspend()
    run.wait_for(lambda: spare.status() == psutil.STATUS_STOPPED, "the spare stopped")
    os.kill(first, signal.SIGKILL)
    assert run.worker_at(6, after_pid=first) != spare.pid
    assert run.wait() == EXIT_OK, run.output()
    names = [e["event"] for e in read_jsonl(run.run_dir / EVENTS_FILE)]
    # The discard is the handover itself: the one event between the restart's preparation and
    # the next worker's start.
    handover = names[names.index("worker_exit") :]
    restart = handover.index("worker_start")
    assert handover[restart - 1] == SPARE_DISCARDED_EVENT, handover
    assert "hang" not in names, names
    assert [e["warm_spare"] for e in _events(run, "worker_start")] == [False, False]
    assert _events(run, SPARE_DISCARDED_EVENT)[0]["pid"] == spare.pid
    assert not spare.is_running(), "the stopped spare outlived the handover"
    assert_same_weights(run.run_dir, reference, "(restarted past a stopped spare)")


def test_sigterm_saves_stops_and_relaunch_resumes_exactly(corpus, reference, tmp_path):
    run_dir = tmp_path / "run"
    # Slow checkpoint writes pace the run (a save waits for the one before it), so the stop
    # lands well before the last step however fast the machine is.
    run = Run(run_dir, overrides(corpus), env=worker_env(**{FAULT_ENV: "slow_save=1.0"}))
    run.worker_at(4)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == EXIT_OK, run.output()
    state = run.state()
    assert state["phase"] == "stopped" and "worker saved and exited 75" in state["reason"]
    stopped_at = state["last_checkpoint_step"]
    assert 4 <= stopped_at < TOTAL_STEPS
    assert [c.step for c in list_checkpoints(run_dir) if c.complete][-1] == stopped_at

    again = Run(run_dir, overrides(corpus))
    assert again.wait() == EXIT_OK, again.output()
    assert resumed_steps(run_dir) == [stopped_at]
    assert_same_weights(run_dir, reference)
    assert train_losses(run_dir) == train_losses(reference)


def test_flipped_byte_in_newest_checkpoint_falls_back_to_previous(corpus, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, ignore=shutil.ignore_patterns("supervisor.lock"))
    newest = run_dir / "checkpoints" / f"step_{TOTAL_STEPS:08d}" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    run = Run(run_dir, overrides(corpus))
    assert run.wait() == EXIT_OK, run.output()
    previous = TOTAL_STEPS - INTERVAL
    assert resumed_steps(run_dir) == [previous]
    assert f"step_{previous:08d}" in (run_dir / WORKER_LOG).read_text()
    # Retrained from the previous checkpoint to the same weights.
    assert_same_weights(run_dir, reference)
    events = read_jsonl(run_dir / "events.jsonl")
    assert any(
        e["event"] == "checkpoint_incomplete" and e.get("step") == TOTAL_STEPS for e in events
    )


def test_kill_during_checkpoint_write_never_loads_the_torn_one(corpus, reference, tmp_path):
    run_dir = tmp_path / "run"
    # The first worker's second checkpoint write stops mid-write (data files written, meta.json
    # not) until the kill, however long the test takes to see it.
    env = worker_env(**{FAULT_ENV: f"stall_save_at_step={2 * INTERVAL}", FAULT_SCOPE_ENV: "first"})
    run = Run(run_dir, overrides(corpus), env=env)
    ckpts = run_dir / "checkpoints"
    pid = run.worker_at(1)

    def later_write() -> str | None:
        """The temp directory of a checkpoint write after the first one, once one appears."""
        with contextlib.suppress(FileNotFoundError):
            for p in ckpts.iterdir():
                m = re.match(r"\.tmp-step_(\d+)-", p.name)
                if m and int(m.group(1)) >= 2 * INTERVAL:
                    return p.name
        return None

    torn = run.wait_for(later_write, "a checkpoint being written")
    os.kill(pid, signal.SIGKILL)
    torn_step = int(re.match(r"\.tmp-step_(\d+)-", torn).group(1))
    complete = [c.step for c in list_checkpoints(run_dir) if c.complete]
    assert (ckpts / torn).exists() and torn_step not in complete
    assert run.wait() == EXIT_OK, run.output()
    # Resumed from the newest checkpoint that was complete at the kill, never the torn one.
    assert complete and resumed_steps(run_dir) == [complete[-1]]
    assert complete[-1] < torn_step
    assert_same_weights(run_dir, reference)
    assert not (ckpts / torn).exists()  # the next save cleaned the leftover up


def test_nan_exit_rolls_back_with_lower_lr_and_heals(corpus, reference, tmp_path):
    run_dir = tmp_path / "run"
    nan_from = 2 * INTERVAL + 2
    env = worker_env(**{FAULT_ENV: f"nan_from_step={nan_from}", FAULT_SCOPE_ENV: "first"})
    sets = overrides(
        corpus,
        **{
            "train.nan_max_consecutive": 1,
            "train.nan_max_rollbacks": 1,
            "supervisor.nan_lr_factor": 0.5,
        },
    )
    run = Run(run_dir, sets, env=env)
    assert run.wait() == EXIT_OK, run.output()
    state = run.state()
    (restart,) = state["restarts"]
    # Checkpoints 4 and 8 existed; the rollback skips 8 and resumes 4 at half the LR.
    assert restart["kind"] == "nan" and restart["exit_code"] == 76
    assert restart["resume"] == str(INTERVAL) and restart["lr_scale"] == 0.5
    assert f"--resume {INTERVAL} --lr-scale 0.5" in (run_dir / WORKER_LOG).read_text()
    assert resumed_steps(run_dir)[-1] == INTERVAL
    ref_lr = {
        r["step"]: r["lr"] for r in read_jsonl(reference / METRICS_FILE) if r.get("kind") == "train"
    }
    healed_lr = [r for r in read_jsonl(run_dir / METRICS_FILE) if r.get("kind") == "train"][-1]
    assert healed_lr["step"] == TOTAL_STEPS
    assert healed_lr["lr"] == pytest.approx(0.5 * ref_lr[TOTAL_STEPS], rel=1e-9)
    assert state["phase"] == "finished"


def test_sigstop_hang_is_detected_and_healed(corpus, reference, tmp_path):
    sets = overrides(
        corpus, **{"supervisor.heartbeat_timeout_s": 2, "supervisor.stop_grace_s": 0.5}
    )
    run = Run(tmp_path / "run", sets)
    pid = run.worker_at(4)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert run.wait() == EXIT_OK, run.output()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    (restart,) = run.state()["restarts"]
    assert restart["kind"] == "hang" and restart["exit_code"] == -signal.SIGKILL
    assert "no heartbeat for" in restart["reason"] and "allowance 2s" in restart["reason"]
    assert_same_weights(run.run_dir, reference)


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_cloud_preemption_notice_saves_and_exits_75(corpus, tmp_path, provider):
    from helpers.metadata_server import FakeMetadataServer

    with FakeMetadataServer(provider) as srv:
        sets = overrides(
            corpus,
            **{
                "train.total_steps": 1000,
                "supervisor.preemption_provider": "auto",
                "supervisor.metadata_url": srv.base_url,
                "supervisor.preemption_poll_s": 0.2,
            },
        )
        run = Run(tmp_path / "run", sets)
        run.worker_at(2)
        if provider == "aws":  # a second launch on the busy run dir is refused, naming the holder
            second = Run(run.run_dir, sets)
            assert second.wait() == 1
            assert f"supervisor pid {run.proc.pid} holds" in second.output()
        srv.announce()
        assert run.wait() == EXIT_STOPPED, run.output()
    state = run.state()
    assert state["phase"] == "preempted"
    assert state["reason"].startswith(f"{provider} preemption notice")
    saved = [c.step for c in list_checkpoints(run.run_dir) if c.complete]
    assert saved and saved[-1] == state["last_checkpoint_step"] >= 2
    assert run.heartbeat()["step"] == saved[-1]


def test_always_crashing_worker_backs_off_then_exits_70(corpus, tmp_path):
    sets = overrides(corpus, **{"supervisor.no_progress_restarts": 2})
    run = Run(tmp_path / "run", sets, env=worker_env(**{FAULT_ENV: "crash_at_startup"}))
    assert run.wait() == EXIT_SOFTWARE, run.output()
    state = run.state()
    assert state["phase"] == "failed" and state["reason"].startswith("no progress: 2 restarts")
    assert [r["backoff_s"] for r in state["restarts"]] == [0.0, 0.1]
    assert json.dumps(state["restarts"]).count("worker crashed (exit 1)") == 2


def test_torchrun_ranks_stop_with_exit_75(corpus, tmp_path):
    # Two CPU ranks under torchrun: torchrun itself exits 1, the rank wrapper's records say 75.
    sets = overrides(
        corpus,
        **{"distributed.nproc_per_node": 2, "train.grad_accum_steps": 2, "train.total_steps": 1000},
    )
    run = Run(tmp_path / "run", sets)
    run.worker_at(3)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == EXIT_OK, run.output()
    state = run.state()
    assert state["phase"] == "stopped" and "worker saved and exited 75" in state["reason"]
    assert state["last_exit"]["code"] == EXIT_STOPPED
    assert "torch.distributed.run" in (run.run_dir / WORKER_LOG).read_text()
