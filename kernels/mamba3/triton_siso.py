"""The Triton Mamba-3 SISO scan as two custom operators with an autograd formula, and its public
entry point.

The kernels live in :mod:`m3run.kernels.mamba3.triton_fwd` and
:mod:`m3run.kernels.mamba3.triton_bwd`; the chunk they use and their launch configurations come
from :func:`m3run.kernels.mamba3.plans.plan_for` (this machine's tuned plans, else a checked-in
table per GPU architecture and shape). What stays in PyTorch here: folding a carried
``initial_state`` into the augmented start state (autograd takes it back to its four parts) and
the final ``k_state`` / ``v_state``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import State, rotate_pairs
from .plans import plan_for
from .triton_bwd import siso_bwd
from .triton_common import TRITON_IMPORT_ERROR, Tiles, shape_error
from .triton_fwd import siso_fwd


def segment_ids(reset: Tensor, chunk: int) -> Tensor:
    """The kernels' view of ``reset`` (b, t) bool: per token, the count of resets in its chunk
    of ``chunk`` tokens up to and including it, (b, nc·chunk) int32, zero-padded to whole chunks.
    A kernel reads a chunk's masks from one load of these (triton_common.segments)."""
    b, t = reset.shape
    nc = -(-t // chunk)
    if nc * chunk != t:
        reset = F.pad(reset, (0, nc * chunk - t))
    # One kernel where t is whole chunks (eager: the zero-filled copy took three more launches,
    # host time every call pays).
    return reset.reshape(b, nc, chunk).cumsum(2, dtype=torch.int32).view(b, nc * chunk)


# The scan as two custom operators, forward and backward, with the autograd formula registered
# on the forward. torch.compile keeps them opaque: inductor calls them as they are, so the kernels
# run under the launch table's configurations (inductor recompiles a user Triton kernel it traces
# with its warps and stages only, dropping the register cap the plans give the backward's two
# big kernels, which then run slower) and no functionalisation copy is made around them.


# Recording (kernels/mamba3/tools/precompile.py): while a thread records for a device, meta
# tensors that reach the operators' fake implementations run the real bodies instead, under that
# device's launch plan, so every launch a call would make is handed to the thread's recorder
# (launching.set_recorder) with the arguments it would have. Other threads, and fake tensors
# under torch.compile, see the fake implementations as they are.
_recording = threading.local()


@contextmanager
def recording_for(device: torch.device) -> Iterator[None]:
    """Within this block, this thread's calls on meta tensors run the kernels' launchers under
    ``device``'s launch plan (set a recorder too, or the launches fail on meta tensors)."""
    _recording.device = device
    try:
        yield
    finally:
        _recording.device = None


def _recording_device() -> torch.device | None:
    return getattr(_recording, "device", None)


def _plan_device(v: Tensor) -> torch.device:
    """The device whose launch plan applies to a call on ``v``."""
    return _recording_device() or v.device


def _unpack(v: Tensor, z: Tensor | None, packed: bool) -> tuple[Tensor, Tensor | None]:
    """v and z of the operators' arguments: with ``packed``, ``v`` holds both, (b, t, 2, h, p),
    z first (its gradient comes back packed the same way)."""
    return (v[:, :, 1], v[:, :, 0]) if packed else (v, z)


@torch.library.custom_op("m3run::siso_fwd", mutates_args=())
def siso_fwd_op(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, adt: Tensor, dt: Tensor,
                trap: Tensor, q_bias: Tensor, k_bias: Tensor, angles: Tensor, d: Tensor | None,
                phi0: Tensor | None, g0: Tensor | None, seg: Tensor | None, chunk_size: int,
                save: bool,
                packed: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """y, Φ_T, G_T and (``save``; else empty) the per-chunk entering state and angle."""
    return _siso_fwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg,
                     chunk_size, save, packed)


def _siso_fwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg, chunk_size,
              save, packed):
    v, z = _unpack(v, z, packed)
    plan = plan_for(_plan_device(v), v.shape[3], q.shape[3], chunk_size, v.dtype)
    y, phi_t, g_t, g_in, phi_in = siso_fwd(
        q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg, plan.chunk,
        save, plan.configs["fwd"],
    )
    if not save:
        g_in, phi_in = v.new_empty(0), phi_t.new_empty(0)
    return y, phi_t, g_t, g_in, phi_in


