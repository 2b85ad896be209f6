"""The `m3run` Typer application and what its commands share: the RUN argument's help, resolving
a run directory, failing with a message and an exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from m3run.runner import __version__

app = typer.Typer(
    name="m3run",
    help="Train Mamba-3-Lite under a supervisor that keeps the run alive.",
    no_args_is_help=True,
    # `m3run --install-completion` sets up tab completion for bash, zsh or fish.
    add_completion=True,
    pretty_exceptions_enable=False,
    # Plain help: reads the same in a terminal, a pipe and `kubectl logs`, and shows no type
    # after a flag (`--json <bool>` invites `--json true`, which would be read as RUN).
    rich_markup_mode=None,
)

RUN_HELP = "Run directory path, or a run name under ./runs/ (default: the latest run there)."
# `--set SECTION.KEY=VALUE`, repeatable: the option every command that loads a config takes.
Overrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set", metavar="SECTION.KEY=VALUE", help="Override a config value (repeatable)."
    ),
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"m3run {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """m3run: a supervised pretraining runner for Mamba-3-Lite."""


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def run_dir_of(run: str | None) -> Path:
    from m3run.runner.runstate import RunNotFoundError, resolve_run

    try:
        return resolve_run(run)
    except RunNotFoundError as e:
        raise fail(f"m3run: {e}") from None
