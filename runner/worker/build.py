"""What a worker builds a run from, one copy for the trainer and the smoke test: the frozen
config, the device, the precision, the scan backend, the model and the optimizer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from m3run.kernels.mamba3 import BackendUnavailableError, resolve_backend
from m3run.model import Mamba3LM
from m3run.model.lm import compile_options, param_groups
from m3run.runner.config import ConfigError, RunConfig, TrainConfig, config_hash, load_frozen_config
from m3run.runner.files import atomic_write_text
from m3run.runner.protocol import CONFIG_FILE

from .dist import Dist

if TYPE_CHECKING:
    from m3run.kernels.mamba3.tools.tuning import Shape


def freeze_config(cfg: RunConfig, run_dir: Path, force: bool) -> None:
    """Write the resolved config to RUN_DIR/config.yaml at the first launch; later launches
    must bring the same config (by hash) or --force, which replaces it."""
    path = run_dir / CONFIG_FILE
    if path.exists():
        if config_hash(load_frozen_config(path)) == config_hash(cfg):
            return
        if not force:
            raise ConfigError(
                f"the config differs from the one frozen in {path} at the first launch. "
                "Fix: relaunch with the same config, or pass --force to replace it."
            )
    atomic_write_text(path, cfg.to_yaml())


def set_determinism(enabled: bool) -> str | None:
    """train.deterministic, before the first CUDA work: every switch PyTorch offers. Returns a
    line for the worker's log, None when off. Ops with no deterministic kernel warn (naming
    the op) rather than stop the run."""
    if not enabled:
        return None
    # cuBLAS reads this when it creates its first handle (the first matmul): a fixed workspace
    # per stream keeps its split reductions in one order.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    import torch._inductor.config as inductor_config

    switches = "deterministic algorithms, cuDNN, CUBLAS_WORKSPACE_CONFIG"
    if hasattr(inductor_config, "deterministic"):  # no benchmark-driven choices that move numerics
        inductor_config.deterministic = True
        switches += ", inductor"
    return f"train.deterministic: on ({switches}; {os.environ['CUBLAS_WORKSPACE_CONFIG']})"


def resolve_device(cfg: RunConfig, dist: Dist | None = None) -> torch.device:
    """train.device made concrete; under torchrun each rank takes the GPU of its local rank."""
    kind = cfg.train.resolve_device(torch.cuda.is_available())
    if kind == "cuda" and dist is not None and dist.enabled:
        torch.cuda.set_device(dist.local_rank)
        return torch.device("cuda", dist.local_rank)
    return torch.device(kind)


def precision_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of train.precision on `device`: bf16, or None for plain fp32."""
    precision = cfg.train.resolve_precision(device.type)
    return torch.bfloat16 if precision == "bf16" else None


