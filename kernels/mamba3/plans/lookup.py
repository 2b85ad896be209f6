"""Which launch plan a scan call runs under, owned by one object, :class:`LaunchPlans`: a plan
forced on the process (the tuner's), else this machine's tuned plans (``local.py``), else the
checked-in table (``table.py``), else the defaults. Read at launch, never tuned in a training
process.

This machine's plans file is read at the first lookup, not at import: a worker started early
(the warm spare, beside the smoke test) imports the kernels before the smoke test may have tuned
a plan, and its first lookup comes after it was handed a run, so it reads what the smoke test
stored.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..triton_common import Tiles, interpreting
from .local import TUNE_COMMAND, LocalPlans, plans_path
from .plan import DEFAULT_CONFIGS, Plan, entry_error, entry_plan, shape_key, untuned_plan
from .table import TABLE

log = logging.getLogger(__name__)


class LaunchPlans:
    """The process's launch plans: the checked-in table, this machine's plans file (read on
    first use), the plan the tuner forces, and what lookups keep between calls.

    Every scan call asks for its plan (three times a forward and backward), and a lookup costs
    more of the host's time than a launch (docs/benchmarks.md), so the plan of each shape is
    kept with the local entries it was read against and looked up again only after they are
    read again. Nothing is kept while torch.compile traces a lookup: a read of a kept dict would
    become a guard, and every compiled block would compile again when it changed."""

    def __init__(self, table: dict | None = None, local: LocalPlans | None = None) -> None:
        self.table = TABLE if table is None else table
        self.local = LocalPlans(entry_error) if local is None else local
        self.forced: Plan | None = None
        self._capabilities: dict[int, tuple[int, int]] = {}  # by device index
        self._untuned_logged: set[tuple[str, str]] = set()
        self._seen: dict[tuple, tuple[object, Plan]] = {}  # by (arch, p, n, chunk, dtype)

    def arch_key(self, device: torch.device) -> str:
        """The tables' name of ``device``'s architecture (``sm90``)."""
        if torch.compiler.is_compiling():  # traced: nothing kept (a dict read would be guarded)
            major, minor = torch.cuda.get_device_capability(device)
            return f"sm{major}{minor}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = self._capabilities.get(index)
        if cap is None:
            cap = self._capabilities[index] = torch.cuda.get_device_capability(index)
        return f"sm{cap[0]}{cap[1]}"

    def plan_for(
        self, device: torch.device, p: int, n: int, chunk_size: int, dtype: torch.dtype
    ) -> Plan:
        """The plan a call runs under: one forced on the process (:meth:`forcing`, the
        tuner's), else the tuned plan for this GPU architecture and shape (:meth:`source` says
        from where), else the defaults, logged once: :func:`untuned_plan`. The interpreter and
        CPU tensors run the caller's chunk with the defaults."""
        if self.forced is not None:
            return self.forced
        if interpreting() or device.type != "cuda":
            return Plan(chunk_size, dict(DEFAULT_CONFIGS))
        if torch.compiler.is_compiling():  # traced (the scan's segment ids take the plan's chunk)
            _read_local_plans_outside_the_trace()
            return self._plan_of(self.arch_key(device), p, n, chunk_size, dtype)
        seen_key, local = (self.arch_key(device), p, n, chunk_size, dtype), self.local.entries()
        seen = self._seen.get(seen_key)
        if seen is not None and seen[0] is local:  # read against the same local plans
            return seen[1]
        plan = self._plan_of(*seen_key)
        self._seen[seen_key] = (local, plan)
        return plan

    def source(
        self, device: torch.device, p: int, n: int, chunk_size: int, dtype: torch.dtype
    ) -> str:
        """Where :meth:`plan_for` takes this shape's plan from on ``device``, in words (for the
        smoke test's report): this machine's tuned plans, the checked-in table, or the defaults
        and how to tune them."""
        if interpreting() or device.type != "cuda":
            return "the default launch plans (no CUDA device)"
        arch, key = self.arch_key(device), shape_key(Tiles.of(p, n, chunk_size), dtype)
        found = self.tuned(arch, key)
        if found is None:
            return _untuned_message(arch, key)
        plan, local = found
        where = (
            f"tuned on this machine ({plans_path()})" if local else "the checked-in launch table"
        )
        return f"{where} ({arch} {key}, chunk {plan.chunk})"

    def has_tuned(
        self, device: torch.device, p: int, n: int, chunk_size: int, dtype: torch.dtype
    ) -> bool:
        """Whether this shape has a tuned plan on ``device`` (this machine's or the table's)."""
        arch, key = self.arch_key(device), shape_key(Tiles.of(p, n, chunk_size), dtype)
        return self.tuned(arch, key) is not None

    def tuned(self, arch: str, key: str) -> tuple[Plan, bool] | None:
        """The plan tuned on this machine (`m3run tune-scan`; its entries checked when read),
        else the checked-in table's, and whether it is this machine's; None when neither has
        one. torch.compile traces this (the scan's segment ids take the plan's chunk): dict
        reads only."""
        entry, local = self.local.lookup(arch, key), True
        if entry is None:
            entry, local = self.table.get(arch, {}).get(key), False
        if entry is None:
            return None
        return entry_plan(entry), local

    @contextlib.contextmanager
    def forcing(self, plan: Plan):
        """Within this block every scan of the process runs under ``plan``, whatever the tables
        say (the tuner's). For every thread: the autograd engine runs a CUDA backward on a
        thread of its own, and a plan forced on the calling thread alone would leave the
        backward under the table's plan, at another chunk than the forward's saved states."""
        before, self.forced = self.forced, plan
        try:
            yield
        finally:
            self.forced = before

    def _plan_of(self, arch: str, p: int, n: int, chunk_size: int, dtype: torch.dtype) -> Plan:
        key = shape_key(Tiles.of(p, n, chunk_size), dtype)
        found = self.tuned(arch, key)
        if found is None:
            # Not while torch.compile traces the scan's caller: a log call there breaks the
            # graph into many; the first call that runs logs it.
            if (arch, key) not in self._untuned_logged and not torch.compiler.is_compiling():
                self._untuned_logged.add((arch, key))
                log.warning("mamba3 scan: %s", _untuned_message(arch, key))
            return untuned_plan(chunk_size)
        return found[0]


def _untuned_message(arch: str, key: str) -> str:
    return (
        f"no tuned launch plan for {arch} {key} (neither in kernels/mamba3/plans/table.py "
        f"nor in {plans_path()}): running the defaults, slower; run `{TUNE_COMMAND}` on "
        "this GPU once to tune them"
    )


# The process's launch plans. Reached through the functions below at every call (never bound at
# import), so that a test may put a fresh object in its place.
PLANS = LaunchPlans()


@torch.compiler.assume_constant_result
def _read_local_plans_outside_the_trace() -> bool:
    """Read this machine's plans file if no lookup has yet. torch.compile runs this as it is
    rather than tracing it (a file read in a trace breaks the graph), so a process whose first
    lookup is traced reads the file as an eager one would."""
    PLANS.local.entries()
    return True


def launch_plans() -> LaunchPlans:
    """The process's launch plans."""
    return PLANS


def plan_for(device: torch.device, p: int, n: int, chunk_size: int, dtype: torch.dtype) -> Plan:
    """The plan a scan call runs under (:meth:`LaunchPlans.plan_for`)."""
    return PLANS.plan_for(device, p, n, chunk_size, dtype)


def arch_key(device: torch.device) -> str:
    """The tables' name of ``device``'s architecture (:meth:`LaunchPlans.arch_key`)."""
    return PLANS.arch_key(device)
