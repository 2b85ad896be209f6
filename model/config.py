"""Mamba-3-Lite model configuration and presets."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelConfig(BaseModel):
    """Shape and numerics of a Mamba-3-Lite language model (names follow the Mamba papers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(
        50257, ge=2, description="Tokenizer vocabulary size (GPT-2 BPE: 50257)."
    )
    pad_vocab_multiple: int = Field(
        64,
        ge=1,
        description="Embedding rows are padded up to a multiple of this for aligned matmuls.",
    )
    d_model: int = Field(1024, ge=8, description="Residual stream width.")
    n_layers: int = Field(24, ge=1, description="Number of (mixer + MLP) blocks.")
    d_intermediate: int = Field(3072, ge=1, description="SwiGLU hidden width.")
    expand: int = Field(2, ge=1, description="Mixer inner width E = expand · d_model.")
    headdim: int = Field(64, ge=1, description="Head dimension P; nheads H = E / P.")
    d_state: int = Field(64, ge=2, description="SSM state size N (per head, one B/C group).")
    ngroups: int = Field(1, ge=1, description="B/C groups g: 1 (shared by all heads) or nheads.")
    rope_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Fraction of the N state dims rotated; S = N·fraction/2 angles.",
    )
    chunk_size: int = Field(64, ge=1, description="Scan chunk length (a power of two).")
    dt_min: float = Field(1e-3, gt=0, description="Lower end of the log-uniform Δ₀ init.")
    dt_max: float = Field(1e-1, gt=0, description="Upper end of the log-uniform Δ₀ init.")
    dt_init_floor: float = Field(1e-4, gt=0, description="Floor applied to the sampled Δ₀.")
    A_activation: Literal["heavy_tail", "softplus"] = Field(
        "heavy_tail",
        description="f in A = min(-f(dd_A), -A_floor): heavy_tail (f(x) = 1 + x for x ≥ 0, "
        "1/(1 - x) below; the official Mamba-3 module's since mamba_ssm PR #962, stable at high "
        "learning rates, and it learns faster per token) or softplus (the paper's form; runs "
        "frozen before this key keep it).",
    )
    A_floor: float = Field(1e-4, gt=0, description="A = min(-f(dd_A), -A_floor): keeps decay.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon (blocks and B/C norms).")
    init_std: float = Field(
        0.02, gt=0, description="Std of the normal init of embeddings and linears."
    )
    scan_backend: Literal["auto", "triton", "pytorch"] = Field(
        "auto",
        description="Kernels of the Mamba-3 scan and the SwiGLU MLP: auto (triton on CUDA), "
        "triton or pytorch.",
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.d_inner % self.headdim:
            raise ValueError(
                f"expand·d_model = {self.d_inner} must be divisible by headdim = {self.headdim}"
            )
        if self.ngroups not in (1, self.nheads):
            raise ValueError(f"ngroups must be 1 or nheads = {self.nheads}, got {self.ngroups}")
        if self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"chunk_size must be a power of two, got {self.chunk_size}")
        if self.dt_min > self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must be ≤ dt_max ({self.dt_max})")
        return self

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def n_angles(self) -> int:
        """S: the number of rotated pairs of state dims."""
        return int(self.d_state * self.rope_fraction) // 2

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named preset (see PRESETS), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # The DESIGN preset: ≈435.0M parameters with the tied, padded GPT-2 embedding.
    "434m": dict(d_model=1024, n_layers=24, d_intermediate=3072, expand=2, headdim=64,
                 d_state=64, rope_fraction=0.5, chunk_size=64, vocab_size=50257),
    # ≈125M, for a quick real-data run on a single GPU.
    "125m": dict(d_model=768, n_layers=12, d_intermediate=2048, expand=2, headdim=64,
                 d_state=64, rope_fraction=0.5, chunk_size=64, vocab_size=50257),
    # Small enough to train on a laptop CPU in minutes: the demo recipe and the tests use it.
    "tiny": dict(d_model=128, n_layers=2, d_intermediate=256, expand=2, headdim=32,
                 d_state=16, rope_fraction=0.5, chunk_size=64, vocab_size=4096,
                 pad_vocab_multiple=64),
}  # fmt: skip
