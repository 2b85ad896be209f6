"""Import torch's compile stack on a thread of its own while the worker sets up.

torch imports dynamo the first time an optimizer is built (``add_param_group`` is wrapped in
``torch._disable_dynamo``) and inductor the first time a module is wrapped by ``torch.compile``:
on an H200 host those two imports took 4.3 s and 3.7 s of a warm restart, in a row with the
CUDA initialisation, the model build and the checkpoint load. Started first, the imports run
while those wait on the GPU and the disk; the setup then finds the modules loaded, or waits on
Python's own import lock for the part not yet done. Measured (docs/benchmarks.md, 2026-12-01,
fifth): model build, optimizer and compile wrapper 8.5 → 4.9 s together, the model build's
Python work now sharing the interpreter with the imports. Nothing depends on the thread: a
module it fails to import is imported (and its error raised) by the setup, where it belongs.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence

# What the optimizer and the torch.compile wrapper import; compile_fx pulls in inductor's
# lowering, scheduler and Triton code generation with it.
COMPILE_STACK = ("torch._dynamo", "torch._inductor.compile_fx")


def import_in_background(modules: Sequence[str] = COMPILE_STACK) -> threading.Thread:
    """Start importing ``modules`` in order on a daemon thread; returns the thread."""

    def work() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # the setup's own import of it reports the error
                return

    thread = threading.Thread(target=work, name="preimport", daemon=True)
    thread.start()
    return thread
