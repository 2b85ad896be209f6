"""`make demo` (`python -m m3run.runner.demo`): a real supervised training run of the tiny model
on CPU, from any working directory, with m3run installed or from a checkout.

1. prepares token shards from the Python standard library's own sources (no download) with a
   4096-token byte-level BPE into ./runs/demo-data, unless it holds them already;
2. `m3run launch configs/demo_cpu.yaml --run-dir runs/demo` in the foreground (health gate,
   smoke test, the worker under the supervisor), with the data paths set to ./runs/demo-data;
3. `m3run status runs/demo`, a short sample from the trained model, and the commands to try
   next.

The recipe is the one the package carries (`m3run.configs`, the repository's configs/), so an
installed m3run (the container image) runs the demo without a checkout. `--set KEY=VALUE`
(repeatable) goes on to the launch: `--set train.total_steps=20` makes a shorter demo. Run it
again and the launch resumes from the last checkpoint (a finished run stays finished).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

DATA = Path("runs/demo-data")
RUN = Path("runs/demo")


def demo_config() -> Path:
    """configs/demo_cpu.yaml as the package carries it: the repository's file in a checkout or
    an editable install, the wheel's copy in an installed m3run."""
    return Path(str(resources.files("m3run.configs") / "demo_cpu.yaml"))


def m3run(*args: str) -> int:
    cmd = [sys.executable, "-m", "m3run.runner.cli", *args]
    print("$ m3run " + " ".join(args), flush=True)
    return subprocess.call(cmd)


def sample() -> None:
    from m3run.runner.export import load_model, stream_text
    from m3run.runner.trained import ExportError, find_trained

    try:
        trained = find_trained(RUN)
    except ExportError:
        return  # nothing trained yet
    prompt = "def main("
    model = load_model(trained)
    print(f"\nsample from step {trained.checkpoint.step} (prompt {prompt!r}):\n{prompt}", end="")
    ids = trained.tokenizer.encode(prompt)
    for piece in stream_text(trained, model, ids, 60, 0.8, top_k=40, top_p=None, seed=0):
        print(piece, end="", flush=True)
    print()


def next_steps() -> str:
    """What to try after the demo, with how to reach the `m3run` command: the one beside this
    interpreter (a venv's bin/) when `m3run` on PATH is another or none."""
    tries = [
        (f"m3run status {RUN}", "phase, step, loss, checkpoints"),
        (f"m3run logs {RUN}", "the worker's output"),
        (f'm3run generate {RUN} --prompt "def main("', "continue a prompt"),
        (f"m3run plot {RUN}", "loss, LR and tokens/s curves as a PNG"),
        ("m3run list", "the runs under ./runs"),
    ]
    width = max(len(cmd) for cmd, _ in tries)
    lines = ["", "next:", *(f"  {cmd:<{width}}  # {what}" for cmd, what in tries)]
    here = Path(sys.executable).parent / "m3run"
    on_path = shutil.which("m3run")
    if here.is_file() and (on_path is None or Path(on_path).resolve() != here.resolve()):
        activate = here.parent / "activate"
        if activate.is_file():
            how = f"`source {_shown(activate)}` puts it there (or call {_shown(here)})"
        else:
            how = f"call {_shown(here)}, or add {here.parent} to PATH"
        lines.append(f"m3run is not on your PATH: {how}")
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m m3run.runner.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for the launch, e.g. train.total_steps=20 (repeatable)",
    )
    args = parser.parse_args(argv)
    if not (DATA / "train" / "manifest.json").exists():
        code = m3run(
            "prepare-data",
            "stdlib",
            "--out",
            str(DATA),
            "--tokenizer",
            "bpe:4096",
            "--max-bytes",
            "8000000",
            "--val-fraction",
            # A few whole stdlib modules: enough for two eval batches at seq_len 2048 too, so
            # the demo prepares data that prepare-data does not warn about.
            "0.05",
        )
        if code:
            return code
    data = DATA.absolute()
    code = m3run(
        "launch",
        str(demo_config()),
        "--run-dir",
        str(RUN),
        "--set",
        f"data.train_path={data / 'train'}",
        "--set",
        f"data.val_path={data / 'val'}",
        *(arg for kv in args.overrides for arg in ("--set", kv)),
    )
    m3run("status", str(RUN))
    if code == 0:
        sample()
    print(next_steps())
    return code


if __name__ == "__main__":
    sys.exit(main())
