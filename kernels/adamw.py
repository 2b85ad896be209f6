"""AdamW's update as one Triton kernel a parameter group, with the gradient clip inside it.

torch.optim.AdamW(fused=True) updates the 434m model's 290 tensors in 50 launches of its
multi-tensor kernel, each a few hundred blocks over a list of tensors, at about 1.9 TB/s (6.4 ms
of a step on an H200); the clip before it multiplies every gradient in place, another read and
write of all of them (1.0 ms). Here one launch a group streams each parameter, its gradient and
both moments once: every program takes one BLOCK of one tensor, found through a table of the
tensors' addresses, so no launch ends in a partial wave of a short list.

The inputs a gradient scaler sets are honoured as torch's fused optimizer honours them:
``grad_scale`` (0-dim, on the device) divides every gradient, which is how the trainer clips
(runner/worker/update.py), and ``found_inf`` (0-dim, 1.0 or 0.0) skips the whole update in the
kernel, every tensor left as it was, the step counts included. The state is AdamW's own, in the
fused optimizer's layout (``step`` a float32 tensor on the parameter's device, ``exp_avg``,
``exp_avg_sq``), so a checkpoint moves between the two optimizers either way.

The arithmetic is fp32 and elementwise, in the order of torch's fused AdamW (decoupled decay,
then the moments, then the bias-corrected step); results agree with it to rounding, not bitwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels.mamba3.triton_common import TRITON_IMPORT_ERROR, tl, triton

BLOCK = 4096  # elements a program: 16 a thread at 8 warps, four 16-byte loads per stream
NUM_WARPS = 8
ROW = 8  # int64s a tensor's table row: addresses of p, g, exp_avg, exp_avg_sq, step; numel

if triton is not None:
    _ROW = tl.constexpr(ROW)

    @triton.jit
    def _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, inv_scale, lr_wd, beta1, beta2,
                    step_size, bc2_sqrt, eps):  # fmt: skip
        b_p = tl.load(p_ptr + offs, mask=mask)
        b_g = tl.load(g_ptr + offs, mask=mask) * inv_scale
        b_m = tl.load(m_ptr + offs, mask=mask)
        b_v = tl.load(v_ptr + offs, mask=mask)
        b_p = b_p - lr_wd * b_p
        b_m = beta1 * b_m + (1.0 - beta1) * b_g
        b_v = beta2 * b_v + (1.0 - beta2) * b_g * b_g
        b_p = b_p - step_size * b_m / (tl.sqrt(b_v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, b_p, mask=mask)
        tl.store(m_ptr + offs, b_m, mask=mask)
        tl.store(v_ptr + offs, b_v, mask=mask)

    @triton.jit
    def adamw_kernel(table, tiles, grad_scale, found_inf, lr, lr_wd, beta1, beta2, log2_beta1,
                     log2_beta2, eps, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                     ALIGN: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Program i updates block ``tiles[i, 1]`` of tensor ``tiles[i, 0]``. Every address in
        the table is a multiple of ALIGN bytes (16 where the host found them so), which lets
        the full blocks load and store 16 bytes at a time; a tensor's last block is masked."""
        pid = tl.program_id(0)
        i = tl.load(tiles + 2 * pid).to(tl.int64)
        start = tl.load(tiles + 2 * pid + 1).to(tl.int64) * BLOCK
        row = table + _ROW * i
        n = tl.load(row + 5) - start
        if HAS_INF:  # a skipped step: no element in range
            n = tl.where(tl.load(found_inf) == 0.0, n, 0)
        f32 = tl.pointer_type(tl.float32)
        p_ptr = tl.multiple_of(tl.load(row).to(f32), ALIGN) + start
        g_ptr = tl.multiple_of(tl.load(row + 1).to(f32), ALIGN) + start
        m_ptr = tl.multiple_of(tl.load(row + 2).to(f32), ALIGN) + start
        v_ptr = tl.multiple_of(tl.load(row + 3).to(f32), ALIGN) + start
        step = tl.load(tl.load(row + 4).to(f32))
        step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        inv_scale = 1.0
        if HAS_SCALE:
            inv_scale = 1.0 / tl.load(grad_scale)
        offs = tl.arange(0, BLOCK)
        if n >= BLOCK:
            _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, inv_scale, lr_wd, beta1, beta2,
                        step_size, bc2_sqrt, eps)  # fmt: skip
        else:
            _adamw_tile(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, inv_scale, lr_wd, beta1,
                        beta2, step_size, bc2_sqrt, eps)  # fmt: skip


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step is :func:`adamw_kernel`, one launch a parameter group, for
    float32 parameters on a device Triton runs on (or on the CPU under the Triton interpreter).
    Constructed as torch's fused AdamW (``fused=True`` in its defaults), with its state layout,
    state_dict and ``grad_scale`` / ``found_inf`` inputs; amsgrad, maximize and sparse
    gradients, which the kernel does not take, are refused."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):  # fmt: skip
        if TRITON_IMPORT_ERROR is not None:
            raise RuntimeError(f"TritonAdamW needs Triton: {TRITON_IMPORT_ERROR}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         fused=True)  # fmt: skip
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"TritonAdamW updates float32 parameters, got one of {p.dtype} "
                        f"{tuple(p.shape)}; use torch.optim.AdamW for other dtypes"
                    )
        self._tiles: dict[int, tuple[tuple, Tensor]] = {}  # group → (numels and BLOCK, map)
        self._tables: dict[int, tuple[tuple, Tensor, int]] = {}  # → (addresses, table, align)

    def _group_state(self, group: dict) -> list[tuple[Tensor, Tensor, dict]]:
        """(param, grad, state) for every parameter of ``group`` with a gradient; the state
        created as torch's fused AdamW creates it, at the first step."""
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("TritonAdamW does not take sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append((p, p.grad, state))
        return out

    def _tile_map(self, gi: int, numels: tuple[int, ...], block: int, device) -> Tensor:
        """(tensor index, block index) of every program, int32; rebuilt when the sizes change."""
        cached = self._tiles.get(gi)
        if cached is None or cached[0] != (numels, block):
            counts = torch.tensor([triton.cdiv(n, block) for n in numels])
            which = torch.repeat_interleave(torch.arange(len(numels)), counts)
            first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            blocks = torch.arange(len(which)) - first
            tiles = torch.stack([which, blocks], dim=1).to(torch.int32)
            cached = (numels, block), _to_device(tiles, device)
            self._tiles[gi] = cached
        return cached[1]

    def _table(self, gi: int, entries: list[tuple[Tensor, Tensor, dict]], device):
        """The group's address table and its alignment; uploaded again only when an address
        moved (gradients are new tensors every step, but the allocator mostly hands back the
        same blocks)."""
        addrs = tuple(
            (p.data_ptr(), g.data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(),
             s["step"].data_ptr(), p.numel())
            for p, g, s in entries
        )  # fmt: skip
        cached = self._tables.get(gi)
        if cached is None or cached[0] != addrs:
            align = 16 if all(a % 16 == 0 for row in addrs for a in row[:4]) else 4
            rows = [[*row, 0, 0] for row in addrs]
            cached = addrs, _to_device(torch.tensor(rows, dtype=torch.int64), device), align
            self._tables[gi] = cached
        return cached[1], cached[2]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for gi, group in enumerate(self.param_groups):
            if group["amsgrad"] or group["maximize"]:
                raise RuntimeError("TritonAdamW does not implement amsgrad or maximize")
            entries = self._group_state(group)
            if not entries:
                continue
            for p, g, _ in entries:
                if g.dtype != torch.float32 or not (g.is_contiguous() and p.is_contiguous()):
                    raise RuntimeError(
                        f"TritonAdamW takes contiguous float32 parameters and gradients, got "
                        f"{tuple(p.shape)} with a {g.dtype} gradient"
                    )
            device = entries[0][0].device
            steps = [s["step"] for _, _, s in entries]
            # The step counts move by one unless the update is skipped (as torch's fused
            # AdamW's add and take back); the kernel reads them after.
            if found_inf is None:
                torch._foreach_add_(steps, 1.0)
            else:
                torch._foreach_add_(steps, 1.0 - found_inf.to(device))
            block = BLOCK
            tiles = self._tile_map(gi, tuple(p.numel() for p, _, _ in entries), block, device)
            table, align = self._table(gi, entries, device)
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            dummy = steps[0]
            adamw_kernel[(tiles.shape[0],)](
                table, tiles,
                dummy if grad_scale is None else grad_scale.to(device),
                dummy if found_inf is None else found_inf.to(device),
                lr, lr * group["weight_decay"], beta1, beta2, math.log2(beta1), math.log2(beta2),
                group["eps"],
                HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, ALIGN=align,
                BLOCK=block, num_warps=NUM_WARPS,
            )  # fmt: skip
        return loss


def _to_device(t: Tensor, device) -> Tensor:
    """A small host table onto ``device`` without waiting for the GPU: a copy from pageable
    memory would first synchronise the stream, and the host queues the update well ahead of it."""
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
