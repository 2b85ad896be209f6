"""Commands that run things: `launch` (the supervisor), `stop`, `train` (the worker alone) and
`smoke` (the preflight checks)."""

from __future__ import annotations

import importlib
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from m3run.runner.cli.app import RUN_HELP, Overrides, app, fail, run_dir_of
from m3run.runner.console import Console
from m3run.runner.protocol import LogFormat


def _launch_messages(log_format: LogFormat | str) -> Console:
    return Console(log_format, source="launch", prefix="m3run launch")


def _asked_format(args: Sequence[str]) -> LogFormat:
    """The --log-format value among raw arguments (the last one given), TEXT when none is valid:
    what a usage error is said in, before the arguments could be parsed."""
    found = LogFormat.TEXT
    for i, arg in enumerate(args):
        value = None
        if arg == "--log-format" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--log-format="):
            value = arg.split("=", 1)[1]
        if value in tuple(LogFormat):
            found = LogFormat(value)
    return found


# The exceptions of the click that typer runs on (recent typers vendor their own copy).
_click_errors = importlib.import_module(typer.BadParameter.__module__)


class _LaunchCommand(typer.core.TyperCommand):
    """`launch`, whose usage errors (a missing CONFIG, an unknown option, a bad value) are JSON
    records when its arguments ask for --log-format json, like everything else it prints."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: typer.Context | None = None,
        **extra: Any,
    ) -> typer.Context:
        asked = _asked_format(args)
        try:
            return super().make_context(info_name, list(args), parent=parent, **extra)
        except _click_errors.UsageError as e:
            if asked != LogFormat.JSON:
                raise
            message = e.format_message().rstrip(".")
            if e.ctx is not None:
                message += f"; see `{e.ctx.command_path} --help`"
            _launch_messages(asked).error(message, e.exit_code, event="usage_error")
            raise typer.Exit(e.exit_code) from None


@app.command(
    cls=_LaunchCommand,
    epilog=(
        "Exit codes: 0 finished or stopped by the user, 75 preempted (saved: reschedule), 69 GPU "
        "unhealthy, 70 restart budget or no-progress limit spent, 78 bad config or data (also a "
        "changed config without --force, a failed smoke test), 1 run dir busy, 2 bad arguments."
    ),
)
def launch(
    config: Annotated[
        Path, typer.Argument(metavar="CONFIG", help="YAML run config, e.g. configs/demo_cpu.yaml.")
    ],
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", metavar="DIR", help="Run directory (default: runs/<name>)."),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            metavar="NAME",
            help="Run name: the run directory is runs/<name> (default: the config file's stem).",
        ),
    ] = None,
    overrides: Overrides = None,
    resume: Annotated[
        str,
        typer.Option(
            "--resume",
            metavar="latest|none|STEP",
            help="latest (newest complete checkpoint) | none | STEP.",
        ),
    ] = "latest",
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace the run's frozen config.yaml with a changed config."),
    ] = False,
    detach: Annotated[
        bool,
        typer.Option(
            "-d", "--detach", help="Run the supervisor in the background; return once it runs."
        ),
    ] = False,
    log_format: Annotated[
        LogFormat,
        typer.Option(
            "--log-format",
            metavar="text|json",
            help="Console lines: text (ISO-8601 UTC timestamps; NO_COLOR honoured) or json "
            "(one object per line: the worker's steps with their numbers as fields, errors "
            "and warnings included).",
        ),
    ] = LogFormat.TEXT,
    smoke: Annotated[
        bool,
        typer.Option(
            "--smoke",
            help="Run the smoke test even though this config already passed it on this GPU "
            "(it runs anyway at a first launch, after a config change and on another GPU).",
        ),
    ] = False,
) -> None:
    """Freeze the config, check the GPU, smoke-test, then train under the supervisor."""
    from m3run.runner.supervisor import launch as supervisor

    messages = _launch_messages(log_format)

    def usage_error(message: str) -> typer.Exit:
        messages.error(message, 2, event="usage_error")
        return typer.Exit(2)

    if run_dir is not None and name is not None:
        raise usage_error(f"give --run-dir ({run_dir}) or --name ({name!r}), not both")
    if name is not None and not _plain_name(name):
        # repr() keeps a newline in the name from splitting the message over two lines.
        raise usage_error(
            f"--name {name!r} must be a plain directory name (no '/', '\\' or "
            "control characters such as a newline); use --run-dir for a path"
        )
    try:
        resume = supervisor.check_resume(resume)
    except supervisor.LaunchError as e:
        raise usage_error(str(e)) from None
    from m3run.runner.runstate import runs_root_dir

    run_dir = run_dir if run_dir is not None else runs_root_dir() / (name or config.stem)
    opts = supervisor.LaunchOptions(
        config=config,
        run_dir=run_dir,
        overrides=list(overrides or []),
        resume=resume,
        force=force,
        console=True,
        smoke=smoke,
        log_format=log_format,
    )
    code = supervisor.launch_detached(opts) if detach else supervisor.launch(opts)
    raise typer.Exit(code)


def _plain_name(name: str) -> bool:
    """A name that is one directory under runs/ and that status lines, logs and shells show as
    typed: no separator, no control character (a newline would forge a line in every listing)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        return False
    return not any(unicodedata.category(c) == "Cc" for c in name)


