"""Import torch's compile stack on a thread of its own while the worker sets up.

torch imports dynamo the first time an optimizer is built (``add_param_group`` is wrapped in
``torch._disable_dynamo``) and inductor the first time a module is wrapped by ``torch.compile``:
seconds of a warm restart each, in a row with the CUDA initialisation, the model build and the
checkpoint load. Started first, the imports run while those wait on the GPU and the disk.

The setup must not import a module of that stack itself while the thread is importing it:
Python's per-module import locks see two threads entering torch's circular imports from
different ends as a deadlock and hand one of them a half-initialised module (``cannot import
name 'IndentedBuffer' from partially initialized module 'torch._inductor.utils'``). So the
setup waits (:meth:`CompileStack.wait`) for dynamo before its first optimizer call and for the
whole stack before anything that imports inductor: ``torch.use_deterministic_algorithms``
(train.deterministic, so that mode gives up the overlap), DDP and ``torch.compile``. A module
the thread fails to import is imported again, and its error raised, by the setup, where it
belongs.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence

# What the optimizer and the torch.compile wrapper import; compile_fx pulls in inductor's
# lowering, scheduler and Triton code generation with it.
DYNAMO = "torch._dynamo"
COMPILE_STACK = (DYNAMO, "torch._inductor.compile_fx")


class CompileStack:
    """The imports of ``modules``, in order, on a daemon thread started at construction."""

    def __init__(self, modules: Sequence[str] = COMPILE_STACK):
        self.modules = tuple(modules)
        self._ended = {name: threading.Event() for name in self.modules}
        self.thread = threading.Thread(target=self._work, name="preimport", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            for name in self.modules:
                importlib.import_module(name)
                self._ended[name].set()
        except Exception:  # the setup's own import reports the error
            pass
        finally:  # a failure ends the wait for the rest too: the setup imports them itself
            for event in self._ended.values():
                event.set()

    def wait(self, module: str | None = None) -> None:
        """Until ``module`` (every module when None) is imported or its import has failed."""
        names = self.modules if module is None else (module,)
        for name in names:
            self._ended[name].wait()

    def done(self) -> bool:
        return all(event.is_set() for event in self._ended.values())


def import_in_background(modules: Sequence[str] = COMPILE_STACK) -> CompileStack:
    """Start importing ``modules`` in order on a daemon thread."""
    return CompileStack(modules)


def wait_imported(stack: CompileStack | None, module: str | None = None) -> None:
    """:meth:`CompileStack.wait` where a stack is being imported (None: the caller imports what
    it needs itself)."""
    if stack is not None:
        stack.wait(module)
