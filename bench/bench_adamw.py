"""GPU speed of the optimizer update alone, on the parameters of a model preset: the gradient clip
and AdamW as the trainer ran them (``clip_grad_norm_``, then torch's fused AdamW), torch's fused
AdamW with the clip as its ``grad_scale``, and the Triton AdamW (kernels/adamw.py) with the same,
at each BLOCK and warp count asked for; one process, the same parameters and gradients.

    PYTHONPATH=. python bench/bench_adamw.py [--preset 434m] [--blocks 2048 4096 8192] [--warps 4 8]

Prints per variant the mean time of one clip + update (20 after 3 warm-ups, CUDA events), the
bandwidth of the update's minimum traffic (each fp32 parameter, gradient and both moments read,
the three written: 28 bytes a parameter, plus the norm's read of the gradients), and the largest
relative difference of the weights and moments from torch's fused AdamW after the same steps.
"""

from __future__ import annotations

import argparse

import torch

from kernels import adamw
from model import Mamba3LM
from model.config import PRESETS, ModelConfig
from model.lm import param_groups


def make_params(preset: str) -> list[dict]:
    """The preset's parameter shapes, as two AdamW groups of fresh CUDA tensors with gradients."""
    with torch.device("meta"):
        model = Mamba3LM(ModelConfig.preset(preset))
    gen = torch.Generator(device="cuda").manual_seed(0)
    groups = []
    for group in param_groups(model, 0.1):
        params = []
        for p in group["params"]:
            q = torch.randn(p.shape, device="cuda", generator=gen) * 0.02
            q.requires_grad_()
            params.append(q)
        groups.append({"params": params, "weight_decay": group["weight_decay"]})
    return groups


def fresh_grads(groups: list[dict], seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for group in groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3


def variant(name: str, groups: list[dict], block: int = 0, warps: int = 0):
    """(optimizer, one clip + update) for variant ``name``."""
    kw = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    params = [p for g in groups for p in g["params"]]
    if name == "triton":
        adamw.BLOCK, adamw.NUM_WARPS = block, warps
        opt = adamw.TritonAdamW(groups, **kw)
    else:
        opt = torch.optim.AdamW(groups, fused=True, **kw)

    def step():
        grads = [p.grad for p in params]
        if name == "fused, clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
            opt.grad_scale = ((norm + 1e-6) / 1.0).clamp(min=1.0)
            opt.found_inf = (~norm.isfinite()).float()
        opt.step()

    return opt, step


def run(name: str, preset: str, block: int = 0, warps: int = 0, reps: int = 20):
    groups = make_params(preset)
    n = sum(p.numel() for g in groups for p in g["params"])
    opt, step = variant(name, groups, block, warps)
    fresh_grads(groups, 1)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / reps
    gbs = n * (28 + 4) / ms / 1e6
    return ms, gbs, opt, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="434m", choices=sorted(PRESETS))
    ap.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_adamw.py needs a CUDA GPU (the kernel is Triton)")
    runs = [("fused, clip_grad_norm_", 0, 0), ("fused, grad_scale", 0, 0)]
    runs += [("triton", b, w) for b in a.blocks for w in a.warps]
    ref = None
    for name, block, warps in runs:
        ms, gbs, opt, groups = run(name, a.preset, block, warps)
        state = [p for g in groups for p in g["params"]]
        state += [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        diff = ""
        if name == "fused, grad_scale":
            ref = state
        elif ref is not None:
            worst = max(
                ((x - y).abs().max() / y.abs().max()).item()
                for x, y in zip(state, ref, strict=True)
            )
            diff = f" | max rel. diff from fused {worst:.1e}"
        label = name if name != "triton" else f"triton BLOCK {block} warps {warps}"
        print(f"{label:28s} {ms:7.3f} ms | {gbs:6.0f} GB/s{diff}", flush=True)
        del opt, groups, state
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
