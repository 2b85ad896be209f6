"""The Triton AdamW (kernels/adamw.py) against torch.optim.AdamW, on any device: run by
test_triton_cpu.py in the Triton interpreter (TRITON_INTERPRET=1, set before Triton loads) on
the CPU, and imported by test_adamw_cuda.py on a GPU. Prints "ok" at the end.

Over four steps of two parameter groups (decay and none), with tensors that end inside a
program's block, span several, and a gradient that is a view at an odd offset (the kernel's
4-byte-aligned variant): weights and moments within fp32 rounding of torch's AdamW; a step with
``grad_scale`` as torch's AdamW after the gradients are divided by it; a step with ``found_inf``
set leaves every tensor bitwise as it was, step counts included; the state_dict loads into
torch's fused AdamW and back."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import adamw


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
    assert err < 2e-6, f"{what}: relative difference {err:.2e}"


def check(device: str) -> None:
    torch.manual_seed(0)
    block = adamw.BLOCK
    shapes = [(3, 5000), (7,), (block,), (2, block + 3), (64, 64)]
    start = [torch.randn(s, device=device) for s in shapes]

    def groups(ps):
        return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}]

    ref = [p.clone().requires_grad_() for p in start]
    ours = [p.clone().requires_grad_() for p in start]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    o_ref = torch.optim.AdamW(groups(ref), **kw)
    o_our = adamw.TritonAdamW(groups(ours), **kw)
    for step in range(4):
        grads = [torch.randn(s, device=device) for s in shapes]
        for a, b, g in zip(ref, ours, grads, strict=True):
            a.grad = g.clone()
            b.grad = g.clone()
        # A gradient 4 bytes into a larger buffer: the table's addresses then are not all
        # 16-byte aligned, and the kernel runs without wide loads.
        odd = torch.empty(ours[1].numel() + 1, device=device)[1:]
        odd.copy_(grads[1])
        ours[1].grad = odd
        o_our.grad_scale = o_our.found_inf = None
        if step == 1:  # the trainer's clip: every gradient divided by the scale
            scale = torch.tensor(3.0, device=device)
            for a in ref:
                a.grad.div_(scale)
            o_our.grad_scale = scale
        if step == 2:  # a skipped step, then the real one
            o_our.found_inf = torch.tensor(1.0, device=device)
            before = [t.clone() for t in ours]
            before += [v.clone() for s in o_our.state.values() for v in s.values()]
            o_our.step()
            after = list(ours) + [v for s in o_our.state.values() for v in s.values()]
            assert all(map(torch.equal, before, after)), "a found_inf step changed a tensor"
            o_our.found_inf = torch.tensor(0.0, device=device)
        o_ref.step()
        o_our.step()
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            close(a.detach(), b.detach(), f"step {step}, parameter {i}")
    sr, so = o_ref.state_dict(), o_our.state_dict()
    for i in sr["state"]:
        assert so["state"][i]["step"].item() == sr["state"][i]["step"].item() == 4.0
        for name in ("exp_avg", "exp_avg_sq"):
            close(so["state"][i][name], sr["state"][i][name], f"{name} of parameter {i}")
    assert [g["weight_decay"] for g in so["param_groups"]] == [0.1, 0.0]

    # The state moves to torch's fused AdamW and back: same keys, same tensors.
    fused = torch.optim.AdamW(groups([p.detach().clone().requires_grad_() for p in ours]),
                              fused=True, **kw)  # fmt: skip
    fused.load_state_dict(so)
    back = adamw.TritonAdamW(groups([p.detach().clone().requires_grad_() for p in ours]), **kw)
    back.load_state_dict(fused.state_dict())
    for i, s in so["state"].items():
        for name, v in s.items():
            got = back.state_dict()["state"][i][name]
            assert torch.equal(got, v) and got.device == v.device, (i, name)


if __name__ == "__main__":
    check("cpu")
    print("ok")
