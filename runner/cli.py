"""The `m3run` command line. Light commands never import torch at module import time.

Each command is a thin function over a module: launch → runner.supervisor; status, stop, logs
and `health --liveness` → runner.runstate; health → runner.health; plot → runner.plot.

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
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from runner import __version__

app = typer.Typer(
    name="m3run",
    help="Train Mamba-3-Lite under a supervisor that keeps the run alive.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RUN_HELP = "Run directory path, or a run name under ./runs/ (default: the latest run there)."


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


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def _run_dir(run: str | None) -> Path:
    from runner.runstate import RunNotFoundError, resolve_run

    try:
        return resolve_run(run)
    except RunNotFoundError as e:
        raise _fail(f"m3run: {e}") from None


# --------------------------------------------------------------------------- launch


@app.command(
    epilog=(
        "Exit codes: 0 finished or stopped by the user, 75 preempted (saved: reschedule), 69 GPU "
        "unhealthy, 70 restart budget or no-progress limit spent, 78 bad config or data (also a "
        "changed config without --force, a failed smoke test), 1 run dir busy, 2 bad arguments."
    )
)
def launch(
    config: Annotated[Path, typer.Argument(help="YAML run config, e.g. configs/demo_cpu.yaml.")],
    run_dir: Annotated[
        Path | None,
        typer.Option("--run-dir", help="Run directory (default: runs/<name>)."),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Run name: the run directory is runs/<name> (default: the config file's stem).",
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="SECTION.KEY=VALUE", help="Override a config value (repeatable)."
        ),
    ] = None,
    resume: Annotated[
        str,
        typer.Option("--resume", help="latest (newest complete checkpoint) | none | STEP."),
    ] = "latest",
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace the run's frozen config.yaml with a changed config."),
    ] = False,
    detach: Annotated[
        bool,
        typer.Option("--detach", help="Run the supervisor in the background; return once it runs."),
    ] = False,
) -> None:
    """Freeze the config, check the GPU, smoke-test, then train under the supervisor."""
    from runner.supervisor import launch as supervisor

    if run_dir is not None and name is not None:
        raise _fail(f"m3run launch: give --run-dir ({run_dir}) or --name ({name}), not both", 2)
    if name is not None and (not name or "/" in name or name in (".", "..")):
        raise _fail(
            f"m3run launch: --name {name!r} must be a plain directory name (no '/'); "
            "use --run-dir for a path",
            2,
        )
    try:
        resume = supervisor.check_resume(resume)
    except supervisor.LaunchError as e:
        raise _fail(f"m3run launch: {e}", 2) from None
    run_dir = run_dir if run_dir is not None else Path("runs") / (name or config.stem)
    opts = supervisor.LaunchOptions(
        config=config,
        run_dir=run_dir,
        overrides=list(overrides or []),
        resume=resume,
        force=force,
        console=True,
    )
    code = supervisor.launch_detached(opts) if detach else supervisor.launch(opts)
    raise typer.Exit(code)


# --------------------------------------------------------------------------- status


@app.command()
def status(
    run: Annotated[str | None, typer.Argument(help=RUN_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    watch: Annotated[
        bool,
        typer.Option("--watch", help="Refresh until the run ends (Ctrl-C quits)."),
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.1, help="Seconds between refreshes."),
    ] = 2.0,
    gpu: Annotated[
        bool,
        typer.Option("--gpu/--no-gpu", help="Include GPU util/memory/temperature."),
    ] = True,
) -> None:
    """Phase, progress, loss, speed, heartbeat, checkpoints and restarts of a run."""
    from runner import runstate

    run_dir = _run_dir(run)

    def render() -> tuple[str, str | None]:
        st = runstate.collect_status(run_dir, gpu=gpu)
        text = json.dumps(st, sort_keys=True) if as_json else runstate.format_status(st)
        return text, st["phase"]

    if not watch:
        typer.echo(render()[0])
        return
    from rich.live import Live
    from rich.text import Text

    from runner.protocol import ACTIVE_PHASES

    try:
        if as_json:  # one JSON object per refresh, for scripts
            while True:
                text, phase = render()
                typer.echo(text)
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


# --------------------------------------------------------------------------- stop


@app.command(epilog="Exit codes: 0 stopped, 1 not running (or still running after the grace).")
def stop(
    run: Annotated[str | None, typer.Argument(help=RUN_HELP)] = None,
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace",
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
    from runner import runstate

    run_dir = _run_dir(run)
    raise typer.Exit(runstate.stop_run(run_dir, grace_s=grace, force=force, say=typer.echo))


# --------------------------------------------------------------------------- logs


@app.command()
def logs(
    run: Annotated[str | None, typer.Argument(help=RUN_HELP)] = None,
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
        typer.Option("-n", "--lines", min=0, help="Lines of history to show."),
    ] = 50,
) -> None:
    """Print the end of the worker's output (or the supervisor's log)."""
    from runner import runstate

    run_dir = _run_dir(run)
    path = runstate.log_path(run_dir, supervisor=supervisor_log)
    if not path.is_file() and not follow:
        raise _fail(
            f"m3run logs: {path} does not exist yet: the run has not started a "
            f"{'supervisor' if supervisor_log else 'worker'} (check `m3run status "
            f"{run_dir}`)"
        )
    if path.is_file():
        from runner.procs import tail_text

        sys.stdout.write(tail_text(path, lines))
        sys.stdout.flush()
    if follow:
        offset = path.stat().st_size if path.is_file() else 0
        try:
            runstate.follow(path, run_dir, offset)
        except KeyboardInterrupt:
            return


# --------------------------------------------------------------------------- health


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
            "--timeout", min=0.1, help="Seconds before a hung GPU probe counts as unhealthy."
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
        from runner import runstate

        ok, why = runstate.liveness(_run_dir(liveness))
        if as_json:
            typer.echo(json.dumps({"alive": ok, "reason": why}))
        else:
            typer.echo(f"{'alive' if ok else 'NOT ALIVE'}: {why}")
        raise typer.Exit(0 if ok else 1)
    from runner.health.checks import check_gpu_health

    report = check_gpu_health(timeout, allow_foreign_processes=allow_processes)
    typer.echo(json.dumps(report.to_dict(), sort_keys=True) if as_json else report.summary())
    raise typer.Exit(report.exit_code)


# --------------------------------------------------------------------------- plot


@app.command()
def plot(
    run: Annotated[str | None, typer.Argument(help=RUN_HELP)] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="PNG path (default: RUN/curves.png)."),
    ] = None,
) -> None:
    """Plot train/eval loss, learning rate, gradient norm and tokens/s against step (PNG)."""
    from runner.plot import PlotError, plot_run

    run_dir = _run_dir(run)
    try:
        path = plot_run(run_dir, out)
    except PlotError as e:
        raise _fail(f"m3run plot: {e}") from None
    typer.echo(str(path))


# --------------------------------------------------------------------------- worker-side commands
# These import torch (inside the function): they build models or read tensors.


@app.command(
    epilog="Exit codes: 0 finished, 75 stopped after a saved checkpoint, 76 NaN excursion not "
    "healed, 78 bad config or data, anything else a crash."
)
def train(
    config: Annotated[Path, typer.Argument(help="YAML run config, e.g. configs/demo_cpu.yaml.")],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory (created if missing).")],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="SECTION.KEY=VALUE", help="Override a config value (repeatable)."
        ),
    ] = None,
    resume: Annotated[
        str, typer.Option("--resume", help="latest (default) | none | STEP (exactly that step).")
    ] = "latest",
    force: Annotated[
        bool, typer.Option("--force", help="Accept a changed config, or --resume none over old")
    ] = False,
    lr_scale: Annotated[
        float, typer.Option("--lr-scale", help="Multiply the learning-rate schedule.")
    ] = 1.0,
) -> None:
    """Run the training worker in the foreground, without a supervisor."""
    from runner.train import run

    raise typer.Exit(run(config, run_dir, overrides or [], resume, force, lr_scale))


@app.command("prepare-data", epilog="Exit codes: 0 prepared · 78 an input or argument is bad.")
def prepare_data(
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            help=(
                "LOCATION[:FIELD] items: text files, .jsonl(.gz/.zst), .json arrays, parquet, "
                "Arrow, folders or globs of them, HF save_to_disk folders, hf:<dataset folder>, "
                "or `stdlib` (this Python's own sources). FIELD names the records' text field "
                "(dotted for nested: meta.text)."
            )
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Output dir: gets train/ and val/ shards.")
    ] = None,
    inputs_file: Annotated[
        Path | None,
        typer.Option(
            "--inputs-file", help="A YAML list of inputs: LOCATION[:FIELD] or {path, text_field}."
        ),
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer", help="gpt2 (tiktoken) | path/to/tokenizer.json | bpe:<vocab_size>."
        ),
    ] = "gpt2",
    val_fraction: Annotated[
        float,
        typer.Option(
            "--val-fraction", help="Share for val: of documents (hash), of tokens (tail)."
        ),
    ] = 0.005,
    val_split: Annotated[
        str,
        typer.Option(
            "--val-split",
            help="hash: whole documents by content hash | tail: the last tokens of the stream.",
        ),
    ] = "hash",
    text_field: Annotated[
        str, typer.Option("--text-field", help="The text field of records without a :FIELD.")
    ] = "text",
    separator: Annotated[
        str,
        typer.Option(
            "--separator",
            help="How a lone text file is cut into documents: blank (blank lines) | none | TEXT.",
        ),
    ] = "blank",
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Skip unreadable or empty files with a warning."),
    ] = False,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Tokenizer processes (default: cores, ≤ 8).")
    ] = None,
    max_bytes: Annotated[
        int | None, typer.Option("--max-bytes", help="Stop after this many bytes of text.")
    ] = None,
    progress_interval: Annotated[
        float,
        typer.Option("--progress-interval", help="Seconds between progress lines off a terminal."),
    ] = 10.0,
) -> None:
    """Tokenise text into token shards with a manifest (train/ and val/ under --out)."""
    from runner.data.manifest import DataError
    from runner.data.prepare import prepare_data as prepare

    if out is None:
        raise _fail("m3run prepare-data: --out DIR is required (where train/ and val/ go)", 2)
    if not inputs and inputs_file is None:
        raise _fail("m3run prepare-data: name inputs, or an --inputs-file listing them", 2)
    sep = {"blank": "blank", "none": None}.get(separator, separator)
    try:
        summary = prepare(
            inputs or [], out, tokenizer=tokenizer, val_fraction=val_fraction,
            text_field=text_field, workers=workers, max_bytes=max_bytes, progress=True,
            inputs_file=inputs_file, separator=sep, val_split=val_split, skip_bad=skip_bad,
            progress_interval_s=progress_interval,
        )  # fmt: skip
    except DataError as e:
        raise _fail(f"m3run prepare-data: {e}", 78) from None
    for item in summary["inputs"]:
        skipped = f", {len(item['skipped'])} files skipped" if item["skipped"] else ""
        empty = f", {item['empty_dropped']:,} empty dropped" if item["empty_dropped"] else ""
        typer.echo(
            f"input {item['input']}: {item['documents']:,} documents, {item['tokens']:,} "
            f"tokens{empty}{skipped}"
        )
    for split in ("train", "val"):
        s = summary[split]
        typer.echo(f"{split}: {s['tokens']:,} tokens in {s['documents']:,} documents → {s['dir']}")
    for note in summary.get("notes", []):
        typer.echo(f"note: {note}")


@app.command()
def checkpoints(
    run: Annotated[str | None, typer.Argument(help=RUN_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List a run's checkpoints with completeness, verifying every sha256. Exit 1 when there
    are checkpoints and none of them is complete; torn leftovers are listed, not fatal."""
    from runner.checkpoint.layout import format_checkpoint_table, list_checkpoints

    infos = list_checkpoints(_run_dir(run), verify=True)
    if as_json:
        rows = [{"step": i.step, "path": str(i.path), "complete": i.complete, "reason": i.reason}
                for i in infos]  # fmt: skip
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(format_checkpoint_table(infos) if infos else "no checkpoints")
    raise typer.Exit(0 if not infos or any(i.complete for i in infos) else 1)


@app.command(epilog="Exit codes: 0 every check passed or was skipped, 78 a check failed.")
def smoke(
    config: Annotated[Path, typer.Argument(help="YAML run config.")],
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="SECTION.KEY=VALUE", help="Override a config value (repeatable)."
        ),
    ] = None,
) -> None:
    """Preflight smoke test: numbered checks from CUDA/bf16 to peak memory."""
    from runner.config import ConfigError, load_config
    from runner.worker.smoke import run_smoke

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        raise _fail(f"m3run smoke: {e}", 78) from None
    result = run_smoke(cfg, echo=typer.echo)
    if not result.ok:
        raise _fail(f"smoke test failed: {result.failed_check_message}", 78)
    typer.echo("smoke test passed")


if __name__ == "__main__":
    app()
