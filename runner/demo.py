"""`make demo`: a real supervised training run of the tiny model on CPU.

1. prepares token shards from the Python standard library's own sources (no download) with a
   4096-token byte-level BPE, unless runs/demo-data already holds them;
2. `m3run launch configs/demo_cpu.yaml --run-dir runs/demo` in the foreground (health gate,
   smoke test, the worker under the supervisor);
3. `m3run status runs/demo`, then a short sample from the trained model.

Run it again and the launch resumes from the last checkpoint (a finished run stays finished).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DATA = Path("runs/demo-data")
RUN = Path("runs/demo")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"


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


def main() -> int:
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
            "0.02",
        )
        if code:
            return code
    code = m3run("launch", str(CONFIG), "--run-dir", str(RUN))
    m3run("status", str(RUN))
    if code == 0:
        sample()
    return code


if __name__ == "__main__":
    sys.exit(main())
