"""`m3run plot` after restarts: the data it draws goes forward in step, keeps the replayed
steps' last records, and marks restarts, rollbacks and config changes."""

from __future__ import annotations

import itertools
import tracemalloc

from typer.testing import CliRunner

from m3run.runner import plot
from m3run.runner.cli import app
from m3run.runner.files import append_jsonl
from m3run.runner.plot import curves, plot_run
from m3run.runner.protocol import EVENTS_FILE, METRICS_FILE


def _train(run_dir, steps, loss_offset: float, t0: float) -> None:
    for s in steps:
        append_jsonl(
            run_dir / METRICS_FILE,
            {
                "kind": "train",
                "step": s,
                "loss": 10.0 - s / 10 + loss_offset,
                "lr": 1e-3,
                "grad_norm": 1.0,
                "tokens_per_s": 1000.0,
                "time": t0 + s,
            },
        )


def test_a_run_resumed_from_an_earlier_step_plots_no_backward_lines(tmp_path):
    _train(tmp_path, range(1, 41), 0.0, 1000.0)
    # Killed at step 40, resumed from the checkpoint at 22: steps 23..40 are trained again.
    append_jsonl(tmp_path / METRICS_FILE, {"kind": "resume", "step": 22, "time": 2000.0})
    append_jsonl(tmp_path / EVENTS_FILE, {"event": "config_replaced", "time": 2000.5})
    _train(tmp_path, range(23, 61), 0.5, 2000.0)
    append_jsonl(tmp_path / METRICS_FILE, {"kind": "rollback", "step": 50, "time": 2100.0})
    _train(tmp_path, range(51, 71), 1.0, 2100.0)

    data = curves(tmp_path)
    for key, (steps, values) in data.series.items():
        assert steps == sorted(set(steps)), f"{key} goes back in step"
        assert len(steps) == len(values) == 70
    steps, losses = data.series["loss"]
    # The replayed step's last record wins: the weights descend from it.
    assert losses[steps.index(30)] == 10.0 - 3.0 + 0.5
    assert losses[steps.index(55)] == 10.0 - 5.5 + 1.0
    kinds = {(m.kind, m.step) for m in data.markers}
    assert ("restart", 22) in kinds and ("rollback", 50) in kinds and ("config", 23) in kinds
    (restart,) = [m for m in data.markers if m.kind == "restart"]
    assert "back from 40" in restart.label
    assert plot_run(tmp_path).stat().st_size > 0


def test_binary_and_non_utf8_lines_are_skipped_and_counted_once(tmp_path):
    _train(tmp_path, range(1, 11), 0.0, 1000.0)
    with open(tmp_path / METRICS_FILE, "ab") as f:
        f.write(b"\x00\x01\x02\xff\xfe binary junk\n")
        f.write(b'{"kind": "train", "step": 11, "loss": 1.0, "note": "\xff\xfe"}\n')
        f.write(b"\x07" * (3 * 2**20) + b"\n")  # longer than any record: skipped unread
    _train(tmp_path, range(12, 21), 0.0, 1000.0)
    with open(tmp_path / METRICS_FILE, "ab") as f:
        f.write(b'{"kind": "train", "st')  # a writer's torn last line is not counted
    result = CliRunner().invoke(app, ["plot", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.output.count("skipped 3 unreadable lines") == 1, result.output
    assert str(tmp_path / METRICS_FILE) in result.output
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert curves(tmp_path).series["loss"][0] == [*range(1, 11), *range(12, 21)]


def test_a_long_metrics_file_plots_in_bounded_memory(tmp_path):
    n = 120_000
    record = (
        '{{"kind": "train", "step": {0}, "loss": {1}, "lr": 0.001, "grad_norm": 1.0, '
        '"tokens_per_s": 1000.0, "time": {0}}}\n'
    )
    with open(tmp_path / METRICS_FILE, "w") as f:
        for start in range(1, n + 1, 10_000):
            f.write("".join(record.format(s, s / n) for s in range(start, start + 10_000)))
    tracemalloc.start()
    try:
        data = curves(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Every record kept would take some 50 MB here; the downsampled curves a few.
    assert peak < 16 * 2**20, f"reading {n} records peaked at {peak / 2**20:.0f} MiB"
    steps, losses = data.series["loss"]
    assert len(steps) <= plot.MAX_POINTS and steps == sorted(set(steps))
    assert steps[-1] == n and losses == [s / n for s in steps]
    assert max(b - a for a, b in itertools.pairwise(steps)) <= 2 * n / plot.MAX_POINTS
