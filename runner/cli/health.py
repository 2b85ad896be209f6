"""`m3run health`: the GPU gate on its own, or a run's container liveness check."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from m3run.runner.cli.app import app, run_dir_of


@app.command()
def health(
    liveness: Annotated[
        str | None,
        typer.Option(
            "--liveness",
            metavar="RUN",
            help="Container liveness check of RUN: reads the run dir only (heartbeat age vs "
            "the calibrated allowance, phase); never touches the GPU. Exit 0 alive, 1 "
            "stale or dead.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            min=0.1,
            help="Seconds before a hung GPU probe counts as unhealthy.",
        ),
    ] = 20.0,
    allow_processes: Annotated[
        bool,
        typer.Option(
            "--allow-processes",
            help="Do not count other processes on the GPU as unhealthy (e.g. while a run is "
            "training there). Without it the verdict is what `m3run launch` would get.",
        ),
    ] = False,
) -> None:
    """One-shot GPU health report (exit 69 when a GPU is unhealthy), or a run's liveness."""
    if liveness is not None:
        from m3run.runner import runstate

        ok, why = runstate.liveness(run_dir_of(liveness))
        if as_json:
            typer.echo(json.dumps({"alive": ok, "reason": why}))
        else:
            typer.echo(f"{'alive' if ok else 'NOT ALIVE'}: {why}")
        raise typer.Exit(0 if ok else 1)
    from m3run.runner.health.checks import check_gpu_health

    report = check_gpu_health(timeout, allow_foreign_processes=allow_processes)
    typer.echo(json.dumps(report.to_dict(), sort_keys=True) if as_json else report.summary())
    raise typer.Exit(report.exit_code)