@siso_fwd_op.register_fake
def _(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg, chunk_size, save,
      packed):
    if _recording_device() is not None:
        return _siso_fwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0, seg,
                         chunk_size, save, packed)
    v, z = _unpack(v, z, packed)
    b, t, h, p = v.shape
    n, s = q.shape[3], angles.shape[3]
    tiles = Tiles.of(p, n, plan_for(v.device, p, n, chunk_size, v.dtype).chunk)
    nc = -(-t // tiles.BT)
    f32 = dict(dtype=torch.float32, device=v.device)
    y = v.new_empty(b, t, h, p)
    phi_t, g_t = torch.empty(b, h, s, **f32), torch.empty(b, h, p, n, **f32)
    if not save:
        return y, phi_t, g_t, v.new_empty(0), phi_t.new_empty(0)
    return (y, phi_t, g_t, v.new_empty(b * h, nc, tiles.BP, tiles.BN),
            torch.empty(b * h, nc, tiles.rot_pairs(s), **f32))


@torch.library.custom_op("m3run::siso_bwd", mutates_args=())
def siso_bwd_op(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, adt: Tensor, dt: Tensor,
                trap: Tensor, q_bias: Tensor, k_bias: Tensor, angles: Tensor, d: Tensor | None,
                seg: Tensor | None, g_in: Tensor, phi_in: Tensor, dy: Tensor,
                dg_t: Tensor | None, dphi_t: Tensor | None, chunk_size: int,
                packed: bool) -> list[Tensor]:
    """The gradient of every input of :func:`siso_fwd_op` (dz, dd empty without z, d; with
    ``packed``, the packed gradient of z and v in dv's place and dz empty)."""
    return _siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in,
                     dy, dg_t, dphi_t, chunk_size, packed)


def _siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in, dy,
              dg_t, dphi_t, chunk_size, packed):
    dzv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if packed else None
    v, z = _unpack(v, z, packed)
    plan = plan_for(_plan_device(v), v.shape[3], q.shape[3], chunk_size, v.dtype)
    grads = list(siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in,
                          phi_in, dy, dg_t, dphi_t, plan.chunk, plan.configs, dzv))
    if packed:
        grads[2:4] = [dzv, None]
    return [g if g is not None else v.new_empty(0) for g in grads]


@siso_bwd_op.register_fake
def _(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in, dy, dg_t, dphi_t,
      chunk_size, packed):
    if _recording_device() is not None:
        return _siso_bwd(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in,
                         dy, dg_t, dphi_t, chunk_size, packed)
    dv = v.new_empty(v.shape)
    v, z = _unpack(v, z, packed)
    b, t, g, n = q.shape
    h, p, s = v.shape[2], v.shape[3], angles.shape[3]
    f32 = dict(dtype=torch.float32, device=v.device)
    return [
        v.new_empty(b, t, g, n),
        v.new_empty(b, t, g, n),
        dv,
        z.new_empty(b, t, h, p) if z is not None and not packed else v.new_empty(0),
        *(torch.empty(b, h, t, **f32) for _ in range(3)),
        torch.empty(h, n, **f32),
        torch.empty(h, n, **f32),
        torch.empty(angles.shape, **f32),
        torch.empty(h, **f32) if d is not None else v.new_empty(0),
        torch.empty(b, h, s, **f32),
        torch.empty(b, h, p, n, **f32),
    ]


