"""The worker's background import of torch's compile stack (runner/worker/preimport.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.runs import tiny_run_overrides, worker_env
from helpers.training import run_worker

from runner.worker.preimport import import_in_background

ROOT = Path(__file__).resolve().parents[2]


def test_the_compile_stack_is_imported_on_its_own_thread():
    """In a fresh interpreter (this one has imported dynamo already): the thread returns at once,
    and once it has finished, dynamo and inductor's compile_fx are loaded, so the optimizer and
    torch.compile find them."""
    code = (
        "import sys, time, torch\n"
        "from runner.worker.preimport import COMPILE_STACK, import_in_background\n"
        "assert not any(m in sys.modules for m in COMPILE_STACK), 'loaded before the thread'\n"
        "t0 = time.monotonic(); stack = import_in_background()\n"
        "started = time.monotonic() - t0\n"
        "stack.thread.join(300)\n"
        "assert not stack.thread.is_alive(), 'still importing after 300 s'\n"
        "assert stack.done()\n"
        "print(f'{started:.3f}', all(m in sys.modules for m in COMPILE_STACK))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=360
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    started, loaded = proc.stdout.split()
    assert float(started) < 1.0, f"import_in_background took {started} s to return"
    assert loaded == "True"


def test_a_module_that_fails_to_import_ends_the_thread_quietly(capsys):
    """The setup imports it again itself and reports the error there: the thread neither
    raises nor prints."""
    stack = import_in_background(["m3run_no_such_module", "m3run_no_such_module.after"])
    stack.wait("m3run_no_such_module.after")  # a failure ends the wait for the later ones too
    stack.thread.join(30)
    assert not stack.thread.is_alive() and stack.done()
    assert "m3run_no_such_module" not in sys.modules
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_a_compiled_deterministic_worker_sets_up_while_the_stack_is_imported(corpus, tmp_path):
    """The setup's own imports of the stack wait for the thread: importing inductor's config
    (train.deterministic) while the thread was inside dynamo made Python hand one of them a
    half-initialised module, and the worker crashed at every start. The real worker, compile
    and deterministic on; TORCHDYNAMO_DISABLE keeps its steps eager (CI has no compiler)."""
    ov = tiny_run_overrides(
        corpus,
        **{"train.compile": "true", "train.deterministic": "true", "train.total_steps": 2,
           "checkpoint.interval_steps": 2},
    )  # fmt: skip
    r = run_worker(tmp_path / "run", ov, env=worker_env(TORCHDYNAMO_DISABLE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "partially initialized" not in r.stderr
    assert "train.deterministic: on (deterministic algorithms" in r.stdout