def resolve_precision(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    """precision_dtype, refusing bf16 on CPU (what a training run must not do)."""
    if cfg.train.resolve_precision(device.type) == "bf16" and device.type == "cpu":
        raise ConfigError(
            "train.precision=bf16 on CPU would be slow and inexact. "
            "Fix: set train.precision=fp32 (or auto)."
        )
    return precision_dtype(cfg, device)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The autocast context for `dtype` on `device`; none at all for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def resolve_scan_backend(cfg: RunConfig, device: torch.device) -> str:
    """model.scan_backend made concrete; a backend that cannot run here is a ConfigError."""
    try:
        return resolve_backend(cfg.model.scan_backend, device)
    except BackendUnavailableError as e:
        raise ConfigError(
            f"model.scan_backend={cfg.model.scan_backend}: {e}. "
            "Fix: set model.scan_backend=auto or pytorch, or run on a CUDA machine with triton."
        ) from e


def build_model(cfg: RunConfig, device: torch.device) -> Mamba3LM:
    """A freshly initialised model on `device`, seeded by train.seed, with
    train.activation_checkpointing. Built and initialised there: the 434m model's init takes
    seconds on the CPU (and again on every restart, before a checkpoint overwrites it) against a
    fraction of a second on a GPU. The init values depend on the device's generator, so a CPU
    and a GPU run of one seed start from different weights."""
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = Mamba3LM(cfg.model)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    return model


def scan_shape(cfg: RunConfig, device: torch.device) -> Shape:
    """The scan call a training step of ``cfg`` makes on ``device``, as the launch-plan tuner
    takes it: the micro-batch's windows, the model's heads and state, the autocast dtype, and
    resets where documents are packed."""
    from m3run.kernels.mamba3.tools.tuning import Shape  # Triton's kernels: imported where they run

    m = cfg.model
    dtype = precision_dtype(cfg, device) or torch.float32
    return Shape(
        cfg.train.micro_batch_size,
        cfg.data.seq_len,
        m.nheads,
        m.headdim,
        m.d_state,
        m.n_angles,
        m.ngroups,
        dtype,
        cfg.data.reset_at_eos,
    )


def compile_for_training(
    model: Mamba3LM,
    t: TrainConfig,
    wrapped: torch.nn.Module | None = None,
    backend: str | Callable = "inductor",
) -> torch.nn.Module:
    """What a training step calls: ``wrapped`` (the model, or DDP around it) compiled as
    train.compile and train.compile_scope say (scope "blocks": each block compiled in place,
    the wrapper returned as it is), under inductor with the mode's :func:`compile_options`, or
    another ``backend`` (tests). One copy for the trainer and the smoke test: the smoke test's
    forward/backward through it at the run's shapes traces and compiles what the worker's first
    step will, so the worker reads inductor's and Triton's caches instead of compiling again."""
    wrapped = model if wrapped is None else wrapped
    if not t.compile:
        return wrapped
    if t.compile_scope == "model":
        kwargs = {"options": compile_options(t.compile_mode)} if backend == "inductor" else {}
        return torch.compile(wrapped, backend=backend, **kwargs)
    model.compile_blocks(mode=t.compile_mode, backend=backend)
    return wrapped


# torch.compile's own timers (seconds summed over the process's compiles), the ones that say
# where a first step's compile went: the frontend's trace, the backend, the waits for kernel
# builds, and what a warm cache leaves (loads). Nested, so they do not add up.
_COMPILE_PHASES = {
    "bytecode_tracing": "tracing",
    "OutputGraph.call_user_compiler": "backend",
    "compile_fx.<locals>.bw_compiler": "backward's backend",
    "async_compile.wait": "waiting on kernel builds",
    "AOTAutogradCache.inductor_load": "cache loads",
    "PyCodeCache.load_by_key_path": "module loads",
}


def compile_phases() -> dict[str, float]:
    """Where this process's torch.compile time went so far, by phase (seconds, nested: they do
    not add up); empty when torch keeps no such timers. Read from torch's private counters,
    for the record only."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        seconds = dict(zip(names, map(float, values), strict=True))
    except Exception:  # another torch's timers: said as nothing, never a failure
        return {}
    return {label: round(seconds[k], 2) for k, label in _COMPILE_PHASES.items() if k in seconds}


def describe_compile_phases(phases: dict[str, float]) -> str:
    """One clause for a log line: "tracing 3.1 s, backend 20.4 s, …" (nested figures)."""
    return ", ".join(f"{label} {s:.1f} s" for label, s in phases.items())


def build_optimizer(
    model: Mamba3LM, device: torch.device, t: TrainConfig, lr: float, eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over model.lm.param_groups (weight decay on matrices only), fused on CUDA, with
    train's betas and weight decay. The trainer passes train.lr and train.eps; the smoke test's
    one step its own lr and torch's default eps."""
    return torch.optim.AdamW(
        param_groups(model, t.weight_decay),
        lr=lr,
        betas=(t.beta1, t.beta2),
        eps=eps,
        fused=device.type == "cuda",
    )
