"""Commands on a trained model: `generate` (sample from a checkpoint) and `export` (a directory
that loads back with `Mamba3LM.from_export`). They import torch, inside the command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from m3run.runner.cli.app import RUN_HELP, app, fail, run_dir_of

STEP_HELP = "Checkpoint step (default: the newest complete one)."


@app.command()
def generate(
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    prompt: Annotated[str, typer.Option("--prompt", metavar="TEXT", help="Text to continue.")] = "",
    step: Annotated[int | None, typer.Option("--step", metavar="N", help=STEP_HELP)] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", metavar="N", min=1, help="Tokens to sample.")
    ] = 64,
    temperature: Annotated[
        float, typer.Option("--temperature", metavar="T", min=0.0, help="0 is greedy.")
    ] = 0.8,
    top_k: Annotated[
        int | None, typer.Option("--top-k", metavar="K", min=1, help="Sample from the K likeliest.")
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option("--top-p", metavar="P", min=0.0, max=1.0, help="Nucleus sampling mass."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Sampling seed.")] = 0,
) -> None:
    """Continue a prompt with the run's model (on CPU, from a checkpoint)."""
    from m3run.runner.export import ExportError, generate, load_trained

    if not prompt:
        raise fail("m3run generate: --prompt TEXT is required (the text to continue)", 2)
    try:
        trained = load_trained(run_dir_of(run), step)
        text = generate(trained, prompt, max_new_tokens, temperature, top_k, top_p, seed)
    except ExportError as e:
        raise fail(f"m3run generate: {e}") from None
    typer.echo(prompt + text)


@app.command()
def export(
    run: Annotated[str, typer.Argument(metavar="RUN", help=RUN_HELP)],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Directory to write the export to.")],
    step: Annotated[int | None, typer.Option("--step", metavar="N", help=STEP_HELP)] = None,
) -> None:
    """Write model.safetensors, config.json and the tokenizer: `Mamba3LM.from_export(OUT)`.
    OUT must be new, empty or an earlier m3run export, which is replaced."""
    from m3run.runner.export import EXPORT_MARKER, ExportError, export, load_trained

    try:
        trained = load_trained(run_dir_of(run), step)
        replacing = not out.is_symlink() and (out / EXPORT_MARKER).is_file()
        path = export(trained, out)
    except ExportError as e:
        raise fail(f"m3run export: {e}") from None
    done = "replaced the earlier export in" if replacing else "exported to"
    typer.echo(f"step {trained.checkpoint.step}: {done} {path} (marked by {EXPORT_MARKER})")
