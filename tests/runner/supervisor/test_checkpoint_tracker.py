"""The supervisor's view of a run's checkpoints on its own (runner/supervisor/checkpoints.py), over
checkpoint directories written by hand in tmp_path: what counts as progress, what is reported
and never resumed from (torn, corrupt), which checkpoint a restart resumes from (the newest
complete one of the current trajectory), the rollback after a NaN exit, and the learning-rate
cut that goes with it (LrCut)."""

from __future__ import annotations

import pytest
from helpers.checkpoint_dirs import corrupt, write_checkpoint, write_torn

from m3run.runner.checkpoint.layout import checkpoint_dir
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EVENTS_FILE
from m3run.runner.supervisor.checkpoints import CheckpointTracker, LrCut
from m3run.runner.supervisor.events import EventLog

SECOND_NS = 1_000_000_000


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def tracker_for(run_dir):
    """tracker_for(resume): a tracker over run_dir that has taken stock, as at a launch with
    --resume `resume`."""
    made: list[CheckpointTracker] = []

    def make(resume: str = "latest") -> CheckpointTracker:
        tracker = CheckpointTracker(run_dir, EventLog(run_dir, console=False), resume)
        made.append(tracker)
        tracker.start(resume)
        return tracker

    yield make
    for tracker in made:
        tracker.close()


def events(run_dir, name: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == name]


# --------------------------------------------------------------------------- progress


def test_an_empty_run_dir_has_nothing_to_resume_and_no_progress(run_dir, tracker_for):
    tracker = tracker_for()
    assert tracker.last_step is None
    assert tracker.settle() is False
    assert tracker.resume_target() == "latest"


def test_what_the_run_dir_held_at_launch_is_not_progress(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20)
    write_torn(run_dir, 30, with_meta=True)
    tracker = tracker_for()
    assert tracker.last_step == 20  # the newest complete one; the torn step 30 is not
    assert tracker.settle() is False
    assert tracker.last_step == 20
    # A torn checkpoint found at launch was there before this supervisor: not reported again.
    assert events(run_dir, "checkpoint_incomplete") == []
    assert events(run_dir, "checkpoint") == []


