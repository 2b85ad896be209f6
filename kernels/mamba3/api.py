"""The one public entry point of the Mamba-3 SISO scan: validation, casting and backend choice.

The contract (DESIGN.md, "The scan contract") is stated in :func:`mamba3_siso`'s docstring.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import Tensor

from .chunk import siso_chunked
from .naive import State, siso_recurrent, siso_step

log = logging.getLogger(__name__)

Backend = Literal["auto", "triton", "pytorch"]
BACKENDS = ("auto", "triton", "pytorch")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP32_OR_64 = (torch.float32, torch.float64)
_auto_logged: set[str] = set()


class BackendUnavailableError(RuntimeError):
    """The requested scan backend cannot run here. Never answered by a silent fallback."""


def triton_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the Triton scan cannot run on ``device`` (None when it can).

    Shapes and dtypes are a separate question, answered by :func:`triton_shape_error`.
    """
    hint = '; use backend="pytorch" (model.scan_backend=pytorch)'
    if device is not None and torch.device(device).type != "cuda":
        return f"it needs a CUDA device, the inputs are on {torch.device(device).type}{hint}"
    if not torch.cuda.is_available():
        return f"CUDA is not available{hint}"
    from .triton_common import TRITON_IMPORT_ERROR  # imports triton, if it is there

    if TRITON_IMPORT_ERROR is not None:
        return f"{TRITON_IMPORT_ERROR}{hint}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"it needs compute capability 8.0 or newer (bf16 dots), got {major}.{minor}{hint}"
    return None


def triton_shape_error(v: Tensor, n: int, chunk_size: int) -> str | None:
    """Why the Triton kernel cannot take these shapes/dtypes (its tile caps), None when it can."""
    from .triton_common import shape_error

    return shape_error(v, n, chunk_size)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map "auto" to a concrete backend and refuse one that cannot run on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"scan backend 'triton' cannot run: {reason}")
        return "triton"
    if backend == "auto":
        reason = triton_unavailable_reason(device)
        chosen = "pytorch" if reason is not None else "triton"
        key = f"{device.type}:{chosen}"
        # Logged from eager calls only: under torch.compile a logging call would break the graph
        # and the set's change would fail the guards of the next layer's compiled code.
        if not torch.compiler.is_compiling() and key not in _auto_logged:
            _auto_logged.add(key)
            why = f" ({reason})" if reason else ""
            log.info("mamba3 scan backend auto -> %s on %s%s", chosen, device.type, why)
        return chosen
    return backend


def uses_triton_kernels(backend: str, x: Tensor) -> bool:
    """Whether a model part beside the scan (the SwiGLU operator, the loss's cross-entropy
    kernel) runs its Triton kernel on ``x``: where ``backend`` resolves to Triton on x's device,
    and under "auto" only for the dtypes the kernels take (float64 runs the PyTorch form); an
    explicit "triton" that cannot run raises, as :func:`resolve_backend` does."""
    if backend == "pytorch" or resolve_backend(backend, x.device) != "triton":
        return False
    from .triton_common import DTYPES

    return backend == "triton" or x.dtype in DTYPES


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _shape(x: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in x.shape) + ")"


