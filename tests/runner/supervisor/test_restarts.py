"""The restart policy on its own (runner/supervisor/restarts.py), on a clock the tests move: the
budget of restarts per sliding window, the limit on restarts in a row without a new complete
checkpoint, the backoff between them, and what a worker's ending is diagnosed as. Whole runs that
reach these limits through a supervisor are in test_supervisor.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.checkpoint_dirs import write_checkpoint
from helpers.supervision import settings

from m3run.runner.protocol import EXIT_NAN, EXIT_STOPPED
from m3run.runner.supervisor import restarts
from m3run.runner.supervisor.checkpoints import CheckpointTracker, LrCut
from m3run.runner.supervisor.events import EventLog
from m3run.runner.supervisor.restarts import Restart, RestartPolicy, diagnose
from m3run.runner.supervisor.worker import Outcome

LOG = Path("runs/r/worker.log")


class Clock:
    """What restarts.py reads as time.time()."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(restarts, "time", SimpleNamespace(time=c.time))
    return c


def policy(**over) -> RestartPolicy:
    base = dict(
        max_restarts=3,
        restart_window_s=100.0,
        no_progress_restarts=10,
        backoff_initial_s=2.0,
        backoff_max_s=5.0,
    )
    return RestartPolicy(settings(**{**base, **over}))


def granted(p: RestartPolicy, failure: str = "exit 1") -> Restart:
    out = p.grant(failure, LOG)
    assert isinstance(out, Restart), out
    return out


def test_the_first_restart_is_immediate_and_later_ones_in_a_row_back_off_to_the_cap(clock):
    p = policy(max_restarts=10)
    delays = []
    for _ in range(6):
        delays.append(granted(p).backoff_s)
        clock.now += 1.0
    # Immediate, then backoff_initial_s doubling each time, never above backoff_max_s.
    assert delays == [0.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def test_a_granted_restart_carries_its_time_and_its_place_in_the_window(clock):
    p = policy()
    first = granted(p)
    clock.now += 10.0
    second = granted(p)
    assert (first.time, first.in_window) == (1_000.0, 1)
    assert (second.time, second.in_window) == (1_010.0, 2)


def test_progress_makes_the_next_restart_immediate_again(clock):
    p = policy(max_restarts=10)
    granted(p)
    assert granted(p).backoff_s == 2.0
    p.progress()
    assert p.since_progress == 0
    assert granted(p).backoff_s == 0.0
    assert granted(p).backoff_s == 2.0


def test_the_budget_counts_restarts_in_the_window_whatever_the_progress(clock):
    p = policy(max_restarts=3, restart_window_s=100.0)
    for _ in range(3):
        granted(p)
        p.progress()  # progress resets the streak, never the budget
        clock.now += 10.0
    refusal = p.grant("killed by SIGKILL", LOG)
    assert isinstance(refusal, str)
    assert refusal.startswith("restart budget spent: 3 restarts in the last 100s")
    assert "supervisor.max_restarts=3" in refusal
    assert "last failure: killed by SIGKILL" in refusal
    assert str(LOG) in refusal


def test_restarts_leave_the_window_once_it_has_passed_them(clock):
    p = policy(max_restarts=2, restart_window_s=100.0)
    granted(p)  # t=1000
    clock.now = 1_050.0
    granted(p)  # t=1050
    clock.now = 1_099.999
    assert isinstance(p.grant("exit 1", LOG), str)
    # Exactly restart_window_s later the first restart is out of the window: one slot frees.
    clock.now = 1_100.0
    third = granted(p)
    assert third.in_window == 2
    assert isinstance(p.grant("exit 1", LOG), str)


def test_a_refused_restart_is_not_counted(clock):
    p = policy(max_restarts=1, restart_window_s=100.0)
    granted(p)
    for _ in range(5):
        assert isinstance(p.grant("exit 1", LOG), str)
    # The refusals took no slot and no step of the streak: one window later, one restart,
    # backed off as the second in a row (the first was never followed by progress).
    clock.now += 100.0
    again = granted(p)
    assert (again.in_window, again.backoff_s) == (1, 2.0)


def test_a_budget_of_zero_refuses_the_first_restart(clock):
    refusal = policy(max_restarts=0).grant("exit 1", LOG)
    assert isinstance(refusal, str)
    assert refusal.startswith("restart budget spent: 0 restarts")


def test_restarts_without_a_new_checkpoint_give_up_at_the_limit(clock):
    p = policy(max_restarts=100, no_progress_restarts=3)
    for _ in range(3):
        granted(p)
    refusal = p.grant("worker hung", LOG)
    assert isinstance(refusal, str)
    assert refusal.startswith("no progress: 3 restarts in a row without a new complete checkpoint")
    assert "supervisor.no_progress_restarts=3" in refusal
    assert "last failure: worker hung" in refusal
    assert str(LOG) in refusal
    # Still refused, and not counted, until a checkpoint is verified; then granted again.
    assert isinstance(p.grant("worker hung", LOG), str)
    assert p.since_progress == 3
    p.progress()
    assert granted(p).backoff_s == 0.0


def test_the_spent_budget_is_named_before_the_missing_progress(clock):
    p = policy(max_restarts=2, no_progress_restarts=2)
    granted(p)
    granted(p)
    refusal = p.grant("exit 1", LOG)
    assert isinstance(refusal, str)
    assert refusal.startswith("restart budget spent")


# --------------------------------------------------------------------------- diagnose


@pytest.fixture
def tracked(tmp_path):
    """(tracker, lr_cut) of a run dir holding complete checkpoints at steps 10 and 20."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20)
    tracker = CheckpointTracker(run_dir, EventLog(run_dir, console=False), "latest")
    tracker.start("latest")
    yield tracker, LrCut(tracker, factor=0.5)
    tracker.close()


def test_a_hang_is_a_hang_whatever_the_exit_code(tracked):
    tracker, cut = tracked
    kind, reason, resume = diagnose(Outcome(exit_code=EXIT_NAN, hang="no heartbeat"), tracker, cut)
    assert (kind, reason, resume) == ("hang", "no heartbeat", "latest")
    assert cut.cut is None  # a hang is not a NaN exit: no learning-rate cut


def test_a_nan_exit_rolls_back_a_checkpoint_and_cuts_the_learning_rate(tracked):
    tracker, cut = tracked
    cut.launched("latest", 1.0)
    kind, reason, resume = diagnose(Outcome(exit_code=EXIT_NAN), tracker, cut)
    assert (kind, resume) == ("nan", "10")
    assert "rolling back past checkpoint 20 to 10" in reason
    assert "learning rate cut to 0.5× the schedule" in reason
    assert cut.cut == 0.5


def test_an_exit_75_nobody_asked_for_resumes(tracked):
    tracker, cut = tracked
    kind, reason, resume = diagnose(Outcome(exit_code=EXIT_STOPPED), tracker, cut)
    assert (kind, resume) == ("unrequested_stop", "latest")
    assert reason.startswith("worker exit 75")


@pytest.mark.parametrize(
    ("code", "described"), [(1, "exit 1"), (-9, "killed by SIGKILL"), (-11, "killed by SIGSEGV")]
)
def test_any_other_ending_is_a_crash_named_by_its_exit(tracked, code, described):
    tracker, cut = tracked
    assert diagnose(Outcome(exit_code=code), tracker, cut) == (
        "crash",
        f"worker crashed ({described})",
        "latest",
    )
