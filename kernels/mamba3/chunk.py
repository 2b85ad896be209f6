"""Chunked reference of the Mamba-3 SISO scan: vectorised across chunks, differentiable by
autograd. The fast path on CPU and the fallback on GPU; the oracle for the Triton kernel.

It computes the SSD form of README.md: inside a chunk of ``L`` tokens a masked (L × L)
"attention" with per-token decay, between chunks a (p × n) state per head. The state carried
from chunk to chunk is the *augmented* state

    G_c = h_end + (1-λ_{end+1})·Δ_{end+1} · x_end k̄_endᵀ,

i.e. the true state plus the trapezoid half-term of the chunk's last token that the next token
would add. With it every token's weight is the single scalar ``w_s`` and the diagonal
correction keeps only ``λ_sΔ_s`` on the diagonal. For the last chunk Δ_{T+1}=0, so G = h_T.

Resets (document starts) are masks on segment ids, the count of resets up to each token — never
−inf or huge offsets in the cumulative decay: a pair (i, j) inside a chunk interacts only in one
segment; a token sees the state entering its chunk only before the chunk's first reset; the
state leaving a chunk keeps the entering one only when the chunk has no reset, and takes the
contributions of the chunk's last segment only. The pending half-term of a token followed by a
reset is in ``w_s`` but reaches nothing: the pairs and states that would carry it are masked.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .naive import TWO_PI, State, rotate_pairs


def siso_chunked(
    q: Tensor,  # (b, t, h, n)
    k: Tensor,  # (b, t, h, n)
    v: Tensor,  # (b, t, h, p)
    adt: Tensor,  # (b, h, t)
    dt: Tensor,  # (b, h, t)
    trap: Tensor,  # (b, h, t)
    q_bias: Tensor,  # (h, n)
    k_bias: Tensor,  # (h, n)
    angles: Tensor,  # (b, t, h, s)
    d: Tensor | None,  # (h,)
    z: Tensor | None,  # (b, t, h, p)
    initial_state: State | None,
    chunk_size: int,
    reset: Tensor | None = None,  # (b, t) bool
) -> tuple[Tensor, State]:
    b, t, h, n = k.shape
    p = v.shape[-1]
    L = chunk_size

    # Token-major layouts (b, t, h) for the per-token scalars.
    adt_t, dt_t = adt.transpose(1, 2), dt.transpose(1, 2)
    lam = torch.sigmoid(trap.transpose(1, 2))

    # Cumulative angle over the whole sequence, continuing from the carried angle state.
    phi0 = initial_state[0] if initial_state is not None else None
    dphi = dt_t[..., None] * math.pi * torch.tanh(angles)  # (b, t, h, s)
    phi = torch.cumsum(dphi, dim=1)
    if phi0 is not None:
        phi = phi + phi0[:, None]
    phi = torch.remainder(phi, TWO_PI)

    k_b, q_b = k + k_bias, q + q_bias
    k_bar, q_bar = rotate_pairs(k_b, phi), rotate_pairs(q_b, phi)

    # Trapezoid weights: w_s = λ_sΔ_s + (1-λ_{s+1})Δ_{s+1}, with Δ_{T+1} = 0. (The half-term
    # of a token followed by a reset needs no mask: no later token of its segment reads it.)
    cur = lam * dt_t  # (b, t, h)
    nxt = F.pad(((1.0 - lam) * dt_t)[:, 1:], (0, 0, 0, 1))  # (b, t, h)
    w = cur + nxt

    # Pad to whole chunks. Padded tokens have Δ = 0, x = 0 and no reset: they add nothing, decay
    # nothing and stay in the last segment.
    pad = (-t) % L
    no_reset = torch.zeros(b, t, dtype=torch.long, device=v.device)
    starts = no_reset if reset is None else reset.long()
    if pad:
        k_bar, q_bar, v_p = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (k_bar, q_bar, v))
        adt_p, w_p, cur_p = (F.pad(x, (0, 0, 0, pad)) for x in (adt_t, w, cur))
        starts = F.pad(starts, (0, pad))
    else:
        v_p, adt_p, w_p, cur_p = v, adt_t, w, cur
    nc = (t + pad) // L
    Kc = k_bar.reshape(b, nc, L, h, n)
    Qc = q_bar.reshape(b, nc, L, h, n)
    Xc = v_p.reshape(b, nc, L, h, p)
    Ac = adt_p.reshape(b, nc, L, h).permute(0, 1, 3, 2)  # (b, c, h, L)
    Wc = w_p.reshape(b, nc, L, h).permute(0, 1, 3, 2)
    Cc = cur_p.reshape(b, nc, L, h).permute(0, 1, 3, 2)
    A_cs = torch.cumsum(Ac, dim=-1)  # (b, c, h, L)
    # Segment of each token inside its chunk: resets in the chunk up to and including it.
    seg_id = torch.cumsum(starts.reshape(b, nc, L), dim=-1)[:, :, None]  # (b, c, 1, L)
    sees_entering = seg_id == 0  # no reset in the chunk yet: the entering state reaches it
    in_last_seg = seg_id == seg_id[..., -1:]  # reaches the state leaving the chunk

    # Intra-chunk: scores[i, j] = q̄_i·k̄_j · exp(A_i - A_j) · w_j for j ≤ i in one segment,
    # with λ_jΔ_j on the diagonal (the token's own trapezoid half-term is not in h_j yet).
    # Masked pairs are zeroed before exp as well as after, so no exp(+large) or exp(-inf).
    idx = torch.arange(L, device=v.device)
    causal = idx[:, None] >= idx[None, :]
    diag = idx[:, None] == idx[None, :]
    pairs = causal & (seg_id[..., :, None] == seg_id[..., None, :])  # (b, c, 1, L, L)
    seg = A_cs[..., :, None] - A_cs[..., None, :]  # (b, c, h, L, L)
    decay = torch.where(pairs, torch.exp(torch.where(pairs, seg, 0.0)), 0.0)
    weight = torch.where(diag, Cc[..., None, :], Wc[..., None, :])
    scores = torch.einsum("bclhn,bcshn->bchls", Qc, Kc) * decay * weight
    y = torch.einsum("bchls,bcshp->bclhp", scores, Xc)

    # Per-chunk contribution to the augmented state, from the chunk's last segment:
    # Σ_j exp(A_last - A_j)·w_j · x_j k̄_jᵀ.
    to_end = torch.where(in_last_seg, torch.exp(A_cs[..., -1:] - A_cs) * Wc, 0.0)  # (b,c,h,L)
    chunk_states = torch.einsum("bchl,bclhp,bclhn->bchpn", to_end, Xc, Kc)
    # The entering state survives the chunk only when no reset is in it.
    chunk_decay = torch.where(sees_entering[..., -1], torch.exp(A_cs[..., -1]), 0.0)  # (b,c,h)

    # Carry the augmented state across chunks (nc steps; cheap next to the intra-chunk work).
    if initial_state is None:
        G = torch.zeros(b, h, p, n, dtype=v.dtype, device=v.device)
    else:
        _, h0, k0, v0 = initial_state
        # The carried last token's trapezoid half-term, weighted by the first token's λ and Δ.
        G = h0 + ((1.0 - lam[:, 0]) * dt_t[:, 0])[..., None, None] * (
            v0[..., :, None] * k0[..., None, :]
        )
    entering = []
    for c in range(nc):
        entering.append(G)
        G = chunk_decay[:, c, :, None, None] * G + chunk_states[:, c]
    G_in = torch.stack(entering, dim=1)  # (b, c, h, p, n)

    # Inter-chunk: y_i += exp(A_i) · G_in q̄_i, for the tokens before the chunk's first reset.
    from_entering = torch.where(sees_entering, torch.exp(A_cs), 0.0)  # (b, c, h, L)
    y = y + torch.einsum("bclhn,bchpn,bchl->bclhp", Qc, G_in, from_entering)

    y = y.reshape(b, nc * L, h, p)[:, :t]
    if d is not None:
        y = y + d[:, None] * v
    if z is not None:
        y = y * F.silu(z)
    final = (phi[:, -1], G, k_bar[:, t - 1], v[:, t - 1])
    return y, final