@app.command(epilog="Exit codes: 0 stopped, 1 not running (or still running after the grace).")
def stop(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace",
            metavar="SECONDS",
            min=0,
            help="Seconds the worker gets to save before it is killed (default and maximum: "
            "the run's supervisor.stop_grace_s).",
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="If the run has not stopped after the grace, SIGKILL the supervisor and the "
            "worker (progress since the last checkpoint is lost).",
        ),
    ] = False,
) -> None:
    """Stop a run: the worker saves a checkpoint and exits; waits until the run is stopped."""
    from m3run.runner.stopping import stop_run

    run_dir = run_dir_of(run)
    raise typer.Exit(stop_run(run_dir, grace_s=grace, force=force, say=typer.echo))


@app.command(
    epilog="Exit codes: 0 finished, 75 stopped after a saved checkpoint, 76 NaN excursion not "
    "healed, 78 bad config or data, anything else a crash."
)
def train(
    config: Annotated[
        Path, typer.Argument(metavar="CONFIG", help="YAML run config, e.g. configs/demo_cpu.yaml.")
    ],
    run_dir: Annotated[
        Path, typer.Option("--run-dir", metavar="DIR", help="Run directory (created if missing).")
    ],
    overrides: Overrides = None,
    resume: Annotated[
        str,
        typer.Option(
            "--resume",
            metavar="latest|none|STEP",
            help="latest (default) | none | STEP (exactly that step).",
        ),
    ] = "latest",
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Accept a changed config; with --resume none, start over with the old "
            "checkpoints moved aside.",
        ),
    ] = False,
    lr_scale: Annotated[
        float,
        typer.Option("--lr-scale", metavar="FACTOR", help="Multiply the learning-rate schedule."),
    ] = 1.0,
) -> None:
    """Run the training worker in the foreground, without a supervisor."""
    from m3run.runner.train import run

    raise typer.Exit(run(config, run_dir, overrides or [], resume, force, lr_scale))


@app.command(epilog="Exit codes: 0 every check passed or was skipped, 78 a check failed.")
def smoke(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="YAML run config.")],
    overrides: Overrides = None,
) -> None:
    """Preflight smoke test: numbered checks from CUDA/bf16 to peak memory."""
    from m3run.runner.config import ConfigError, load_config
    from m3run.runner.worker.smoke import run_smoke

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        raise fail(f"m3run smoke: {e}", 78) from None
    result = run_smoke(cfg, echo=typer.echo)
    if not result.ok:
        raise fail(f"smoke test failed: {result.failed_check_message}", 78)
    typer.echo("smoke test passed")
