"""The worker's policy for non-finite steps on its own (runner/worker/excursions.py): the streak
that calls for an in-process rollback, the rollback's learning-rate cut (its factor, compounding,
and the limit past which the worker gives up with exit 76), the data windows never trained on
again, and the checkpoint rolled back to (the newest complete one, over real checkpoint
directories in tmp_path). The trainer's side of it, with real NaNs, is in test_train.py."""

from __future__ import annotations

import pydantic
import pytest
from helpers.checkpoint_dirs import corrupt, write_checkpoint, write_torn

from m3run.runner.checkpoint.layout import checkpoint_dir
from m3run.runner.config import TrainConfig
from m3run.runner.worker.dist import Dist
from m3run.runner.worker.excursions import Excursions, NaNExcursion


def train_config(**nan) -> TrainConfig:
    return TrainConfig(total_steps=100, micro_batch_size=1, lr=1e-3, warmup_steps=1, **nan)


class Telemetry:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def record(self, rec: dict) -> None:
        self.records.append(rec)

    def kinds(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]


class Checkpointer:
    """The worker's checkpointing as a rollback uses it. load() restores the counters of a
    checkpoint saved before any rollback, as the trainer's load_state_dict would; `in_flight`
    is a save that finish_saves() completes."""

    def __init__(self, excursions: Excursions, run_dir, in_flight: int | None = None):
        self.excursions = excursions
        self.run_dir = run_dir
        self.in_flight = in_flight
        self.calls: list = []

    def finish_saves(self) -> None:
        self.calls.append("finish_saves")
        if self.in_flight is not None:
            write_checkpoint(self.run_dir, self.in_flight)
            self.in_flight = None

    def load(self, path) -> None:
        self.calls.append(path)
        ex = self.excursions
        ex.lr_scale, ex.rollbacks, ex.skip_positions = 1.0, 0, []


class Loader:
    def __init__(self, position: int):
        self.windows_consumed = position

    def skip(self, n: int) -> None:
        self.windows_consumed += n


@pytest.fixture
def rank(monkeypatch):
    """rank(local_rank): the Dist of a single-process run, or of a rank that does not write."""

    def make(local_rank: int = 0) -> Dist:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        return Dist()

    return make


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return d


def nonfinite(pos: int) -> dict:
    return {"start_pos": pos, "loss": float("nan"), "grad_norm": float("inf")}


def streak(ex: Excursions, telemetry: Telemetry, step: int, positions: list[int]) -> bool:
    """Non-finite steps from `step` on, one per data position; whether the last called for a
    rollback."""
    calls = [ex.bad_step(step + i, nonfinite(pos), telemetry) for i, pos in enumerate(positions)]
    return calls[-1]


# --------------------------------------------------------------------------- the streak


def test_the_nth_non_finite_step_in_a_row_calls_for_a_rollback(rank, capsys):
    ex = Excursions(train_config(nan_max_consecutive=3), rank())
    telemetry = Telemetry()
    assert [ex.bad_step(s, nonfinite(8 * s), telemetry) for s in (5, 6, 7)] == [False, False, True]
    assert ex.streak == [40, 48, 56]
    assert [r["step"] for r in telemetry.kinds("nonfinite")] == [5, 6, 7]
    assert "step 7: non-finite loss nan / grad norm inf: step skipped (3 in a row)" in (
        capsys.readouterr().out
    )


def test_a_finite_step_ends_the_streak(rank):
    ex = Excursions(train_config(nan_max_consecutive=3), rank())
    telemetry = Telemetry()
    assert streak(ex, telemetry, 5, [0, 1]) is False
    ex.good_step()
    assert ex.streak == []
    assert streak(ex, telemetry, 8, [2, 3]) is False
    assert streak(ex, telemetry, 10, [4]) is True


def test_one_non_finite_step_calls_for_a_rollback_when_the_limit_is_one(rank):
    ex = Excursions(train_config(nan_max_consecutive=1), rank())
    assert ex.bad_step(1, nonfinite(0), Telemetry()) is True


# --------------------------------------------------------------------------- the rollback


def test_each_rollback_cuts_the_learning_rate_by_the_factor(rank, run_dir):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_lr_factor=0.5, nan_max_rollbacks=3), rank())
    saves, telemetry = Checkpointer(ex, run_dir), Telemetry()
    scales = []
    for step in (13, 15, 17):
        streak(ex, telemetry, step - 2, [step, step + 1, step + 2])
        ex.rollback(step, run_dir, saves, telemetry)
        scales.append(ex.lr_scale)
    # The checkpoint loaded each time holds the scale from before any rollback: what the
    # rollbacks decided outlives it, and compounds.
    assert scales == pytest.approx([0.5, 0.25, 0.125])
    assert ex.rollbacks == 3
    assert saves.calls == ["finish_saves", checkpoint_dir(run_dir, 10)] * 3


def test_the_cut_compounds_on_the_scale_the_worker_resumed_with(rank, run_dir):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_lr_factor=0.1), rank())
    ex.lr_scale = 0.5  # a checkpoint's scale times the supervisor's --lr-scale
    ex.rollback(12, run_dir, Checkpointer(ex, run_dir), Telemetry())
    assert ex.lr_scale == pytest.approx(0.05)


