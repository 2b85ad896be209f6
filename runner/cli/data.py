"""`m3run prepare-data`: text in the formats people bring, tokenised into shards with a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from m3run.runner.cli.app import app, fail
from m3run.runner.formatting import count


@app.command(
    "prepare-data",
    epilog=(
        "Exit codes: 0 prepared · 78 an input or argument is bad, or --out holds prepared "
        "data (--force replaces it)."
    ),
)
def prepare_data(
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="INPUT...",
            help=(
                "LOCATION[:FIELD] items: text files, .jsonl(.gz/.zst), .json arrays, parquet, "
                "Arrow, folders or globs of them, HF save_to_disk folders, hf:<dataset folder>, "
                "or `stdlib` (this Python's own sources). FIELD names the records' text field "
                "(dotted for nested: meta.text)."
            ),
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", metavar="PATH", help="Output dir: gets train/ and val/ shards."),
    ] = None,
    inputs_file: Annotated[
        Path | None,
        typer.Option(
            "--inputs-file",
            metavar="FILE",
            help="A YAML list of inputs: LOCATION[:FIELD] or {path, text_field}.",
        ),
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            "--tokenizer",
            metavar="TOKENIZER",
            help="gpt2 (tiktoken) | path/to/tokenizer.json | bpe:<vocab_size>.",
        ),
    ] = "gpt2",
    val_fraction: Annotated[
        float,
        typer.Option(
            "--val-fraction",
            metavar="FRACTION",
            help="Share for val: of documents (hash), of tokens (tail).",
        ),
    ] = 0.005,
    val_split: Annotated[
        str,
        typer.Option(
            "--val-split",
            metavar="hash|tail",
            help="hash: whole documents by content hash | tail: the last tokens of the stream.",
        ),
    ] = "hash",
    text_field: Annotated[
        str,
        typer.Option(
            "--text-field", metavar="FIELD", help="The text field of records without a :FIELD."
        ),
    ] = "text",
    separator: Annotated[
        str,
        typer.Option(
            "--separator",
            metavar="blank|none|TEXT",
            help="How a lone text file is cut into documents: blank (blank lines) | none | TEXT.",
        ),
    ] = "blank",
    skip_bad: Annotated[
        bool,
        typer.Option("--skip-bad", help="Skip unreadable or empty files with a warning."),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option("--workers", metavar="N", help="Tokenizer processes (default: cores, ≤ 8)."),
    ] = None,
    max_bytes: Annotated[
        int | None,
        typer.Option("--max-bytes", metavar="BYTES", help="Stop after this many bytes of text."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace the prepared data that --out already holds."),
    ] = False,
    progress_interval: Annotated[
        float,
        typer.Option(
            "--progress-interval",
            metavar="SECONDS",
            help="Seconds between progress lines off a terminal.",
        ),
    ] = 10.0,
) -> None:
    """Tokenise text into token shards with a manifest (train/ and val/ under --out)."""
    from m3run.runner.data.manifest import DataError
    from m3run.runner.data.prepare import existing_output
    from m3run.runner.data.prepare import prepare_data as prepare

    if out is None:
        raise fail("m3run prepare-data: --out DIR is required (where train/ and val/ go)", 2)
    if not inputs and inputs_file is None:
        raise fail("m3run prepare-data: name inputs, or an --inputs-file listing them", 2)
    held = existing_output(out)
    if held and not force:
        # A run that trains on this folder would silently read other tokens (another
        # tokenizer, even) after a replacement: the replacement is asked for by name.
        raise fail(
            f"m3run prepare-data: --out {out} already holds prepared data ({held}); pass "
            "--force to replace it, or choose another --out",
            78,
        )
    sep = {"blank": "blank", "none": None}.get(separator, separator)
    try:
        summary = prepare(
            inputs or [],
            out,
            tokenizer=tokenizer,
            val_fraction=val_fraction,
            text_field=text_field,
            workers=workers,
            max_bytes=max_bytes,
            progress=True,
            inputs_file=inputs_file,
            separator=sep,
            val_split=val_split,
            skip_bad=skip_bad,
            progress_interval_s=progress_interval,
        )
    except DataError as e:
        raise fail(f"m3run prepare-data: {e}", 78) from None
    for item in summary["inputs"]:
        skipped = f", {count(len(item['skipped']), 'file')} skipped" if item["skipped"] else ""
        empty = f", {item['empty_dropped']:,} empty dropped" if item["empty_dropped"] else ""
        typer.echo(
            f"input {item['input']}: {count(item['documents'], 'document')}, "
            f"{count(item['tokens'], 'token')}{empty}{skipped}"
        )
    for split in ("train", "val"):
        s = summary[split]
        typer.echo(
            f"{split}: {count(s['tokens'], 'token')} in {count(s['documents'], 'document')} "
            f"→ {s['dir']}"
        )
    for note in summary.get("notes", []):
        typer.echo(f"note: {note}")
    for warning in summary.get("warnings", []):
        typer.echo(f"warning: {warning}", err=True)
