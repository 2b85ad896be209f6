"""Commands on a trained model: `generate` (sample from a checkpoint) and `export` (a folder that
Hugging Face `transformers` and `Mamba3LM.from_export` load). Both check their arguments, the
run, its checkpoint and its tokenizer before they import torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from m3run.runner.cli.app import RUN_HELP, app, fail, run_dir_of

STEP_HELP = "Checkpoint step (default: the newest complete one)."


@app.command(
    epilog="Exit codes: 0 done (or stopped with Ctrl-C), 1 no such run, checkpoint or "
    "tokenizer, 2 bad arguments."
)
def generate(
    prompt: Annotated[str, typer.Option("--prompt", metavar="TEXT", help="Text to continue.")],
    run: Annotated[str | None, typer.Argument(metavar="RUN", help=RUN_HELP)] = None,
    step: Annotated[int | None, typer.Option("--step", metavar="N", help=STEP_HELP)] = None,
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens",
            metavar="N",
            min=1,
            help="Tokens to sample, at most the run's data.seq_len (its training window) "
            "unless --beyond-context.",
        ),
    ] = 64,
    beyond_context: Annotated[
        bool,
        typer.Option(
            "--beyond-context",
            help="Allow --max-new-tokens past data.seq_len (the model runs on, untrained there).",
        ),
    ] = False,
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
    """Continue a prompt with the run's model (on CPU, from a checkpoint). The text is printed
    as it is sampled and ends at the end-of-text token or after --max-new-tokens."""
    from m3run.runner.trained import ExportError, find_trained

    if not prompt:
        raise fail("m3run generate: --prompt is empty; give the text to continue", 2)
    if top_p == 0:
        raise fail("m3run generate: --top-p must be > 0 (1 keeps every token)", 2)
    prompt_ids: list[int] = []

    def check(cfg, tokenizer) -> None:
        context = cfg.data.seq_len
        if max_new_tokens > context and not beyond_context:
            raise fail(
                f"m3run generate: --max-new-tokens {max_new_tokens} is past the {context} "
                "tokens the model was trained to read (the run's data.seq_len); pass "
                f"--max-new-tokens {context} or less, or add --beyond-context to sample "
                "further anyway",
                2,
            )
        prompt_ids.extend(tokenizer.encode(prompt))
        if not prompt_ids:
            raise fail("m3run generate: --prompt is empty after tokenisation; give some text", 2)

    try:
        trained = find_trained(run_dir_of(run), step, check)
    except ExportError as e:
        raise fail(f"m3run generate: {e}") from None

    try:
        from m3run.runner.export import load_model, stream_text

        model = load_model(trained)
        pieces = stream_text(
            trained, model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed
        )
        sys.stdout.write(prompt)
        sys.stdout.flush()
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except KeyboardInterrupt:
        typer.echo("")  # stopped by the user: what was sampled stays printed
    except BrokenPipeError:
        # The reader is gone (`| head`): nothing more to print, and nothing to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@app.command(epilog="Exit codes: 0 exported, 1 no such run or checkpoint, or OUT refused.")
def export(
    run: Annotated[
        str, typer.Argument(metavar="RUN", help="Run directory path, or a run name under ./runs/.")
    ],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="Directory to write the export to.")],
    step: Annotated[int | None, typer.Option("--step", metavar="N", help=STEP_HELP)] = None,
) -> None:
    """Write a Hugging Face-style folder: model.safetensors, config.json, the modeling code,
    tokenizer.json and tokenizer_config.json. Load it with
    `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` (needs m3run
    installed) or `Mamba3LM.from_export(OUT)`. OUT must be new, empty or an earlier m3run
    export, which is replaced."""
    from m3run.runner.trained import (
        EXPORT_MARKER,
        ExportError,
        check_export_dir,
        find_trained,
    )

    try:
        trained = find_trained(run_dir_of(run), step, lambda *_: check_export_dir(out))
        replacing = (out / EXPORT_MARKER).is_file()
        from m3run.runner.export import export as write_export

        path = write_export(trained, out)
    except ExportError as e:
        raise fail(f"m3run export: {e}") from None
    done = "replaced the earlier export in" if replacing else "exported to"
    typer.echo(f"step {trained.checkpoint.step}: {done} {path} (marked by {EXPORT_MARKER})")
