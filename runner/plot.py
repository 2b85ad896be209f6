"""`m3run plot`: training curves of a run as one PNG, from its metrics.jsonl.

A run that restarted replays the steps after the checkpoint it resumed from, so metrics.jsonl
holds some steps more than once. The curves keep the last record of each step (the one the
run's weights descend from) and draw every line forward in step; restarts, NaN rollbacks and
config changes are marked where they happened.

matplotlib is imported inside `plot_run` (Agg backend, no display needed) so the CLI stays
light for the commands that do not draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EVENTS_FILE, METRICS_FILE

PLOT_FILE = "curves.png"
CURVES = ("loss", "lr", "grad_norm", "tokens_per_s")


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


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _last_per_step(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    by_step: dict[float, float] = {}
    for r in records:
        x, y = r.get("step"), r.get(key)
        if _is_number(x) and _is_number(y):
            by_step[x] = y  # later records of a replayed step win
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def curves(run_dir: Path) -> Curves:
    """The curves and markers of a run, read from metrics.jsonl and events.jsonl."""
    records = read_jsonl(Path(run_dir) / METRICS_FILE)
    train = [r for r in records if r.get("kind", "train") == "train"]
    out = Curves(
        series={key: _last_per_step(train, key) for key in CURVES},
        eval_loss=_last_per_step([r for r in records if r.get("kind") == "eval"], "eval_loss"),
    )
    trained_to = 0
    for r in records:
        kind, step = r.get("kind", "train"), r.get("step")
        if not _is_number(step):
            continue
        if kind == "train":
            trained_to = max(trained_to, step)
        elif kind == "resume":
            back = f", back from {trained_to}" if step < trained_to else ""
            out.markers.append(Marker(step, "restart", f"resumed at {step}{back}"))
        elif kind == "rollback":
            out.markers.append(Marker(step, "rollback", f"NaN rollback to {step}"))
    # Config changes are the supervisor's events, in time: place each at the first step
    # trained after it.
    timed = [(r["time"], r["step"]) for r in train if _is_number(r.get("time"))]
    for event in read_jsonl(Path(run_dir) / EVENTS_FILE):
        if event.get("event") == "config_replaced" and _is_number(event.get("time")):
            after = [s for t, s in timed if t >= event["time"]]
            if after:
                out.markers.append(Marker(min(after), "config", "config changed"))
    return out


_MARKER_STYLE = {
    "restart": ("tab:gray", "--"),
    "rollback": ("tab:red", ":"),
    "config": ("tab:orange", "-."),
}


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write train and eval loss, learning rate, gradient norm and tokens/s against step to a
    PNG (default RUN_DIR/curves.png) and return its path."""
    run_dir = Path(run_dir)
    data = curves(run_dir)
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
