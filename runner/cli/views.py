"""Commands that read a run: `status`, `logs`, `plot`, `checkpoints`. None imports torch."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from m3run.runner.cli.app import RUN_HELP, app, fail, run_dir_of


@app.command()
def status(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    watch: Annotated[
        bool,
        typer.Option("--watch", help="Refresh until the run ends (Ctrl-C quits)."),
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", metavar="SECONDS", min=0.1, help="Seconds between refreshes."),
    ] = 2.0,
    gpu: Annotated[
        bool,
        typer.Option("--gpu/--no-gpu", help="Include GPU util/memory/temperature."),
    ] = True,
) -> None:
    """Phase, progress, loss, speed, heartbeat, checkpoints and restarts of a run."""
    from m3run.runner.cli import report

    run_dir = run_dir_of(run)

    def render() -> tuple[str, str | None]:
        st = report.full_status(run_dir, gpu=gpu)
        text = json.dumps(st, sort_keys=True) if as_json else report.format_status(st)
        return text, st["phase"]

    if not watch:
        typer.echo(render()[0])
        return
    from rich.live import Live
    from rich.text import Text

    from m3run.runner.protocol import ACTIVE_PHASES

    try:
        if as_json or not sys.stdout.isatty():  # a frame per refresh: scripts, pipes, logs
            while True:
                text, phase = render()
                typer.echo(text if as_json else text + "\n")
                if phase not in ACTIVE_PHASES:
                    return
                time.sleep(interval)
        with Live(auto_refresh=False) as live:
            while True:
                text, phase = render()
                live.update(Text(text), refresh=True)
                if phase not in ACTIVE_PHASES:
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        return


@app.command()
def logs(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    follow: Annotated[
        bool,
        typer.Option("-f", "--follow", help="Keep printing until the run ends (Ctrl-C quits)."),
    ] = False,
    supervisor_log: Annotated[
        bool,
        typer.Option(
            "--supervisor", help="Show supervisor.log (JSON lines) instead of worker.log."
        ),
    ] = False,
    lines: Annotated[
        int,
        typer.Option("-n", "--lines", metavar="N", min=0, help="Lines of history to show."),
    ] = 50,
) -> None:
    """Print the end of the worker's output (or the supervisor's log)."""
    from m3run.runner import runstate

    run_dir = run_dir_of(run)
    path = runstate.log_path(run_dir, supervisor=supervisor_log)
    if not path.is_file() and not follow:
        raise fail(
            f"m3run logs: {path} does not exist yet: the run has not started a "
            f"{'supervisor' if supervisor_log else 'worker'} (check `m3run status "
            f"{run_dir}`)"
        )
    if path.is_file():
        from m3run.runner.procs import tail_text

        sys.stdout.write(tail_text(path, lines))
        sys.stdout.flush()
    if follow:
        offset = path.stat().st_size if path.is_file() else 0
        try:
            runstate.follow(path, run_dir, offset)
        except KeyboardInterrupt:
            return


@app.command()
def plot(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", metavar="PATH", help="PNG path (default: RUN/curves.png)."),
    ] = None,
) -> None:
    """Plot train/eval loss, learning rate, gradient norm and tokens/s against step (PNG)."""
    from m3run.runner.plot import PlotError, curves, plot_run, skipped_message

    run_dir = run_dir_of(run)
    data = curves(run_dir)
    if message := skipped_message(data):
        typer.echo(f"m3run plot: {message}", err=True)
    try:
        path = plot_run(run_dir, out, data)
    except PlotError as e:
        raise fail(f"m3run plot: {e}") from None
    typer.echo(str(path))


@app.command()
def checkpoints(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Hash every checkpoint's files against meta.json (minutes for 434m runs); "
            "without it, meta.json and the file sizes are checked.",
        ),
    ] = False,
) -> None:
    """List a run's checkpoints with completeness. Exit 1 when there are checkpoints and none of
    them is complete; torn leftovers are listed, not fatal."""
    from m3run.runner.checkpoint.layout import format_checkpoint_table, list_checkpoints

    infos = list_checkpoints(run_dir_of(run), verify=verify)
    if as_json:
        rows = [
            {
                "step": i.step,
                "path": str(i.path),
                "complete": i.complete,
                # sha256 of both files matched meta.json (only --verify hashes them)
                "verified": verify and i.complete,
                "reason": i.reason,
            }
            for i in infos
        ]
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(format_checkpoint_table(infos, hashed=verify) if infos else "no checkpoints")
        if infos and not verify:
            typer.echo("(sizes checked; `--verify` hashes the files too)")
        elif infos:
            good = sum(i.complete for i in infos)
            typer.echo(
                f"(hashes verified: the sha256 of every file matched meta.json in {good} of "
                f"{len(infos)} checkpoint{'s' if len(infos) != 1 else ''})"
            )
    raise typer.Exit(0 if not infos or any(i.complete for i in infos) else 1)


@app.command("list")
def list_(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """The runs under ./runs/ (or $M3RUN_RUNS): phase, step, loss, last update."""
    from m3run.runner import runstate
    from m3run.runner.cli.report import format_runs

    rows = runstate.list_runs()
    typer.echo(json.dumps(rows, indent=2) if as_json else format_runs(rows))