def test_past_the_rollback_limit_the_worker_gives_up(rank, run_dir):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_lr_factor=0.5, nan_max_rollbacks=2), rank())
    saves, telemetry = Checkpointer(ex, run_dir), Telemetry()
    ex.rollback(12, run_dir, saves, telemetry)
    ex.rollback(14, run_dir, saves, telemetry)
    loads = len(saves.calls)
    with pytest.raises(
        NaNExcursion,
        match=r"^2 in-process rollbacks did not heal the non-finite loss/gradients at step 16$",
    ):
        ex.rollback(16, run_dir, saves, telemetry)
    assert len(saves.calls) == loads  # nothing loaded, no further cut
    assert ex.lr_scale == pytest.approx(0.25)


def test_without_a_complete_checkpoint_the_worker_gives_up(rank, run_dir):
    write_torn(run_dir, 10, with_meta=True)
    corrupt(write_checkpoint(run_dir, 20))
    ex = Excursions(train_config(), rank())
    saves = Checkpointer(ex, run_dir)
    with pytest.raises(NaNExcursion, match="at step 23 and no complete checkpoint to roll back"):
        ex.rollback(23, run_dir, saves, Telemetry())
    assert saves.calls == ["finish_saves"]
    assert ex.lr_scale == 1.0


def test_the_rollback_restores_the_newest_complete_checkpoint(rank, run_dir):
    write_checkpoint(run_dir, 10)
    write_checkpoint(run_dir, 20)
    write_torn(run_dir, 30, with_meta=False)
    corrupt(write_checkpoint(run_dir, 40))
    ex = Excursions(train_config(), rank())
    saves = Checkpointer(ex, run_dir)
    ex.rollback(43, run_dir, saves, Telemetry())
    assert saves.calls == ["finish_saves", checkpoint_dir(run_dir, 20)]


def test_a_save_still_being_written_is_finished_and_rolled_back_to(rank, run_dir):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(), rank())
    saves = Checkpointer(ex, run_dir, in_flight=20)
    ex.rollback(23, run_dir, saves, Telemetry())
    assert saves.calls == ["finish_saves", checkpoint_dir(run_dir, 20)]


def test_the_streaks_windows_are_never_trained_on_again(rank, run_dir):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_max_consecutive=2), rank())
    saves, telemetry = Checkpointer(ex, run_dir), Telemetry()
    streak(ex, telemetry, 11, [48, 44])
    ex.rollback(12, run_dir, saves, telemetry)
    assert (ex.skip_positions, ex.streak) == ([44, 48], [])
    streak(ex, telemetry, 11, [52, 44])
    ex.rollback(12, run_dir, saves, telemetry)
    assert ex.skip_positions == [44, 48, 52]


def test_a_rollback_is_recorded_and_told(rank, run_dir, capsys):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_max_consecutive=2, nan_lr_factor=0.5), rank())
    telemetry = Telemetry()
    streak(ex, telemetry, 11, [40, 44])
    ex.rollback(12, run_dir, Checkpointer(ex, run_dir), telemetry)
    (record,) = telemetry.kinds("rollback")
    assert {k: record[k] for k in ("step", "lr_scale", "skipped_positions")} == {
        "step": 10,
        "lr_scale": 0.5,
        "skipped_positions": [40, 44],
    }
    assert "NaN rollback #1: restored step 10, lr scale 0.5, skipping 2 data window(s)" in (
        capsys.readouterr().out
    )


def test_a_rank_that_does_not_write_cuts_the_same_and_keeps_quiet(rank, run_dir, capsys):
    write_checkpoint(run_dir, 10)
    ex = Excursions(train_config(nan_max_consecutive=2, nan_lr_factor=0.5), rank(local_rank=1))
    telemetry = Telemetry()
    assert streak(ex, telemetry, 11, [40, 44]) is True
    ex.rollback(12, run_dir, Checkpointer(ex, run_dir), telemetry)
    assert (ex.lr_scale, ex.skip_positions, ex.rollbacks) == (0.5, [40, 44], 1)
    assert telemetry.records == []
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("factor", [0.0, -0.5, 1.5])
def test_a_factor_that_would_not_cut_or_would_raise_is_refused(factor):
    with pytest.raises(pydantic.ValidationError, match="nan_lr_factor"):
        train_config(nan_lr_factor=factor)


# --------------------------------------------------------------------------- skipped windows


def test_the_loader_skips_every_marked_window_a_step_at_a_time(rank, capsys):
    ex = Excursions(train_config(), rank())
    ex.skip_positions = [4, 6, 12]
    loader = Loader(position=4)
    ex.skip_windows(loader, windows=2)
    assert loader.windows_consumed == 8  # past 4 and 6, a step's two windows each
    out = capsys.readouterr().out
    assert "skipping the data window at position 4" in out
    assert "skipping the data window at position 6" in out
    loader = Loader(position=5)
    ex.skip_windows(loader, windows=2)
    assert loader.windows_consumed == 5  # not at a marked position: nothing to skip
