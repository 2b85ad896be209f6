"""What the Triton forward and backward of the Mamba-3 SISO scan share: the one guarded import of
Triton, the tile caps, the launch configurations (this machine's tuned plans, else a checked-in
table per GPU architecture, else safe defaults; read at launch) and the jit helpers both
directions call.

Nothing here launches a kernel. ``triton_fwd``, ``triton_sums`` and ``triton_bwd_chunk`` import
from this module only, ``triton_bwd`` from it and the latter two; ``triton_siso`` composes the
forward and backward into the autograd Function.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)

try:  # Triton is optional: CPU machines import this module without it.
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: str | None = f"triton is not importable ({exc})"
else:
    TRITON_IMPORT_ERROR = None

# Tile caps: a chunk's (BT × p) and (BT × n) tiles and the (p × n) state live in registers.
CHUNK_SIZES = (16, 32, 64)
MAX_HEADDIM = 64  # p
MAX_DSTATE = 64  # n
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True under the Triton interpreter (TRITON_INTERPRET=1), where kernels run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def emulating_bf16() -> bool:
    """True in the interpreter with M3RUN_SCAN_EMULATE_BF16=1: fp32 inputs holding bf16 values
    run with every dot operand rounded to bf16 as on a GPU, the rest fp32 (a CPU test of the
    kernels' bf16 accuracy; the interpreter's own bf16 is not faithful)."""
    return interpreting() and os.environ.get("M3RUN_SCAN_EMULATE_BF16", "0") == "1"


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def shape_error(v: Tensor, n: int, chunk_size: int) -> str | None:
    """Why the Triton kernel cannot take these shapes or dtypes (None when it can)."""
    p = v.shape[-1]
    hint = '; use backend="pytorch"'
    if chunk_size not in CHUNK_SIZES:
        return f"the Triton scan takes chunk_size in {CHUNK_SIZES}, got {chunk_size}{hint}"
    if p > MAX_HEADDIM:
        return f"the Triton scan caps the head dim p at {MAX_HEADDIM}, got p={p}{hint}"
    if n > MAX_DSTATE:
        return f"the Triton scan caps the state size n at {MAX_DSTATE}, got n={n}{hint}"
    if v.dtype not in DTYPES:
        return f"the Triton scan takes v in {DTYPES}, got {v.dtype}{hint}"
    return None


@dataclass(frozen=True)
class Tiles:
    """Compile-time tile sizes of one call: chunk BT, head dim BP, state BN = 2·BN2 (pairs)."""

    BT: int
    BP: int
    BN2: int

    @classmethod
    def of(cls, p: int, n: int, chunk_size: int) -> Tiles:
        return cls(chunk_size, max(16, next_pow2(p)), max(8, next_pow2((n + 1) // 2)))

    @property
    def BN(self) -> int:
        return 2 * self.BN2

    def rot_pairs(self, s: int) -> int:
        """BR, the pairs of the state the kernels rotate: the first half of them (BN2 / 2) when
        the S angles fit there, else all BN2. Φ is 0 past the S angles, so the pairs past BR
        never turn: rotating them would only multiply by cos 0 and sin 0 (at S = 16 of n = 64,
        half the rotation's work, registers and MUFU calls)."""
        return self.BN2 // 2 if next_pow2(max(s, 1)) <= self.BN2 // 2 else self.BN2

    def dense(self, t: int, p: int, n: int, s: int) -> bool:
        """Whether a call's shape fills every tile: whole chunks (t a multiple of BT), p = BP
        (so any block of p rows is whole), n = BN and s = BR. The kernels then drop their bounds
        masks (a compile-time flag): the forward kernel compiles to 2,328 SASS instructions
        on sm_90 instead of 2,552, the difference the masks' compares and selects."""
        return t % self.BT == 0 and p == self.BP and n == self.BN and s == self.rot_pairs(s)


# --- launch configurations -------------------------------------------------------------------

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


def shape_key(tiles: Tiles, dtype: torch.dtype) -> str:
    """The launch table's key of a call: tile sizes and the dot dtype (fp32 tiles take twice the
    registers)."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    return f"c{tiles.BT}-p{tiles.BP}-n{tiles.BN}-{name}"


def arch_key(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


_fallback_logged: set[tuple] = set()


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
    arch, key = arch_key(device), shape_key(Tiles.of(p, n, chunk_size), dtype)
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


# --- jit helpers shared by the forward and the backward --------------------------------------

if triton is not None:
    PI = tl.constexpr(math.pi)
    TWO_PI = tl.constexpr(2.0 * math.pi)
    LOG2E_C = tl.constexpr(LOG2E)

    if interpreting():  # the interpreter has no libdevice fast paths

        @triton.jit
        def cos_sin(x):
            """cos x, sin x (exact in the interpreter)."""
            return tl.cos(x), tl.sin(x)

        @triton.jit
        def fast_div(x, y):
            """x / y (exact in the interpreter)."""
            return x / y

    else:
        from triton.language.extra import libdevice

        @triton.jit
        def fast_div(x, y):
            """x / y to 2 ulp (a reciprocal and a multiply) for |y| up to 2^126, 0 beyond (and
            for y = inf), NaN for a NaN: the IEEE division ``/`` compiles to about ten
            instructions with a slow-path check."""
            return libdevice.fast_dividef(x, y)

        @triton.jit
        def cos_sin(x):
            """cos x, sin x: the hardware approximations after reduction to [0, 2π) (absolute
            error ~1e-6, far below the bf16 rounding of the dot operands). libdevice's exact range
            reduction costs a local-memory table and many registers."""
            x = x - TWO_PI * tl.floor(x * (1.0 / TWO_PI))
            return libdevice.fast_cosf(x), libdevice.fast_sinf(x)

    if emulating_bf16():

        @triton.jit
        def to_dot(x, DT: tl.constexpr):
            """x rounded to the nearest bf16 (ties to even), kept in fp32: the GPU's bf16 dot
            operand, emulated."""
            u = x.to(tl.float32).to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            return u.to(tl.float32, bitcast=True)

    else:

        @triton.jit
        def to_dot(x, DT: tl.constexpr):
            """x as a dot operand of dtype DT."""
            return x.to(DT)

    @triton.jit
    def dot_t(a, b, WG: tl.constexpr):
        """a @ b (fp32 accumulation); with WG, formed as (bᵀ aᵀ)ᵀ. For ``a`` of a chunk's rows
        and ``b`` of 64 columns, the transposed product has 64 rows, which on sm_90 makes it a
        warpgroup MMA (wgmma) reading its operands from shared memory, where a chunk of 32 rows
        would run as mma.sync with both operands in registers. On an H200 the chunk kernel's
        spills at its 168-register cap went from 236 to 100 B a thread (ptxas), but its time
        only from 1.378 to 1.371 ms; the forward's from 0.556 to 0.544 ms. A plan field
        (``LaunchConfig.wg``), so the table keeps it to the GPUs it was timed on."""
        if WG:
            return tl.trans(tl.dot(tl.trans(b), tl.trans(a)))
        return tl.dot(a, b)

    @triton.jit
    def tanh(x):
        """tanh through exp2 of a non-positive argument: no overflow, no cancellation near 0."""
        e = tl.exp2((-2.0 * LOG2E_C) * tl.abs(x))
        r = fast_div(1.0 - e, 1.0 + e)
        return tl.where(x < 0, -r, r)

    @triton.jit
    def sigmoid(x):
        """1 / (1 + e^−x): 0 for x below about −87 (the denominator past 2^126), NaN for NaN."""
        return fast_div(1.0, 1.0 + tl.exp2(-LOG2E_C * x))

    @triton.jit
    def chunk_scalars(adt, dt, trap, T, o_tc, m_t, o_t, BT: tl.constexpr):
        """Per-token scalars of one chunk (pointers at the (batch, head) row): Δ, λΔ (the
        diagonal weight), the trapezoid weight w, and the chunk-local cumulative decay A in the
        log2 domain with its last value."""
        m_n = o_tc + 1 < T
        b_adt = tl.load(adt + o_tc, mask=m_t, other=0.0)
        b_dt = tl.load(dt + o_tc, mask=m_t, other=0.0)
        b_lam = sigmoid(tl.load(trap + o_tc, mask=m_t, other=0.0))
        # Δ_{t+1}, λ_{t+1}; Δ_{T+1} = 0 ends the trapezoid at the last token.
        b_dtn = tl.load(dt + o_tc + 1, mask=m_n, other=0.0)
        b_lamn = sigmoid(tl.load(trap + o_tc + 1, mask=m_n, other=0.0))
        b_cur = b_lam * b_dt
        b_w = b_cur + (1.0 - b_lamn) * b_dtn
        b_A2 = tl.cumsum(b_adt, axis=0) * LOG2E_C
        b_AL2 = tl.sum(tl.where(o_t == BT - 1, b_A2, 0.0), axis=0)
        return b_dt, b_cur, b_w, b_A2, b_AL2

    @triton.jit
    def decay_weights(b_A2, b_w, b_cur, m_strict, m_diag):
        """exp(A_i − A_j)·W_ij: w_j below the diagonal, λ_jΔ_j on it (the diagonal correction)."""
        b_decay = tl.exp2(tl.minimum(b_A2[:, None] - b_A2[None, :], 0.0))
        return tl.where(m_strict, b_decay * b_w[None, :], tl.where(m_diag, b_cur[None, :], 0.0))

    @triton.jit
    def segments(seg, o_tc):
        """Where resets cut a chunk, from its segment ids (``seg`` points at the batch row of
        :func:`kernels.mamba3.triton_siso.segment_ids`: the count of resets in the chunk up to and
        including each token, ``o_tc`` the chunk's positions). Returns which tokens the entering
        state reaches (before the chunk's first reset), which reach the leaving state (after its
        last one), whether the entering state survives the chunk (no reset in it) and which
        pairs of tokens share a segment. Masks, never −inf: a decay across a reset is zeroed,
        not underflowed. The ids only grow along a chunk (the padding repeats the last), so the
        last token's is their maximum, taken from the ids already loaded (no second load on the
        forward's serial path each chunk)."""
        b_seg = tl.load(seg + o_tc)
        b_last = tl.max(b_seg, axis=0)
        return b_seg == 0, b_seg == b_last, b_last == 0, b_seg[:, None] == b_seg[None, :]

    @triton.jit
    def chunk_phase(angles, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BR: tl.constexpr,
                    DENSE: tl.constexpr):  # fmt: skip
        """cos Φ, sin Φ for the tokens ``o_tc`` (BT × BR; Φ = 0 past the S angles): the chunk's
        entering angle plus the chunk-local cumsum of Δ·π·tanh(θ̃); and the chunk's angle sum.
        ``angles`` points at the (batch, head) row. DENSE: S = BR (:meth:`Tiles.dense`)."""
        o_m = tl.arange(0, BR)
        m_a = m_t[:, None] & ((o_m < S) | DENSE)[None, :]
        b_th = tl.load(angles + o_tc[:, None] * s_at + o_m[None, :] * s_as, mask=m_a, other=0.0)
        b_dphi = b_dt[:, None] * PI * tanh(b_th)
        b_cos, b_sin = cos_sin(b_phi0[None, :] + tl.cumsum(b_dphi, axis=0))
        return b_cos, b_sin, tl.sum(b_dphi, axis=0)

    @triton.jit
    def halves(x, BT: tl.constexpr, B: tl.constexpr):
        """The first and the last B columns of a (BT × 2·B) tile, in registers."""
        return tl.split(tl.permute(tl.reshape(x, (BT, 2, B)), (0, 2, 1)))

    @triton.jit
    def unhalves(a, b, BT: tl.constexpr, B: tl.constexpr):
        """The (BT × 2·B) tile whose first and last B columns are ``a`` and ``b``."""
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (BT, 2 * B))

    @triton.jit
    def _rotate_pairs(b_a, b_cos, b_sin, BT: tl.constexpr, BR: tl.constexpr):
        b_e, b_o = tl.split(tl.reshape(b_a, (BT, BR, 2)))
        b_r = tl.join(b_e * b_cos - b_o * b_sin, b_e * b_sin + b_o * b_cos)
        return tl.reshape(b_r, (BT, 2 * BR))

    @triton.jit
    def rotate(b_a, b_cos, b_sin, BT: tl.constexpr, BN2: tl.constexpr, BR: tl.constexpr):
        """R(Φ)a for a (BT × 2·BN2) fp32 tile in natural column order (pairs adjacent), with
        cos Φ, sin Φ (BT × BR) of its first BR pairs (:meth:`Tiles.rot_pairs`): those columns
        split into even and odd in registers, rotated, joined back; the rest as they are."""
        if BR == BN2:
            b_r = _rotate_pairs(b_a, b_cos, b_sin, BT, BR)
        else:
            b_1, b_2 = halves(b_a, BT, BN2)
            b_r = unhalves(_rotate_pairs(b_1, b_cos, b_sin, BT, BR), b_2, BT, BN2)
        return b_r


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


if triton is not None:

    @triton.jit
    def tile_ptr(base, rows, cols, row_stride, r0, BR: tl.constexpr, BC: tl.constexpr,
                 DENSE: tl.constexpr):  # fmt: skip
        """Pointers to the (BR × BC) tile at row r0 of a (rows × cols) row-major matrix with
        unit column stride, and the mask of its elements inside the matrix (DENSE: the tile is
        inside it, :meth:`Tiles.dense`; the mask folds to true and the access goes unmasked)."""
        o_r = r0 + tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        return (base + o_r[:, None] * row_stride + o_c[None, :],
                ((o_r < rows) | DENSE)[:, None] & ((o_c < cols) | DENSE)[None, :])  # fmt: skip

    @triton.jit
    def load_tile(ptr):
        return tl.load(ptr[0], mask=ptr[1], other=0.0)

    @triton.jit
    def store_tile(ptr, value):
        tl.store(ptr[0], value.to(ptr[0].dtype.element_ty), mask=ptr[1])

    @triton.jit
    def _dense(base, r0, BR: tl.constexpr, BC: tl.constexpr):
        return base + (r0 + tl.arange(0, BR))[:, None] * BC + tl.arange(0, BC)[None, :]

    @triton.jit
    def load_dense(base, r0, BR: tl.constexpr, BC: tl.constexpr):
        """The (BR × BC) tile at row r0 of a row-major matrix of BC columns that holds it
        whole (a chunk's state): no bounds to check, so no mask."""
        return tl.load(_dense(base, r0, BR, BC))

    @triton.jit
    def store_dense(base, r0, value, BR: tl.constexpr, BC: tl.constexpr):
        p = _dense(base, r0, BR, BC)
        tl.store(p, value.to(p.dtype.element_ty))
