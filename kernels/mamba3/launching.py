"""How the Triton scan's kernels are launched: each kernel's launch configuration and the plan a
call runs under (this machine's tuned plans, else the checked-in table per GPU architecture, else
safe defaults; read at launch, never tuned in a training process), the tuner's process-wide
overrides, and ``launch`` itself, which hands a launch to a recorder instead where one is set
and waits for the kernels' compile ahead.

``triton_fwd``, ``triton_bwd`` and ``triton_sums`` launch through it, ``triton_siso`` asks it for
a call's plan; it takes the tile sizes from ``triton_common``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch

from .triton_common import CHUNK_SIZES, Tiles, interpreting

log = logging.getLogger(__name__)

KERNELS = ("fwd", "bwd_dstate", "bwd_chunk", "bwd_angle")


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
        bad = [f"{k}={getattr(self, k)!r}" for k, low in least.items()
               if not isinstance(getattr(self, k), int) or getattr(self, k) < low]  # fmt: skip
        if self.num_warps not in (1, 2, 4, 8, 16):
            bad.append(f"num_warps={self.num_warps!r} (1, 2, 4, 8 or 16)")
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int)
                                         or not 24 <= self.maxnreg <= 255):  # fmt: skip
            bad.append(f"maxnreg={self.maxnreg!r} (None or 24..255)")
        if bad:
            raise ValueError(f"launch configuration with bad fields: {', '.join(bad)}")

    def launch_kwargs(self) -> dict:
        kw = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw

    def as_dict(self) -> dict:
        out = {"num_warps": self.num_warps, "num_stages": self.num_stages,
               "maxnreg": self.maxnreg, "bv": self.bv}  # fmt: skip
        for key, default in (("hpp", 1), ("cpp", 1), ("wg", 0), ("hb", 1)):  # where not default
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        return out


# Used where the table has no entry for the GPU architecture and shape: fits every supported
# architecture (sm_80 and newer) at every tile size, found by ptxas without spills on sm_80.
DEFAULT_CONFIGS: dict[str, LaunchConfig] = {
    "fwd": LaunchConfig(num_warps=4, num_stages=2),
    "bwd_dstate": LaunchConfig(num_warps=4, num_stages=1),
    "bwd_chunk": LaunchConfig(num_warps=4, num_stages=1),
    "bwd_angle": LaunchConfig(num_warps=4, num_stages=2),
}


# The kernels' chunk where the table has no plan. On an H200 the main backward kernel ran 1.94 ms
# at chunk 32 against 2.51 ms at 64 (bench/tune_scan.py, 2026-12-01), and compiled for sm_80
# under the defaults the chunk kernel has no spills at 32 against 836 B per thread at 64
# (kernels/mamba3/triton_report.py, 2026-12-02).
DEFAULT_CHUNK = 32


# The dot dtypes the kernels take, by the name the launch table's keys give them.
DOT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DOT_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The launch table's name of a dot dtype (KeyError for one the kernels do not take)."""
    return _DTYPE_NAMES[dtype]


def shape_key(tiles: Tiles, dtype: torch.dtype) -> str:
    """The launch table's key of a call: tile sizes and the dot dtype (fp32 tiles take twice the
    registers)."""
    return f"c{tiles.BT}-p{tiles.BP}-n{tiles.BN}-{dtype_name(dtype)}"


def arch_key(device: torch.device) -> str:
    if torch.compiler.is_compiling():  # traced: nothing cached (a dict read would be guarded)
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = torch.cuda.get_device_capability(index)
    return f"sm{cap[0]}{cap[1]}"


_capabilities: dict[int, tuple[int, int]] = {}  # by device index
_fallback_logged: set[tuple] = set()
# The plan of each (arch, p, n, chunk, dtype) a call has asked for, with the local plans it was
# read against: three lookups a forward and backward took 0.25 ms of the host's 2.4 ms on an H200
# host (docs/benchmarks.md, 2026-12-04 (fifth)), more than a launch.
_plans_seen: dict[tuple, tuple[object, Plan]] = {}


@dataclass(frozen=True)
class Plan:
    """How one call runs: the chunk the kernels use (the result does not depend on it beyond
    rounding, so the table may pick another than the caller's) and each kernel's launch."""

    chunk: int
    configs: dict[str, LaunchConfig]


