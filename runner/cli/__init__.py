"""The `m3run` command line. Light commands never import torch at module import time.

Each command is a thin function over a module: launch → runner.supervisor; status and list →
runner.cli.report (runner.runstate's reading of the run dir, plus the mirror's lag and the GPU
rows); logs and `health --liveness` → runner.runstate; stop → runner.stopping; health →
runner.health; plot → runner.plot; tune-scan → kernels.mamba3.tools.tuning.

Exit codes:
  launch   the supervisor's: 0 finished or stopped by the user · 75 preempted (state saved,
           reschedule) · 69 GPU unhealthy · 70 restart budget or no-progress limit spent ·
           78 bad config or data (also: frozen config changed without --force, smoke test
           failed) · 1 refused (run dir busy) · 2 bad arguments
  status   0 · 1 no such run
  stop     0 the run stopped · 1 it was not running, or did not stop within the grace
  logs     0 · 1 no such run or log
  health   0 healthy, warn or no GPU · 69 unhealthy; with --liveness RUN: 0 alive · 1 stale/dead
  plot     0 · 1 nothing to plot or no matplotlib
  generate 0 (Ctrl-C too) · 1 no such run, checkpoint or tokenizer · 2 bad arguments
  export   0 · 1 no such run, checkpoint or tokenizer, or an OUT it must not write into
  tune-scan  0 tuned and stored · 78 bad config or no GPU the Triton scan runs on · 1 the
             tune failed (nothing stored)
"""

from m3run.runner.cli.app import app

# Each module registers its commands when imported; `m3run --help` lists them in this order.
# isort: off
import m3run.runner.cli.runs
import m3run.runner.cli.views
import m3run.runner.cli.models
import m3run.runner.cli.data
import m3run.runner.cli.health
import m3run.runner.cli.tune  # noqa: F401
# isort: on

__all__ = ["app"]
