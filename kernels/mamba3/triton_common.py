"""What the Triton forward and backward of the Mamba-3 SISO scan share: the one guarded import of
Triton, the tile caps and the jit helpers both directions call.

Nothing here launches a kernel (``launching`` does). ``triton_bwd_chunk`` imports from this
module only; ``launching`` imports its tiles; ``triton_fwd`` and ``triton_sums`` import from it and
``launching``, ``triton_bwd`` from those and ``triton_bwd_chunk``; ``triton_siso`` composes the
forward and backward into the custom operators.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

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
        would run as mma.sync with both operands in registers: fewer registers held, so fewer
        spills in the chunk kernel at its register cap, for little time. A plan field
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
        :func:`m3run.kernels.mamba3.triton_siso.segment_ids`: the count of resets in the chunk up to
        and including each token, ``o_tc`` the chunk's positions). Returns which tokens the entering
        state reaches (before the chunk's first reset), which reach the leaving state (after its
        last one), whether the entering state survives the chunk (no reset in it) and which pairs of
        tokens share a segment. Masks, never −inf: a decay across a reset is zeroed, not
        underflowed. The ids only grow along a chunk (the padding repeats the last), so the last
        token's is their maximum, taken from the ids already loaded (no second load on the forward's
        serial path each chunk)."""
        b_seg = tl.load(seg + o_tc)
        b_last = tl.max(b_seg, axis=0)
        return b_seg == 0, b_seg == b_last, b_last == 0, b_seg[:, None] == b_seg[None, :]

    @triton.jit
    def chunk_phase(angles, s_at, s_as, b_dt, b_phi0, o_tc, m_t, S, BR: tl.constexpr,
                    DENSE: tl.constexpr):
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

    @triton.jit
    def tile_ptr(base, rows, cols, row_stride, r0, BR: tl.constexpr, BC: tl.constexpr,
                 DENSE: tl.constexpr):
        """Pointers to the (BR × BC) tile at row r0 of a (rows × cols) row-major matrix with
        unit column stride, and the mask of its elements inside the matrix (DENSE: the tile is
        inside it, :meth:`Tiles.dense`; the mask folds to true and the access goes unmasked)."""
        o_r = r0 + tl.arange(0, BR)
        o_c = tl.arange(0, BC)
        return (base + o_r[:, None] * row_stride + o_c[None, :],
                ((o_r < rows) | DENSE)[:, None] & ((o_c < cols) | DENSE)[None, :])

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