def _setup_context(ctx, inputs, output):
    (q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, _phi0, g0, seg, chunk_size,
     _save, packed) = inputs
    _, _, _, g_in, phi_in = output
    ctx.save_for_backward(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g0, seg, g_in,
                          phi_in)
    ctx.chunk_size = chunk_size
    ctx.packed = packed
    # The saved per-chunk states and angles are outputs only so that they can be saved: no
    # gradient flows into them, and an output's missing gradient arrives as None, not as a
    # tensor of zeros (for the states, a 268 MB fill per call at the benchmark's shape).
    ctx.mark_non_differentiable(g_in, phi_in)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dphi_t, dg_t, _dg_in, _dphi_in):
    (q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, g0, seg, g_in,
     phi_in) = ctx.saved_tensors
    dy = torch.zeros_like(_unpack(v, z, ctx.packed)[0]) if dy is None else dy.contiguous()
    # A final angle or state without a gradient (training: neither is used) stays None: the
    # kernels read no zeros for it.
    if dphi_t is not None:
        dphi_t = dphi_t.float().contiguous()
    if dg_t is not None:
        dg_t = dg_t.float().contiguous()
    (dq, dk, dv, dz, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dd, dphi0,
     dg0) = siso_bwd_op(q, k, v, z, adt, dt, trap, q_bias, k_bias, angles, d, seg, g_in, phi_in,
                        dy, dg_t, dphi_t, ctx.chunk_size, ctx.packed)
    return (
        dq.to(q.dtype), dk.to(k.dtype), dv, None if z is None else dz, dadt, ddt, dtrap,
        dq_bias.to(q_bias.dtype), dk_bias.to(k_bias.dtype), dangles,
        None if d is None else dd.to(d.dtype),
        dphi0 if ctx.needs_input_grad[11] else None,
        dg0 if g0 is not None else None,
        None,
        None,
        None,
        None,
    )


siso_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def mamba3_siso_triton(
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
    zv: Tensor | None = None,
) -> Tensor | tuple[Tensor, State]:
    """The Mamba-3 SISO scan through Triton; same contract as ``mamba3_siso``.

    Shapes: q, k (b, t, g, n) with g = 1 or h; v, z (b, t, h, p) in bf16, fp16 or fp32 (q, k, z
    are cast to v's dtype), or instead of them ``zv`` (b, t, 2, h, p), z and v packed (z first),
    whose gradient comes back packed in one tensor; adt, dt, trap (b, h, t) and q_bias, k_bias
    (h, n), angles (b, t, h, s) or (b, t, 1, s) (one set for every head) in fp32; d (h,); reset
    (b, t) bool (no state crosses a token marked True: the kernels mask every decay across it).
    Dots run in v's dtype with fp32 accumulation; the state, decays and angles are fp32.
    Differentiable in every input, the initial state included. Callers go through
    :func:`m3run.kernels.mamba3.api.mamba3_siso`, which validates the shapes.
    """
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(TRITON_IMPORT_ERROR)
    b, t, _, n = k.shape
    packed = zv is not None
    if packed:
        zv = zv if zv.stride(-1) == 1 else zv.contiguous()
        v, z = _unpack(zv, None, packed)[0], None
    h = v.shape[2]
    reason = shape_error(v, n, chunk_size)
    if reason is not None:
        raise ValueError(reason)
    if v.stride(-1) != 1:
        v = v.contiguous()
    if z is not None:
        z = z.to(v.dtype)
        if z.stride(-1) != 1:
            z = z.contiguous()
    q, k = q.to(v.dtype).contiguous(), k.to(v.dtype).contiguous()
    adt, dt, trap = (x.float().contiguous() for x in (adt, dt, trap))
    q_bias, k_bias = q_bias.float().contiguous(), k_bias.float().contiguous()
    angles = angles.float()
    phi0 = g0 = None
    if initial_state is not None:
        phi0, h0, k0, v0 = (x.float() for x in initial_state)
        phi0 = phi0.contiguous()
        # Augmented start state: the carried last token's trapezoid half-term, weighted by the
        # first token's (1−λ)Δ (as in chunk.py); autograd takes it back to h0, k0, v0, dt, trap.
        c0 = (1.0 - torch.sigmoid(trap[..., 0])) * dt[..., 0]
        g0 = (h0 + c0[..., None, None] * (v0[..., :, None] * k0[..., None, :])).contiguous()
    seg = None
    if reset is not None:
        seg = segment_ids(reset, plan_for(_plan_device(v), v.shape[3], n, chunk_size,
                                          v.dtype).chunk)
    inputs = (q, k, zv if packed else v, z, adt, dt, trap, q_bias, k_bias, angles, d, phi0, g0)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    y, phi_t, g_t, _, _ = siso_fwd_op(*inputs, seg, chunk_size, save, packed)
    if not return_final_state:
        return y
    k_last = k[:, t - 1].float().expand(b, h, n) + k_bias
    final = (phi_t, g_t, rotate_pairs(k_last, phi_t), v[:, t - 1].float())
    return y, final