def validate(
    q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, chunk_size, initial_state, reset=None
) -> tuple[int, int, int, int, int, int, int]:
    """Check every shape, dtype and the chunk size up front. Returns (b, t, g, h, p, n, s)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(x, Tensor), f"{name} must be a torch.Tensor, got {type(x).__name__}")
        _check(x.dim() == 4, f"{name} must be 4-D, got shape {_shape(x)}")
        _check(x.dtype in _FLOAT, f"{name} must be a floating tensor, got {x.dtype}")
    b, t, g, n = k.shape
    _check(t >= 1, f"the sequence must hold at least one token, got t={t}")
    _check(q.shape == k.shape, f"q must match k's shape (b, t, g, n)={_shape(k)}, got {_shape(q)}")
    _check(v.shape[:2] == (b, t), f"v must be (b={b}, t={t}, h, p), got {_shape(v)}")
    h, p = v.shape[2], v.shape[3]
    _check(g in (1, h), f"k/q groups g must be 1 or h={h}, got g={g}")
    for name, x in (("adt", adt), ("dt", dt), ("trap", trap)):
        _check(x.shape == (b, h, t), f"{name} must be (b, h, t)=({b}, {h}, {t}), got {_shape(x)}")
        _check(x.dtype in _FP32_OR_64, f"{name} must be float32 (or float64), got {x.dtype}")
    for name, x in (("q_bias", q_bias), ("k_bias", k_bias)):
        _check(x.shape == (h, n), f"{name} must be (h, n)=({h}, {n}), got {_shape(x)}")
        _check(x.dtype in _FP32_OR_64, f"{name} must be float32 (or float64), got {x.dtype}")
    _check(
        angles.dim() == 4 and angles.shape[:2] == (b, t) and angles.shape[2] in (1, h),
        f"angles must be (b, t, h, s)=({b}, {t}, {h}, s) or, one set for every head, "
        f"(b, t, 1, s)=({b}, {t}, 1, s), got {_shape(angles)}",
    )
    s = angles.shape[3]
    _check(2 * s <= n, f"angles rotate 2·s dims of n={n}, so s must be ≤ {n // 2}, got s={s}")
    _check(angles.dtype in _FP32_OR_64, f"angles must be float32 (or float64), got {angles.dtype}")
    if d is not None:
        _check(d.shape == (h,), f"d must be (h,)=({h},), got {_shape(d)}")
    if z is not None:
        _check(z.shape == v.shape, f"z must match v's shape {_shape(v)}, got {_shape(z)}")
    _check(
        isinstance(chunk_size, int) and chunk_size >= 1 and chunk_size & (chunk_size - 1) == 0,
        f"chunk_size must be a power of two ≥ 1, got {chunk_size!r}",
    )
    if initial_state is not None:
        _check(
            isinstance(initial_state, (tuple, list)) and len(initial_state) == 4,
            "initial_state must be the 4-tuple (angle_state, ssm_state, k_state, v_state)",
        )
        want = ((b, h, s), (b, h, p, n), (b, h, n), (b, h, p))
        names = ("angle_state", "ssm_state", "k_state", "v_state")
        for name, x, shape in zip(names, initial_state, want, strict=True):
            _check(
                isinstance(x, Tensor) and tuple(x.shape) == shape,
                f"initial_state {name} must be {shape}, got "
                f"{_shape(x) if isinstance(x, Tensor) else type(x).__name__}",
            )
    if reset is not None:
        _check(
            isinstance(reset, Tensor) and tuple(reset.shape) == (b, t),
            f"reset must be a (b, t)=({b}, {t}) bool tensor (True where a document starts), got "
            f"{_shape(reset) if isinstance(reset, Tensor) else type(reset).__name__}",
        )
        _check(
            reset.dtype == torch.bool,
            f"reset must be a bool tensor, got {reset.dtype} (fix: pass a bool mask, e.g. "
            "reset.bool())",
        )
    devices = {x.device for x in (q, k, v, adt, dt, trap, q_bias, k_bias, angles)}
    devices |= {x.device for x in (d, z, reset) if x is not None}
    _check(len(devices) == 1, f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return b, t, g, h, p, n, s


def _prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, initial_state, h):
    """Cast to the compute dtype and expand groups to heads."""
    cdt = torch.float64 if v.dtype == torch.float64 else torch.float32
    if q.shape[2] != h:
        q, k = q.expand(-1, -1, h, -1), k.expand(-1, -1, h, -1)
    angles = angles.expand(-1, -1, h, -1)
    cast = [x.to(cdt) if x is not None else None for x in (q, k, v, adt, dt, trap)]
    cast += [x.to(cdt) if x is not None else None for x in (q_bias, k_bias, angles, d, z)]
    state = None if initial_state is None else tuple(x.to(cdt) for x in initial_state)
    return cast, state


def mamba3_siso(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    adt: Tensor,
    dt: Tensor,
    trap: Tensor,
    q_bias: Tensor,
    k_bias: Tensor,
    angles: Tensor,
    d: Tensor | None = None,
    z: Tensor | None = None,
    *,
    chunk_size: int = 64,
    initial_state: State | None = None,
    return_final_state: bool = False,
    reset: Tensor | None = None,
    backend: Backend = "auto",
    zv: Tensor | None = None,
) -> Tensor | tuple[Tensor, State]:
    """Mamba-3 SISO scan (exponential-trapezoidal, complex-valued via data-dependent RoPE).

    Args:
        q, k: (b, t, g, n), g = 1 or h. RMS-normed C and B; the biases are added here.
        v, z: (b, t, h, p). x and the gate input; ``y`` is multiplied by ``silu(z)``.
        adt, dt, trap: (b, h, t) float32. A·Δ (≤ 0), Δ (> 0), pre-sigmoid λ.
        q_bias, k_bias: (h, n) float32. Per-head biases of C and B.
        angles: (b, t, h, s) float32, pre-tanh θ̃; 2s ≤ n. Or (b, t, 1, s), one set for every
            head (Mamba-3's): the Triton backward then sums their gradient over heads itself.
        d: (h,) skip weight, optional.
        initial_state: (angle_state (b,h,s), ssm_state (b,h,p,n), k_state (b,h,n), v_state (b,h,p)).
        reset: (b, t) bool, optional. True at a token before which the state is zero (a document
            start in a packed window): neither the state nor the previous token's pending
            trapezoid half-term crosses it; a reset on token 0 discards ``initial_state``'s
            ssm state and pending term. The angle Φ runs on across it (outputs and gradients
            depend on angle differences inside a document only).
        backend: "pytorch" (chunked reference), "triton" (CUDA; raises BackendUnavailableError
            where it cannot run and ValueError beyond its tile caps), or "auto" (triton on CUDA
            when the shapes fit its caps, else pytorch; the choice is logged once).
        zv: (b, t, 2, h, p), optional, given instead of ``v`` and ``z`` (both None): z and v
            packed in one tensor, z first, as one input projection forms them. Under the Triton
            backend their gradient comes back as one (b, t, 2, h, p) tensor, so the projection's
            backward takes it without concatenating two.

    Returns ``y`` (b, t, h, p) in v's dtype; with ``return_final_state`` also the final state
    (same 4-tuple, in the compute dtype; after a reset the ssm state is the last document's),
    so scanning [:t1] then [t1:] with the carried state equals scanning the whole. Computes in
    float64 for float64 ``v``, else accumulates in fp32.
    """
    if zv is not None:
        _check(
            v is None and z is None,
            "pass z and v either packed (zv) or apart (v, z), not both: got zv with "
            f"{'v' if v is not None else 'z'} as well",
        )
        _check(isinstance(zv, Tensor), f"zv must be a torch.Tensor, got {type(zv).__name__}")
        _check(
            zv.dim() == 5 and zv.shape[2] == 2,
            f"zv must be (b, t, 2, h, p): z and v packed, got {_shape(zv)}",
        )
        v, z = zv[:, :, 1], zv[:, :, 0]
    _, _, _, h, _, n, _ = validate(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, chunk_size, initial_state, reset
    )
    chosen = resolve_backend(backend, v.device)
    if chosen == "triton":
        reason = triton_shape_error(v, n, chunk_size)
        if reason is not None and backend == "triton":
            raise ValueError(reason)
        if reason is None:
            from .triton_siso import mamba3_siso_triton

            # reset only when given: a scan without resets calls the kernel exactly as before.
            extra = {} if reset is None else {"reset": reset}
            if zv is not None:
                v, z, extra["zv"] = None, None, zv
            return mamba3_siso_triton(
                q,
                k,
                v,
                adt,
                dt,
                trap,
                q_bias,
                k_bias,
                angles,
                d,
                z,
                chunk_size=chunk_size,
                initial_state=initial_state,
                return_final_state=return_final_state,
                **extra,
            )
        key = f"{v.device.type}:pytorch:{reason}"
        if key not in _auto_logged:
            _auto_logged.add(key)
            log.info("mamba3 scan backend auto -> pytorch for these inputs (%s)", reason)
    args, state = _prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, initial_state, h)
    y, final = siso_chunked(*args, state, chunk_size, reset)
    y = y.to(v.dtype)
    return (y, final) if return_final_state else y


def mamba3_siso_recurrent(
    q,
    k,
    v,
    adt,
    dt,
    trap,
    q_bias,
    k_bias,
    angles,
    d=None,
    z=None,
    *,
    initial_state: State | None = None,
    return_final_state: bool = False,
    reset: Tensor | None = None,
):
    """The token-by-token ground truth, same contract as :func:`mamba3_siso` (no chunking)."""
    _, _, _, h, _, _, _ = validate(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, 1, initial_state, reset
    )
    args, state = _prepare(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, initial_state, h)
    y, final = siso_recurrent(*args, state, reset)
    y = y.to(v.dtype)
    return (y, final) if return_final_state else y


def mamba3_siso_step(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, state):
    """One decoding step. Per-token shapes: q, k (b, g, n); v, z (b, h, p); adt, dt, trap (b, h);
    angles (b, h, s) or (b, 1, s). Returns (y (b, h, p) in v's dtype, new state in the compute
    dtype)."""
    h = v.shape[1]
    cdt = state[1].dtype
    if q.shape[1] != h:
        q, k = q.expand(-1, h, -1), k.expand(-1, h, -1)
    angles = angles.expand(-1, h, -1)
    args = [None if x is None else x.to(cdt) for x in (q, k, v, adt, dt, trap)]
    args += [None if x is None else x.to(cdt) for x in (q_bias, k_bias, angles, d, z)]
    y, new_state = siso_step(*args, state)
    return y.to(v.dtype), new_state
