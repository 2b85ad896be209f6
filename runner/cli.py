"""The `m3run` command line. Light commands never import torch at module import time."""

from __future__ import annotations

import typer

from runner import __version__

app = typer.Typer(
    name="m3run",
    help="Train Mamba-3-Lite under a supervisor that keeps the run alive.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"m3run {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """m3run: a supervised pretraining runner for Mamba-3-Lite."""


if __name__ == "__main__":
    app()
