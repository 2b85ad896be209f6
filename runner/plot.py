"""`m3run plot`: training curves of a run as one PNG, from its metrics.jsonl.

matplotlib is imported inside `plot_run` (Agg backend, no display needed) so the CLI stays
light for the commands that do not draw.
"""

from __future__ import annotations

from pathlib import Path

from runner.files import read_jsonl
from runner.protocol import METRICS_FILE

PLOT_FILE = "curves.png"


class PlotError(Exception):
    """Nothing to plot, or no plotting library. The message says what to do."""


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        x, y = r.get("step"), r.get(key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            xs.append(x)
            ys.append(y)
    return xs, ys


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write train and eval loss, learning rate, gradient norm and tokens/s against step to a
    PNG (default RUN_DIR/curves.png) and return its path."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / METRICS_FILE)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train and not evals:
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
    ax_loss.plot(*_series(train, "loss"), label="train loss", linewidth=1)
    if evals:
        ax_loss.plot(*_series(evals, "eval_loss"), "o-", label="eval loss", markersize=3)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_lr.plot(*_series(train, "lr"), color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_gn.plot(*_series(train, "grad_norm"), color="tab:red", linewidth=1)
    ax_gn.set_ylabel("gradient norm")
    ax_tps.plot(*_series(train, "tokens_per_s"), color="tab:purple", linewidth=1)
    ax_tps.set_ylabel("tokens / s")
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