def plan_for(device: torch.device, p: int, n: int, chunk_size: int, dtype: torch.dtype) -> Plan:
    """The plan a call runs under: one forced on the process (:func:`forcing_plan`, the tuner's),
    else the tuned plan for this GPU architecture and shape (:func:`plan_source` says from
    where), else the defaults, logged once: the caller's chunk capped at DEFAULT_CHUNK and
    DEFAULT_CONFIGS. The interpreter and CPU tensors run the caller's chunk with the defaults."""
    if _tuner.plan is not None:
        return _tuner.plan
    if interpreting() or device.type != "cuda":
        return Plan(chunk_size, dict(DEFAULT_CONFIGS))
    if torch.compiler.is_compiling():  # traced (the scan's segment ids take the plan's chunk)
        return _plan_of(arch_key(device), p, n, chunk_size, dtype)
    from . import local_plans

    seen_key, local = (arch_key(device), p, n, chunk_size, dtype), local_plans.entries()
    seen = _plans_seen.get(seen_key)
    if seen is not None and seen[0] is local:  # read against the same local plans
        return seen[1]
    plan = _plan_of(*seen_key)
    _plans_seen[seen_key] = (local, plan)
    return plan


def _plan_of(arch: str, p: int, n: int, chunk_size: int, dtype: torch.dtype) -> Plan:
    key = shape_key(Tiles.of(p, n, chunk_size), dtype)
    found = _tuned(arch, key)
    if found is None:
        # Not while torch.compile traces the scan's caller: a log call there breaks the graph
        # (a block's one graph became eight on an H200); the first call that runs logs it.
        if (arch, key) not in _fallback_logged and not torch.compiler.is_compiling():
            _fallback_logged.add((arch, key))
            log.warning("mamba3 scan: %s", _untuned_message(arch, key))
        return untuned_plan(chunk_size)
    return found[0]


def untuned_plan(chunk_size: int) -> Plan:
    """What a call of ``chunk_size`` runs where no tuned plan exists: its chunk capped at
    DEFAULT_CHUNK, with DEFAULT_CONFIGS (the tuners time their plans against it)."""
    return Plan(min(chunk_size, DEFAULT_CHUNK), dict(DEFAULT_CONFIGS))


def plan_source(device: torch.device, p: int, n: int, chunk_size: int,
                dtype: torch.dtype) -> str:  # fmt: skip
    """Where :func:`plan_for` takes this shape's plan from on ``device``, in words (for the smoke
    test's report): this machine's tuned plans, the checked-in table, or the defaults and how to
    tune them."""
    if interpreting() or device.type != "cuda":
        return "the default launch plans (no CUDA device)"
    from . import local_plans

    arch, key = arch_key(device), shape_key(Tiles.of(p, n, chunk_size), dtype)
    found = _tuned(arch, key)
    if found is None:
        return _untuned_message(arch, key)
    plan, local = found
    where = (f"tuned on this machine ({local_plans.plans_path()})" if local
             else "the checked-in launch table")  # fmt: skip
    return f"{where} ({arch} {key}, chunk {plan.chunk})"


def has_tuned_plan(device: torch.device, p: int, n: int, chunk_size: int,
                   dtype: torch.dtype) -> bool:  # fmt: skip
    """Whether this shape has a tuned plan on ``device`` (this machine's or the table's)."""
    return _tuned(arch_key(device), shape_key(Tiles.of(p, n, chunk_size), dtype)) is not None


def _untuned_message(arch: str, key: str) -> str:
    from .local_plans import TUNE_COMMAND, plans_path

    return (f"no tuned launch plan for {arch} {key} (neither in kernels/mamba3/launch_table.py "
            f"nor in {plans_path()}): running the defaults, slower; run `{TUNE_COMMAND}` on "
            "this GPU once to tune them")  # fmt: skip


def _tuned(arch: str, key: str) -> tuple[Plan, bool] | None:
    """The plan tuned on this machine (`m3run tune-scan`; its entries checked when read), else
    the checked-in table's, and whether it is this machine's; None when neither has one.
    torch.compile traces this (the scan's segment ids take the plan's chunk): dict reads only."""
    from . import local_plans
    from .launch_table import TABLE

    entry, local = local_plans.lookup(arch, key), True
    if entry is None:
        entry, local = TABLE.get(arch, {}).get(key), False
    if entry is None:
        return None
    return Plan(int(entry["chunk"]), entry_configs(entry)), local


