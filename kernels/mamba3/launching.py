"""How one of the Triton scan's kernels is launched: its launch configuration and ``launch``
itself, which hands the launch to a recorder instead where one is set (the resource report, the
compile ahead and the tuner record launches rather than run them) and waits for the kernels'
compile ahead while one is in flight.

``triton_fwd``, ``triton_bwd`` and ``triton_sums`` launch through it. Which configuration a call
runs under is the launch plans' business (``plans/``), which import this module, never the
reverse.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched: warps, software-pipelining stages, a register cap (ptxas
    .maxnreg; None leaves it to the compiler), a block size ``bv`` (0: all) of p for the
    forward and the backward's state kernel (a grid of p blocks) and its chunk kernel (the p
    blocks in turn, in three passes; the angle kernel takes no block size: 0) and, for the
    backward's chunk kernel, the heads ``hpp`` one program takes in turn (grouped q, k: it
    sums their dq, dk, so fewer partials are written and summed; a call uses the largest
    divisor of a group's heads not above it, so 1 where q, k are per head) and the chunks
    ``cpp`` it takes in turn (with num_stages > 1, a chunk's loads overlap the work on the
    one before). ``wg`` 1 has the forward and the chunk kernel (in one pass over p; its
    p-block body ignores it) form their (chunk × 64) products transposed (:func:`dot_t`), as
    warpgroup MMAs on sm_90. ``hb``, for the angle kernel with one set of angles for every
    head: the blocks the heads are split into (the largest divisor of h not above it), a
    program each, their summed gradients added after (1: a program takes every head)."""

    num_warps: int
    num_stages: int
    maxnreg: int | None = None
    bv: int = 0
    hpp: int = 1
    cpp: int = 1
    wg: int = 0
    hb: int = 1

    def __post_init__(self) -> None:
        least = {"num_stages": 1, "bv": 0, "hpp": 1, "cpp": 1, "wg": 0, "hb": 1}
        bad = [
            f"{k}={getattr(self, k)!r}"
            for k, low in least.items()
            if not isinstance(getattr(self, k), int) or getattr(self, k) < low
        ]
        if self.num_warps not in (1, 2, 4, 8, 16):
            bad.append(f"num_warps={self.num_warps!r} (1, 2, 4, 8 or 16)")
        if self.maxnreg is not None and (
            not isinstance(self.maxnreg, int) or not 24 <= self.maxnreg <= 255
        ):
            bad.append(f"maxnreg={self.maxnreg!r} (None or 24..255)")
        if bad:
            raise ValueError(f"launch configuration with bad fields: {', '.join(bad)}")

    def launch_kwargs(self) -> dict:
        kw = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw

    def as_dict(self) -> dict:
        out = {
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "maxnreg": self.maxnreg,
            "bv": self.bv,
        }
        for key, default in (("hpp", 1), ("cpp", 1), ("wg", 0), ("hb", 1)):  # where not default
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        return out


# A compile ahead that outlasts this is waited for no more (logged once): the launches compile
# what they need themselves rather than stall a worker on a compile that may never end.
AHEAD_WAIT_S = 300.0


class LaunchHooks:
    """What a launch consults before it runs: the recorder it goes to instead, and the compiles
    ahead it waits for.

    A recorder is per thread (:meth:`set_recorder`), so that recording on one thread never takes
    another's launches, or process-wide (:meth:`recording_everywhere`, the tuner's): the
    autograd engine runs a CUDA backward on a thread of its own, so a recorder set for the
    calling thread alone would leave the backward unrecorded. A thread's own recorder comes
    first.

    Compiles ahead (tools/precompile.py's futures): a launch meanwhile waits for them, because
    the kernel it needs is most likely among theirs, and compiling it again on the launching
    thread would take as long as the pool's compile of every kernel. The list empties as they
    end, so a launch pays one truth test of an empty list."""

    def __init__(self) -> None:
        self._thread = threading.local()
        self._everywhere = None
        self._ahead: list[Future] = []

    def set_recorder(self, recorder) -> None:
        self._thread.recorder = recorder

    @contextlib.contextmanager
    def recording_everywhere(self, recorder):
        before, self._everywhere = self._everywhere, recorder
        try:
            yield
        finally:
            self._everywhere = before

    def recorder(self):
        """The recorder this thread's launches go to, or None."""
        return getattr(self._thread, "recorder", None) or self._everywhere

    def compiling_ahead(self, future: Future) -> None:
        self._ahead.append(future)
        future.add_done_callback(self._ahead_ended)

    def _ahead_ended(self, future: Future) -> None:
        with contextlib.suppress(ValueError):  # given up on already
            self._ahead.remove(future)

    def wait_ahead(self) -> None:
        """Wait for the compiles ahead in flight, each at most AHEAD_WAIT_S."""
        for future in list(self._ahead):
            done, _ = wait([future], timeout=AHEAD_WAIT_S)
            if not done:
                self._ahead_ended(future)
                log.warning(
                    "the scan kernels' compile ahead still runs after %.0f s: launches compile "
                    "their kernels themselves from here on",
                    AHEAD_WAIT_S,
                )

    @property
    def waiting(self) -> bool:
        """Whether a compile ahead is in flight."""
        return bool(self._ahead)


_hooks = LaunchHooks()


def set_recorder(recorder) -> None:
    """Hand this thread's launches to ``recorder(name, kernel, grid, args, constexprs, cfg)``
    instead of launching them (None: launch them again)."""
    _hooks.set_recorder(recorder)


def recording_everywhere(recorder):
    """A context within which every thread's launches go to ``recorder`` (as
    :func:`set_recorder`, which one thread's recorder overrides), the autograd engine's
    included (the tuner's; see :class:`LaunchHooks`)."""
    return _hooks.recording_everywhere(recorder)


def compiling_ahead(future: Future) -> None:
    """Launches wait for ``future`` (a compile ahead of them) until it ends."""
    _hooks.compiling_ahead(future)


def launch(name: str, kernel, grid: tuple, args: tuple, constexprs: dict, cfg: LaunchConfig):
    """Launch ``kernel`` (the launch plans call it ``name``) on ``grid``, or hand it to this
    thread's recorder; while a compile ahead runs, after it."""
    recorder = _hooks.recorder()
    if recorder is not None:
        recorder(name, kernel, grid, args, constexprs, cfg)
        return
    if _hooks.waiting:
        _hooks.wait_ahead()
    kernel[grid](*args, **constexprs, **cfg.launch_kwargs())