def test_a_new_complete_checkpoint_is_progress_once(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    tracker = tracker_for()
    tracker.settle()
    write_checkpoint(run_dir, 20)
    assert tracker.settle() is True
    assert tracker.last_step == 20
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [20]
    assert tracker.settle() is False
    assert len(events(run_dir, "checkpoint")) == 1


def test_a_resaved_step_is_a_new_checkpoint(run_dir, tracker_for):
    tracker = tracker_for()
    first = write_checkpoint(run_dir, 20)
    assert tracker.settle() is True
    mtime = (first / "meta.json").stat().st_mtime_ns
    write_checkpoint(run_dir, 20, meta_mtime_ns=mtime + SECOND_NS)
    assert tracker.settle() is True
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [20, 20]


def test_a_torn_checkpoint_is_reported_once_and_is_no_progress(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    tracker = tracker_for()
    tracker.settle()
    write_torn(run_dir, 20, with_meta=True)
    assert tracker.settle() is False
    assert tracker.settle() is False
    reported = events(run_dir, "checkpoint_incomplete")
    assert [e["step"] for e in reported] == [20]
    assert "it will not be resumed from" in reported[0]["reason"]
    assert tracker.last_step == 10
    assert tracker.resume_target() == "latest"


def test_a_checkpoint_still_being_written_is_neither_reported_nor_progress(run_dir, tracker_for):
    tracker = tracker_for()
    write_torn(run_dir, 20, with_meta=False)  # data files written, meta.json not yet
    assert tracker.settle() is False
    assert events(run_dir, "checkpoint_incomplete") == []
    write_checkpoint(run_dir, 20)  # the writer finishes: meta.json last
    assert tracker.settle() is True
    assert tracker.last_step == 20


def test_a_checkpoint_failing_its_hash_is_reported_and_no_progress(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    tracker = tracker_for()
    tracker.settle()
    corrupt(write_checkpoint(run_dir, 20))
    assert tracker.settle() is False
    assert tracker.last_step == 10
    (reported,) = events(run_dir, "checkpoint_incomplete")
    assert reported["step"] == 20
    assert "step 20 failed verification: sha256 mismatch" in reported["reason"]


def test_a_corrupt_newest_checkpoint_at_launch_gives_way_to_the_one_before(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    corrupt(write_checkpoint(run_dir, 20))
    tracker = tracker_for()
    assert tracker.last_step == 20  # sizes match: only the hash check, off the loop, tells
    assert tracker.settle() is False
    assert tracker.last_step == 10
    (reported,) = events(run_dir, "checkpoint_incomplete")
    assert "the newest existing checkpoint, step 20, failed verification" in reported["reason"]
    assert "resumes from an earlier complete one" in reported["reason"]


def test_a_corrupt_only_checkpoint_at_launch_leaves_nothing_to_resume(run_dir, tracker_for):
    corrupt(write_checkpoint(run_dir, 20))
    tracker = tracker_for()
    tracker.settle()
    assert tracker.last_step is None
    (reported,) = events(run_dir, "checkpoint_incomplete")
    assert "refuses to start from scratch (exit 78)" in reported["reason"]


# --------------------------------------------------------------------------- resume targets


def test_a_launch_from_latest_restarts_from_latest(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20)
    assert tracker_for("latest").resume_target() == "latest"


def test_a_launch_from_a_step_never_restarts_onto_newer_checkpoints(run_dir, tracker_for):
    for step in (10, 20, 30):
        write_checkpoint(run_dir, step)
    write_torn(run_dir, 25, with_meta=True)
    tracker = tracker_for("20")
    assert tracker.resume_target() == "20"
    # The newest complete one of this trajectory wins; a corrupt one is passed over.
    corrupt(checkpoint_dir(run_dir, 20))
    assert tracker.resume_target() == "10"


def test_a_new_save_of_a_skipped_step_belongs_to_the_current_trajectory(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    old = write_checkpoint(run_dir, 30)
    tracker = tracker_for("10")
    assert tracker.resume_target() == "10"
    mtime = (old / "meta.json").stat().st_mtime_ns
    write_checkpoint(run_dir, 30, meta_mtime_ns=mtime + SECOND_NS)
    assert tracker.resume_target() == "30"


def test_a_launch_from_scratch_restarts_from_scratch_until_it_saves(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20)
    tracker = tracker_for("none")
    assert tracker.resume_target() == "none"
    write_checkpoint(run_dir, 5)
    write_torn(run_dir, 8, with_meta=True)
    assert tracker.resume_target() == "5"


# --------------------------------------------------------------------------- rollback


def test_a_rollback_goes_past_the_latest_checkpoint_to_the_one_before(run_dir, tracker_for):
    for step in (10, 20):
        write_checkpoint(run_dir, step)
    corrupt(write_checkpoint(run_dir, 30))  # never the rollback's "latest"
    write_torn(run_dir, 40, with_meta=True)
    tracker = tracker_for()
    resume, how = tracker.rollback_target()
    assert resume == "10"
    assert how == "rolling back past checkpoint 20 to 10"
    assert tracker.last_step == 10
    # Later restarts keep off the checkpoints past the rollback target.
    assert tracker.resume_target() == "10"


def test_rollbacks_in_a_row_go_one_checkpoint_further_back_each(run_dir, tracker_for):
    for step in (5, 10, 20):
        write_checkpoint(run_dir, step)
    tracker = tracker_for()
    assert tracker.rollback_target()[0] == "10"
    assert tracker.rollback_target()[0] == "5"
    resume, how = tracker.rollback_target()
    assert (resume, how) == ("5", "only checkpoint 5 exists: resuming from it")


def test_a_rollback_with_one_checkpoint_resumes_from_it(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    tracker = tracker_for()
    assert tracker.rollback_target() == ("10", "only checkpoint 10 exists: resuming from it")
    assert tracker.last_step == 10


def test_a_rollback_without_a_checkpoint_restarts_from_what_the_run_started_from(
    run_dir, tracker_for
):
    write_torn(run_dir, 10, with_meta=True)
    tracker = tracker_for("none")
    resume, how = tracker.rollback_target()
    assert (resume, how) == ("none", "no complete checkpoint: restarting from the start")


# --------------------------------------------------------------------------- stored LR scale


def test_the_stored_scale_is_the_one_of_the_checkpoint_a_worker_loads(run_dir, tracker_for):
    write_checkpoint(run_dir, 10, lr_scale=0.5)
    write_checkpoint(run_dir, 20, lr_scale=0.25)
    write_torn(run_dir, 30, with_meta=True)
    write_checkpoint(run_dir, 40)  # predates the field
    tracker = tracker_for()
    assert tracker.stored_scale("10") == 0.5
    assert tracker.stored_scale("20") == 0.25
    assert tracker.stored_scale("30") == 1.0  # torn: nothing is loaded from it
    assert tracker.stored_scale("40") == 1.0
    assert tracker.stored_scale("none") == 1.0
    assert tracker.stored_scale("15") == 1.0  # no such checkpoint


def test_latest_reads_the_scale_of_the_newest_complete_checkpoint(run_dir, tracker_for):
    write_checkpoint(run_dir, 10, lr_scale=0.5)
    write_torn(run_dir, 20, with_meta=True)
    assert tracker_for().stored_scale("latest") == 0.5


@pytest.mark.parametrize("stored", [0, -0.5, "0.5"])
def test_a_stored_scale_that_is_no_positive_number_reads_as_one(run_dir, tracker_for, stored):
    write_checkpoint(run_dir, 10, lr_scale=stored)
    assert tracker_for().stored_scale("10") == 1.0


# --------------------------------------------------------------------------- the LR cut


def test_without_a_nan_exit_no_worker_is_cut(run_dir, tracker_for):
    write_checkpoint(run_dir, 10, lr_scale=0.5)
    cut = LrCut(tracker_for(), factor=0.5)
    cut.launched("10", 1.0)
    assert cut.cut is None
    assert cut.lr_scale_for("10") == 1.0
    assert cut.lr_scale_for("none") == 1.0


def test_a_nan_exit_cuts_the_scale_the_failing_worker_ran_at(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    cut = LrCut(tracker_for(), factor=0.5)
    cut.launched("10", 1.0)
    cut.nan_exit()
    assert cut.cut == 0.5
    assert cut.lr_scale_for("10") == 0.5
    assert cut.lr_scale_for("none") == 0.5


def test_a_checkpoint_that_already_carries_the_cut_is_not_cut_again(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20, lr_scale=0.5)  # saved by the worker that ran at the cut
    write_checkpoint(run_dir, 30, lr_scale=0.125)  # cut further in-process
    cut = LrCut(tracker_for(), factor=0.5)
    cut.launched("10", 1.0)
    cut.nan_exit()
    assert cut.lr_scale_for("20") == 1.0
    # Never a factor above 1: the supervisor does not raise what a checkpoint holds.
    assert cut.lr_scale_for("30") == 1.0


def test_nan_exits_in_a_row_compound(run_dir, tracker_for):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20, lr_scale=0.5)
    cut = LrCut(tracker_for(), factor=0.5)
    cut.launched("10", 1.0)
    cut.nan_exit()
    cut.launched("10", cut.lr_scale_for("10"))  # the restart ran at 0.5× and failed again
    cut.nan_exit()
    assert cut.cut == pytest.approx(0.25)
    assert cut.lr_scale_for("10") == pytest.approx(0.25)
    assert cut.lr_scale_for("20") == pytest.approx(0.5)


def test_the_cut_is_relative_to_the_scale_the_checkpoint_gave_the_worker(run_dir, tracker_for):
    write_checkpoint(run_dir, 20, lr_scale=0.5)
    cut = LrCut(tracker_for(), factor=0.1)
    cut.launched("20", 1.0)  # ran at 0.5: the checkpoint's scale times --lr-scale 1.0
    cut.nan_exit()
    assert cut.cut == pytest.approx(0.05)
    assert cut.lr_scale_for("20") == pytest.approx(0.1)
