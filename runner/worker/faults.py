"""Test-only fault injection: the M3RUN_FAULT hook (the faults are listed in runner.protocol).
Empty, and inert, in production: the step faults wrap the trainer's step only when M3RUN_FAULT
names a fault (:meth:`Faults.wrap_step`), so the step itself carries no fault calls."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3run.runner.config import ConfigError
from m3run.runner.protocol import FAULT_ENV, FAULTS, SPARE_FAULT_ENV

HOLD_SAVE_MAX_S = 300.0  # hold_save's bound: a test that never releases fails, it does not hang


@dataclass
class Faults:
    """Parsed from M3RUN_FAULT (see runner/protocol.py). Empty in production."""

    spec: dict[str, str]
    fired: list[str]
    # Run before a crash fault exits: the trainer finishes a checkpoint write in flight, as any
    # crash that unwinds Python does (Trainer.close); SIGKILL is what loses an in-flight write.
    before_crash: Callable[[], object] | None = None
    # hold_at_step: whether a stop was asked for (ends the hold), and the heartbeat written while
    # held (a held worker is paused by the test, not hung).
    stop_requested: Callable[[], bool] = lambda: True
    while_held: Callable[[], object] = lambda: None

    @classmethod
    def from_env(cls) -> Faults:
        """ConfigError for a fault this hook does not know or a value it cannot use: a
        misspelt fault would otherwise leave a chaos test passing with nothing injected."""
        raw = os.environ.get(FAULT_ENV, "")
        spec = {}
        for part in filter(None, raw.split(",")):
            key, _, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if key not in FAULTS:
                raise ConfigError(
                    f"{FAULT_ENV}={raw!r} names the unknown fault {key!r} (known: "
                    f"{', '.join(FAULTS)}): it is a test-only hook; fix the name or unset "
                    f"{FAULT_ENV}"
                )
            if not _usable(FAULTS[key], value):
                raise ConfigError(
                    f"{FAULT_ENV}={raw!r}: {key} needs {_WANTS[FAULTS[key]]}, got {value!r}"
                )
            spec[key] = value
        return cls(spec, [])

    @property
    def asked(self) -> bool:
        """Whether M3RUN_FAULT names any fault."""
        return bool(self.spec)

    def wrap_step(self, trainer: Any) -> None:
        """Put the step faults around ``trainer.train_step`` (a Trainer after its setup, which
        imports this module: no import back, not even for the annotation): a crash, hang or
        hold before a step, and a poisoned step. A poisoned step reaches its update as a
        diverged step does: a NaN loss, NaN gradients and so a NaN gradient norm, so the
        non-finite guard must skip the update and drop the gradients (what every micro-batch's
        loss made NaN before its backward led to, whether or not its first forward ran ahead
        in the step before)."""
        step_fn, update = trainer.train_step, trainer.update

        def poisoned_queue(loss, grad_norm, max_norm=None):
            nan = float("nan")
            for p in trainer.model.parameters():
                if p.grad is not None:
                    p.grad.detach().fill_(nan)
            return type(update).queue(update, loss * nan, grad_norm * nan, max_norm)

        def train_step() -> dict:
            step = trainer.step + 1
            self.before_step(step)
            if not self.poison(step):
                return step_fn()
            update.queue = poisoned_queue
            try:
                return step_fn()
            finally:
                del update.queue  # the class's own again

        trainer.train_step = train_step

    def _once(self, key: str, step: int) -> bool:
        """True for the first N attempts at a step ≥ the fault's step ("7" or "7x3")."""
        if key not in self.spec:
            return False
        at, _, count = self.spec[key].partition("x")
        if step < int(at) or self.fired.count(key) >= int(count or 1):
            return False
        self.fired.append(key)
        return True

    def before_step(self, step: int) -> None:
        if self._once("crash_at_step", step):
            print(f"[fault] crash before step {step}", flush=True)
            if self.before_crash is not None:
                self.before_crash()
            os._exit(1)  # a crash: no protocol code, so the supervisor restarts the worker
        if self._once("hang_at_step", step):
            print(f"[fault] hang before step {step}", flush=True)
            _forever()
        if self._once("hold_at_step", step):
            print(f"[fault] holding before step {step} until a stop signal", flush=True)
            while not self.stop_requested():
                self.while_held()
                time.sleep(0.02)

    def poison(self, step: int) -> bool:
        if "nan_from_step" in self.spec and step >= int(self.spec["nan_from_step"]):
            return True
        return self._once("nan_at_step", step)

    def startup(self) -> None:
        if "crash_at_startup" in self.spec:
            print("[fault] crash at startup", flush=True)
            os._exit(1)  # a crash, as above

    @property
    def slow_save(self) -> float:
        return float(self.spec.get("slow_save", 0.0))

    def during_save(self, step: int, cancel: threading.Event | None = None) -> None:
        """Called mid-write (data files written, meta.json not yet), on the writer's thread. A
        slow or held write ends early once `cancel` is set, as a real one stops at its next
        block."""
        cancel = cancel or threading.Event()
        if self.slow_save:
            cancel.wait(self.slow_save)
        if "hold_save" in self.spec:  # until the test creates the file (bounded: never a hang)
            release, deadline = Path(self.spec["hold_save"]), time.monotonic() + HOLD_SAVE_MAX_S
            while not release.exists() and time.monotonic() < deadline and not cancel.is_set():
                time.sleep(0.02)
        if self._once("stall_save_at_step", step):
            print(f"[fault] checkpoint write of step {step} stalls mid-write", flush=True)
            _forever()
        if self._once("save_error_at_step", step):
            print(f"[fault] checkpoint write error at step {step}", flush=True)
            raise OSError(errno.EIO, f"injected write error (M3RUN_FAULT) for step {step}")


_WANTS = {
    "step": "a step number, e.g. =7 (nan_at_step also =7x3)",
    "seconds": "a number of seconds, e.g. =2.0",
    "path": "a file path, e.g. =/tmp/release",
    "": "no value",
}


def _usable(kind: str, value: str) -> bool:
    if kind == "step":
        at, x, count = value.partition("x")
        return at.isdigit() and (not x or count.isdigit())
    if kind == "seconds":
        try:
            return float(value) >= 0
        except ValueError:
            return False
    return bool(value) if kind == "path" else not value


def standby_fault() -> None:
    """Called by a warm spare before its last imports (runner/worker/standby.py): the
    M3RUN_SPARE_FAULT hook."""
    fault = os.environ.get(SPARE_FAULT_ENV)
    if fault == "crash_at_import":
        print("[fault] warm spare crash during its imports", flush=True)
        os._exit(1)  # a spare that cannot start, as a broken install makes it
    if fault == "hang_at_import":
        print("[fault] warm spare hangs during its imports", flush=True)
        _forever()  # alive, never ready: an import stuck on a dead file system


def _forever() -> None:
    """Sleep until the process is killed: a hang."""
    while True:
        time.sleep(3600)