def _entry_error(entry: dict) -> str | None:
    """Why a stored entry makes no plan (None: it does)."""
    if entry.get("chunk") not in CHUNK_SIZES:
        return f"chunk {entry.get('chunk')!r} is not one of {CHUNK_SIZES}"
    unknown = sorted(set(entry) - {"chunk", *KERNELS})
    if unknown:
        return f"unknown kernels {unknown}"
    try:
        entry_configs(entry)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


class _Tuner:
    """What the tuner (kernels/mamba3/tuning.py, in a process that does nothing else) sets for
    every thread of the process: the autograd engine runs a CUDA backward on a thread of its own,
    so a plan or a recorder set for the calling thread alone would leave the backward under the
    table's plan (at another chunk than the forward's saved states) and unrecorded."""

    plan: Plan | None = None
    recorder = None


_tuner = _Tuner()


@contextlib.contextmanager
def forcing_plan(plan: Plan):
    """Within this block every scan of the process runs under ``plan``, whatever the tables say
    (the tuner's; see :class:`_Tuner`)."""
    before, _tuner.plan = _tuner.plan, plan
    try:
        yield
    finally:
        _tuner.plan = before


@contextlib.contextmanager
def recording_everywhere(recorder):
    """Within this block every thread's launches go to ``recorder`` (as :func:`set_recorder`,
    which one thread's recorder overrides), the autograd engine's included (the tuner's)."""
    before, _tuner.recorder = _tuner.recorder, recorder
    try:
        yield
    finally:
        _tuner.recorder = before


def entry_configs(entry: dict) -> dict[str, LaunchConfig]:
    """A launch-table entry's configuration of every kernel, the default where it names none."""
    return {name: LaunchConfig(**entry[name]) if name in entry else DEFAULT_CONFIGS[name]
            for name in KERNELS}  # fmt: skip


def _read_local_plans() -> None:
    from . import local_plans

    local_plans.load(_entry_error)


_read_local_plans()  # now, not under torch.compile's trace of plan_for


# --- launching ---------------------------------------------------------------------------------

# Where this thread's launches go instead of the GPU while a recorder is set: triton_report
# compiles them for a chosen architecture without a GPU (registers, spills, shared memory), and
# triton_precompile compiles them before their first use. Per thread, so that recording on one
# thread never takes another's launches.
_recording = threading.local()


def set_recorder(recorder) -> None:
    """Hand this thread's launches to ``recorder(name, kernel, grid, args, constexprs, cfg)``
    instead of launching them (None: launch them again)."""
    _recording.recorder = recorder


# Compiles ahead in flight (triton_precompile's futures). A launch meanwhile waits for them: the
# kernel it needs is most likely among theirs, and compiling it again on the launching thread
# would take as long as the pool's compile of every kernel. Empty once they end, so a launch
# pays one truth test of an empty list. A compile ahead that outlasts AHEAD_WAIT_S is waited for
# no more (logged once): the launches compile what they need themselves.
_ahead: list[Future] = []
AHEAD_WAIT_S = 300.0


def compiling_ahead(future: Future) -> None:
    """Launches wait for ``future`` (a compile ahead of them) until it ends."""
    _ahead.append(future)
    future.add_done_callback(_ahead_ended)


def _ahead_ended(future: Future) -> None:
    with contextlib.suppress(ValueError):  # given up on already
        _ahead.remove(future)


def _wait_ahead() -> None:
    for future in list(_ahead):
        done, _ = wait([future], timeout=AHEAD_WAIT_S)
        if not done:
            _ahead_ended(future)
            log.warning(
                "the scan kernels' compile ahead still runs after %.0f s: launches compile "
                "their kernels themselves from here on", AHEAD_WAIT_S,
            )  # fmt: skip


def launch(name: str, kernel, grid: tuple, args: tuple, constexprs: dict, cfg: LaunchConfig):
    """Launch ``kernel`` (the launch table calls it ``name``) on ``grid``, or hand it to this
    thread's recorder; while a compile ahead runs, after it."""
    recorder = getattr(_recording, "recorder", None) or _tuner.recorder
    if recorder is not None:
        recorder(name, kernel, grid, args, constexprs, cfg)
        return
    if _ahead:
        _wait_ahead()
    kernel[grid](*args, **constexprs, **cfg.launch_kwargs())
