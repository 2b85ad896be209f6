"""`m3run plot`: training curves of a run as one PNG, from its metrics.jsonl.

A run that restarted replays the steps after the checkpoint it resumed from, so metrics.jsonl
holds some steps more than once. The curves keep the last record of each step (the one the
run's weights descend from) and draw every line forward in step; restarts, NaN rollbacks and
config changes are marked where they happened.

The files are read one line at a time and each curve is downsampled as it is read (`_Series`),
so a metrics file of any size plots in bounded memory.

matplotlib is imported inside `plot_run` (Agg backend, no display needed) so the CLI stays
light for the commands that do not draw.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from m3run.runner.files import JsonlReader
from m3run.runner.protocol import EVENTS_FILE, METRICS_FILE

PLOT_FILE = "curves.png"
CURVES = ("loss", "lr", "grad_norm", "tokens_per_s")
# Points per curve at most. A panel of the 12-inch figure at 100 dpi is about 600 pixels wide,
# so a few thousand points draw the same line as millions would.
MAX_POINTS = 4096


class PlotError(Exception):
    """Nothing to plot, or no plotting library. The message says what to do."""


@dataclass(frozen=True)
class Marker:
    """A vertical line on the curves: what happened at which step."""

    step: float
    kind: str  # "restart" | "rollback" | "config"
    label: str


@dataclass
class Curves:
    """What the PNG shows: per curve, (steps, values) ascending in step, and the markers."""

    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    eval_loss: tuple[list[float], list[float]] = ([], [])
    markers: list[Marker] = field(default_factory=list)
    skipped: dict[Path, int] = field(default_factory=dict)  # file -> lines not UTF-8 JSON


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Series:
    """One curve, downsampled as it is read. Points are bucketed by step, `width` steps to a
    bucket (1 at first: every step its own bucket, so an ordinary run's curve is exact), and a
    bucket keeps the last record, in file order, that fell into it: a replayed step's later
    record wins, as the weights descend from it. When the buckets pass MAX_POINTS the width
    doubles and each pair of neighbours merges into the later record of the two, so a long run
    keeps one point per 2**k steps."""

    def __init__(self) -> None:
        self.width = 1
        self.points: dict[float, tuple[int, float, float]] = {}  # bucket -> (seq, step, value)

    def add(self, seq: int, step: float, value: float) -> None:
        self.points[step // self.width] = (seq, step, value)
        while len(self.points) > MAX_POINTS:
            self.width *= 2
            merged: dict[float, tuple[int, float, float]] = {}
            for point in self.points.values():
                key = point[1] // self.width
                if key not in merged or merged[key][0] < point[0]:
                    merged[key] = point
            self.points = merged

    def xy(self) -> tuple[list[float], list[float]]:
        buckets = sorted(self.points)
        return [self.points[b][1] for b in buckets], [self.points[b][2] for b in buckets]


def _config_changes(run_dir: Path, skipped: dict[Path, int]) -> list[float]:
    """The times of the supervisor's config replacements, in the order they happened."""
    events = JsonlReader(run_dir / EVENTS_FILE)
    times = [
        e["time"]
        for e in events
        if e.get("event") == "config_replaced" and _is_number(e.get("time"))
    ]
    if events.skipped:
        skipped[events.path] = events.skipped
    return times


def curves(run_dir: Path) -> Curves:
    """The curves and markers of a run, read from metrics.jsonl and events.jsonl."""
    run_dir = Path(run_dir)
    out = Curves()
    changes = _config_changes(run_dir, out.skipped)
    # A config change is marked at the first step trained after it. A train record at time t
    # follows every change up to bisect_right(times, t): keep the least step per such prefix,
    # and a change's first step is the least over the prefixes that include it.
    times = sorted(set(changes))
    first_after: list[float | None] = [None] * len(times)
    series = {key: _Series() for key in CURVES}
    eval_loss = _Series()
    trained_to = 0
    metrics = JsonlReader(run_dir / METRICS_FILE)
    for seq, r in enumerate(metrics):
        kind, step = r.get("kind", "train"), r.get("step")
        if not _is_number(step):
            continue
        if kind == "train":
            trained_to = max(trained_to, step)
            for key, curve in series.items():
                if _is_number(r.get(key)):
                    curve.add(seq, step, r[key])
            if _is_number(r.get("time")) and (i := bisect_right(times, r["time"])):
                best = first_after[i - 1]
                first_after[i - 1] = step if best is None else min(best, step)
        elif kind == "eval":
            if _is_number(r.get("eval_loss")):
                eval_loss.add(seq, step, r["eval_loss"])
        elif kind == "resume":
            back = f", back from {trained_to}" if step < trained_to else ""
            out.markers.append(Marker(step, "restart", f"resumed at {step}{back}"))
        elif kind == "rollback":
            out.markers.append(Marker(step, "rollback", f"NaN rollback to {step}"))
    if metrics.skipped:
        out.skipped[metrics.path] = metrics.skipped
    out.series = {key: curve.xy() for key, curve in series.items()}
    out.eval_loss = eval_loss.xy()
    for i in range(len(times) - 2, -1, -1):
        later = first_after[i + 1]
        if later is not None and (first_after[i] is None or later < first_after[i]):
            first_after[i] = later
    first_step = dict(zip(times, first_after, strict=True))
    for t in changes:
        if first_step[t] is not None:
            out.markers.append(Marker(first_step[t], "config", "config changed"))
    return out


def skipped_message(data: Curves) -> str | None:
    """One line on the lines the curves left out, or None when every line was read."""
    if not data.skipped:
        return None
    total = sum(data.skipped.values())
    if len(data.skipped) == 1:
        (where,) = data.skipped
    else:
        where = ", ".join(f"{n} of {path}" for path, n in data.skipped.items())
    return (
        f"skipped {total} unreadable lines (binary, not UTF-8 or not JSON) of {where}; "
        "the curves leave them out (`grep -anv '^{' FILE` shows them)"
    )


_MARKER_STYLE = {
    "restart": ("tab:gray", "--"),
    "rollback": ("tab:red", ":"),
    "config": ("tab:orange", "-."),
}


def plot_run(run_dir: Path, out: Path | None = None, data: Curves | None = None) -> Path:
    """Write train and eval loss, learning rate, gradient norm and tokens/s against step to a
    PNG (default RUN_DIR/curves.png) and return its path. `data` is the run's `curves`, when
    the caller has read them already."""
    run_dir = Path(run_dir)
    data = curves(run_dir) if data is None else data
    if not data.series["loss"][0] and not data.eval_loss[0]:
        raise PlotError(
            f"no metrics to plot: {run_dir / METRICS_FILE} is missing or empty; "
            "plot a run that has trained at least log.interval_steps steps"
        )
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise PlotError(
            "`m3run plot` needs matplotlib, which is not installed; install it with "
            "`pip install matplotlib`"
        ) from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    ax_loss, ax_lr, ax_gn, ax_tps = axes.flat
    ax_loss.plot(*data.series["loss"], label="train loss", linewidth=1)
    if data.eval_loss[0]:
        ax_loss.plot(*data.eval_loss, "o-", label="eval loss", markersize=3)
    ax_loss.set_ylabel("loss")
    ax_lr.plot(*data.series["lr"], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_gn.plot(*data.series["grad_norm"], color="tab:red", linewidth=1)
    ax_gn.set_ylabel("gradient norm")
    ax_tps.plot(*data.series["tokens_per_s"], color="tab:purple", linewidth=1)
    ax_tps.set_ylabel("tokens / s")
    labelled: set[str] = set()
    for m in data.markers:
        color, style = _MARKER_STYLE[m.kind]
        for ax in axes.flat:
            label = m.kind if ax is ax_loss and m.kind not in labelled else None
            ax.axvline(m.step, color=color, linestyle=style, linewidth=0.8, label=label)
        labelled.add(m.kind)
    ax_loss.legend()
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
