"""The anchor of `bench_train.py --anchor`: a language model of the same size as Mamba3LM whose
mixer is the official Mamba-3 module (`mamba_ssm.modules.mamba3.Mamba3`, SISO, with its own
Triton kernels), trained in the benchmark's process the way the worker trains ours.

Only the mixer differs in structure. Around it the LM is a fixed plain-PyTorch copy of our block
structure (`x += mixer(rmsnorm(x)); x += swiglu(rmsnorm(x))`, fp32 RMSNorm, fused gate/up
SwiGLU, a final RMSNorm, the embedding padded to a multiple of 64 and tied to the LM head), with
our init, our chunked linear cross-entropy and our AdamW groups; where ours runs its own kernels
beside the scan (the SwiGLU operator, the loss's cross-entropy kernel), the anchor runs the
PyTorch forms. The step is the worker's: micro-batches under bf16 autocast, accumulation,
gradient clipping, one host sync, fused AdamW, the same torch.compile mode and the same data
loader.

The official module is never a dependency of m3run: it is imported here only, from a
mamba_ssm source tree put on PYTHONPATH (`PYTHONPATH=<dir holding mamba_ssm/>`). Only its
Mamba-3 module and the Triton files that module imports are loaded.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from step_probes import sync, timed_steps
from torch import Tensor, nn

from m3run.model import ModelConfig
from m3run.model.loss import linear_cross_entropy

# Python packages the official Mamba-3 module imports beyond torch.
OFFICIAL_NEEDS = ("triton", "einops")
# Modules that mamba3.py tries to import for MIMO (TileLang) and the decode step (CUTLASS DSL).
# A SISO training step uses neither; marking them absent keeps an installed TileLang or CUTLASS
# from compiling anything at import, and mamba3.py already treats them as optional.
_SKIPPED = ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba_ssm.ops.cute.mamba3.mamba3_step_fn")


class AnchorUnavailable(RuntimeError):
    """The official module cannot be imported here; the message names why and the fix."""


def import_official_mamba3() -> type[nn.Module]:
    """`mamba_ssm.modules.mamba3.Mamba3` from the source tree on the path, without running the
    package's `__init__` (it loads mamba_ssm's compiled CUDA extensions, which a source tree
    does not have). Raises AnchorUnavailable naming what is missing."""
    loaded = sys.modules.get("mamba_ssm.modules.mamba3")
    if loaded is not None:
        return loaded.Mamba3  # a second micro-batch of the same benchmark
    try:
        spec = importlib.util.find_spec("mamba_ssm")
    except ValueError:  # the bare package of an earlier attempt in this process
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise AnchorUnavailable(
            "the official Mamba-3 module is not importable: no mamba_ssm on the path. Fix: put "
            "the directory holding a mamba_ssm/ source tree (github.com/state-spaces/mamba) on "
            "PYTHONPATH, e.g. PYTHONPATH=.:<dir holding mamba_ssm/>"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    missing = [name for name in OFFICIAL_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise AnchorUnavailable(
            f"the official Mamba-3 module at {root} imports {', '.join(missing)}, not installed "
            f"in {sys.executable}. Fix: install {' and '.join(missing)} (or carry the wheels)"
        )
    for name, sub in (
        ("mamba_ssm", "."),
        ("mamba_ssm.modules", "modules"),
        ("mamba_ssm.ops", "ops"),
        ("mamba_ssm.ops.triton", "ops/triton"),
        ("mamba_ssm.ops.triton.mamba3", "ops/triton/mamba3"),
    ):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / sub)]
            sys.modules[name] = mod
    for name in _SKIPPED:
        sys.modules.setdefault(name, None)
    try:
        from mamba_ssm.modules.mamba3 import Mamba3
    except ImportError as e:
        raise AnchorUnavailable(
            f"importing mamba_ssm.modules.mamba3 from {root} failed: {e}. Fix: a mamba_ssm "
            "source tree with modules/mamba3.py and ops/triton/mamba3/, and its imports installed"
        ) from e
    return Mamba3


def official_mixer_kwargs(cfg: ModelConfig) -> dict:
    """Our model config as the official constructor's arguments: SISO, no output norm (our
    mixer has none; the gate is silu(z) inside the scan in both)."""
    if cfg.rope_fraction not in (0.5, 1.0):
        raise ValueError(
            f"the official Mamba-3 module takes rope_fraction 0.5 or 1.0, got {cfg.rope_fraction}"
        )
    return dict(
        d_model=cfg.d_model,
        d_state=cfg.d_state,
        expand=cfg.expand,
        headdim=cfg.headdim,
        ngroups=cfg.ngroups,
        rope_fraction=cfg.rope_fraction,
        dt_min=cfg.dt_min,
        dt_max=cfg.dt_max,
        dt_init_floor=cfg.dt_init_floor,
        A_floor=cfg.A_floor,
        chunk_size=cfg.chunk_size,
        is_mimo=False,
        is_outproj_norm=False,
    )


def official_mixer_factory(cfg: ModelConfig) -> Callable[[int], nn.Module]:
    """layer index -> an official Mamba3 mixer for `cfg` (AnchorUnavailable if not importable)."""
    mamba3 = import_official_mamba3()
    kwargs = official_mixer_kwargs(cfg)
    return lambda layer_idx: mamba3(**kwargs, layer_idx=layer_idx)


class RMSNorm(nn.Module):
    """Weight-only RMSNorm in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.d_hidden = d_hidden
        self.gate_up = nn.Linear(d_model, 2 * d_hidden, bias=False)  # order: [gate, up]
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.d_hidden, dim=-1)
        return self.down(F.silu(gate) * up)


class AnchorBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_intermediate)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class AnchorLM(nn.Module):
    """Mamba3LM's structure and init around mixers from `make_mixer(layer_idx)`, which must
    have `in_proj` and `out_proj` linears (both the official module and ours do)."""

    def __init__(self, cfg: ModelConfig, make_mixer: Callable[[int], nn.Module]):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(AnchorBlock(cfg, make_mixer(i)) for i in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Our init for everything but the mixer's own per-head parameters (dt_bias, D, B/C
        # biases and norms), which both modules initialise by the same rule.
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embedding.weight, std=std)
        for block in self.layers:
            nn.init.normal_(block.mixer.in_proj.weight, std=std)
            nn.init.normal_(block.mixer.out_proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.gate_up.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.embedding(idx)
        for block in self.layers:
            x = block(x)
        h = self.norm_f(x)
        return linear_cross_entropy(h, self.embedding.weight[: self.config.vocab_size], targets)


def bench_anchor(
    cfg,
    make_mixer: Callable[[int], nn.Module],
    device: torch.device,
    steps: int,
    warmup: int,
    peak: float | None,
    impl: str = "official",
) -> dict:
    """Train AnchorLM with `cfg`'s train and data settings the way Trainer.train_step does;
    the first step (compilation, the official kernels' autotuning) is timed on its own, then
    `warmup - 1` more steps, then `steps` timed steps. `impl` names the result's mixer."""
    from m3run.runner.data.mixture import train_loader
    from m3run.runner.worker.build import autocast, build_optimizer, resolve_precision

    t = cfg.train
    torch.manual_seed(t.seed)
    model = AnchorLM(cfg.model, make_mixer).to(device)
    n_params = model.num_params()
    optimizer = build_optimizer(model, device, t, lr=t.lr, eps=t.eps)
    loader = train_loader(
        cfg.data.train_path,
        cfg.data.sources,
        cfg.data.seq_len,
        t.micro_batch_size,
        t.seed,
        rank=0,
        world_size=1,
        prefetch=cfg.data.prefetch,
        pin_memory=device.type == "cuda",
        force=False,
    )
    step_model = model
    if t.compile:
        step_model = torch.compile(model, mode=t.compile_mode)
    amp_dtype = resolve_precision(cfg, device)
    accum = t.grad_accum_steps
    waited = [0.0]

    def train_step() -> float:
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            t0 = time.perf_counter()
            x, y = loader.next_batch()
            waited[0] += time.perf_counter() - t0
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, amp_dtype):
                loss = step_model(x, y)
                (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        mean_loss, _ = torch.stack([loss_sum.float() / accum, grad_norm.float()]).tolist()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mean_loss

    try:
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        first_loss = train_step()
        sync(device)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(max(0, warmup - 1)):
            train_step()
        sync(device)
        warm_s = time.perf_counter() - t0
        waited[0] = 0.0
        timed = timed_steps(train_step, steps, device)
        last_loss, dt = timed.pop("last"), timed.pop("step_s")
    finally:
        loader.close()
    tokens = t.micro_batch_size * accum * cfg.data.seq_len
    tps = tokens / dt
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    result = {
        "impl": impl,
        "micro_batch": t.micro_batch_size,
        "grad_accum": accum,
        "seq_len": cfg.data.seq_len,
        "compile": t.compile,
        "params": n_params,
        "step_s": dt,
        "tokens_per_s": tps,
        "mfu": 6 * n_params * tps / peak if peak else None,
        "peak_mem_gib": peak_mem,
        "first_step_s": first_s,
        "warmup_s": warm_s,
        "data_wait_ms_per_step": waited[0] / steps * 1e3,
        "first_loss": first_loss,
        "last_loss": last_loss,
        **timed,
    }
    return result
