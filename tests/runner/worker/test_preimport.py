"""The worker's background import of torch's compile stack (runner/worker/preimport.py)."""

from __future__ import annotations

import sys
import time

from helpers.runs import tiny_run_overrides, worker_env
from helpers.training import run_worker

from m3run.runner.worker.preimport import import_in_background


def test_the_modules_are_imported_on_a_daemon_thread_that_returns_at_once():
    """The caller goes on while the thread imports; wait() returns once a module is loaded.
    (Standard-library modules nothing here imports: the real stack is the worker test below.)"""
    names = ["mailbox", "imaplib"]
    assert not any(n in sys.modules for n in names), "loaded before the thread"
    t0 = time.monotonic()
    stack = import_in_background(names)
    started = time.monotonic() - t0
    assert stack.thread.daemon and stack.thread.name == "preimport"
    stack.wait("mailbox")
    assert "mailbox" in sys.modules
    stack.wait()
    assert all(n in sys.modules for n in names) and stack.done()
    assert started < 1.0, f"import_in_background took {started:.3f} s to return"


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
        **{
            "train.compile": "true",
            "train.deterministic": "true",
            "train.total_steps": 2,
            "checkpoint.interval_steps": 2,
        },
    )
    r = run_worker(tmp_path / "run", ov, env=worker_env(TORCHDYNAMO_DISABLE="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "partially initialized" not in r.stderr
    assert "train.deterministic: on (deterministic algorithms" in r.stdout
