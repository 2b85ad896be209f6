"""Mamba3LM: the Mamba-3-Lite language model.

Pre-norm residual stack ``x += mixer(rmsnorm(x)); x += swiglu(rmsnorm(x))``, a final RMSNorm, and
an LM head tied to the (padded) embedding. Each block leaves its last add to the next block's
first norm (Block.forward).

Initialisation (GPT-2 / Mamba conventions):
- embedding and every linear weight ~ N(0, init_std);
- the two projections that write into the residual stream (mixer ``out_proj`` and MLP ``down``)
  are further scaled by 1/sqrt(2·n_layers), so the residual variance stays O(1) with depth
  (GPT-2, Radford et al. 2019);
- RMSNorm weights 1; mixer: dt_bias = softplus⁻¹(Δ₀) with Δ₀ log-uniform, D = 1, B/C biases 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from m3run.kernels.mamba3 import State, uses_triton_kernels

from .config import ModelConfig
from .layers import RMSNorm, SwiGLU, autocast_dtype
from .loss import IGNORE_INDEX, linear_cross_entropy
from .mixer import Mamba3Mixer


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = Mamba3Mixer(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_intermediate, cfg.scan_backend)

    def forward(
        self, x: Tensor, pending: Tensor | None = None, reset: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The block on the residual stream ``x + pending`` → ``(x', pending')`` whose sum is
        its output: the stream after the mixer's add and the MLP's output, not yet added. The
        next block's first norm (or the final norm) adds it in its own kernel: the fp32 stream
        is no longer read and written once more by an add at each compiled block's exit, and
        the gradient of ``pending`` leaves the next block's backward already cast to the MLP's
        dtype."""
        if pending is not None:
            x = x + pending
        y = self.mixer(self.mixer_norm(x), reset=reset)
        x, h = self.mlp_norm.add(x, y, self.mlp.backend)
        return x, self.mlp(h)

    def forward_with_state(self, x: Tensor, state: State | None):
        y, state = self.mixer(self.mixer_norm(x), initial_state=state, return_final_state=True)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x: Tensor, state: State):
        y, state = self.mixer.step(self.mixer_norm(x), state)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state


class Mamba3LM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps)
        self.activation_checkpointing = False
        self.loss_fn = linear_cross_entropy
        # Called with a layer's index (layer_params' order) before the forward uses it: the
        # trainer's wait for that layer's update (runner/worker/update.py). None: nothing.
        self.before_layer = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embedding.weight, std=std)
        for block in self.layers:
            nn.init.normal_(block.mixer.in_proj.weight, std=std)
            nn.init.normal_(block.mixer.out_proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.gate_up.weight, std=std)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)
            block.mixer.reset_parameters()
            block.mixer_norm.weight.fill_(1.0)
            block.mlp_norm.weight.fill_(1.0)
        self.norm_f.weight.fill_(1.0)

    @classmethod
    def from_export(cls, path: str | Path) -> Mamba3LM:
        """The model of an `m3run export` directory (config.json + model.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        # An export made before model.A_activation existed trained with softplus.
        model = cls(ModelConfig(**{"A_activation": "softplus", **config["model"]}))
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        return model.eval()

    @property
    def head_weight(self) -> Tensor:
        """The tied LM head: the embedding rows of real tokens (padding rows never get logits)."""
        return self.embedding.weight[: self.config.vocab_size]

    def compile_blocks(self, mode: str | None = None, backend: str | Callable = "inductor") -> None:
        """torch.compile each block in place (regional compilation): under inductor with
        ``mode`` and :func:`compile_options`, or another ``backend`` (tests). The blocks share
        one forward and differ only in their parameters, which the compiled graph takes as
        inputs, so the first block's graph serves every layer: a cold start traces and compiles
        one block, not the stack. The loss is compiled too (its softmax fused, or under the
        Triton backend its small ops around the cross-entropy kernel); the embedding and the
        final norm stay eager."""
        kwargs = {"options": compile_options(mode)} if backend == "inductor" else {}
        for block in self.layers:
            block.compile(backend=backend, **kwargs)
        self.loss_fn = torch.compile(linear_cross_entropy, backend=backend, **kwargs)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def precompile_scan(self, batch: int, seq_len: int, dtype: torch.dtype, reset: bool):
        """Start compiling, on a pool of threads, the scan kernels that training steps on
        (batch, seq_len) windows and their evaluation will launch (in ``dtype``, the autocast
        dtype; with ``reset``, the packed documents' resets), before their first launch
        (kernels/mamba3/tools/precompile.py). Returns the compile's future (a one-line
        summary, or its error), or None where the scan does not run on Triton kernels."""
        device = self.embedding.weight.device
        probe = torch.empty(0, dtype=dtype, device=device)
        if not uses_triton_kernels(self.config.scan_backend, probe):
            return None
        from m3run.kernels.mamba3.tools.precompile import precompile, scan_launches

        c = self.config
        launches = scan_launches(
            batch,
            seq_len,
            c.nheads,
            c.headdim,
            c.d_state,
            c.n_angles,
            g=c.ngroups,
            chunk_size=c.chunk_size,
            dtype=dtype,
            reset=reset,
            device=device,
        )
        return precompile(launches, device)

    def layer_params(self) -> list[list[nn.Parameter]]:
        """The parameters in the order the forward first uses them, a list a layer: the
        embedding (the tied head too), each block, the final norm."""
        parts = [self.embedding, *self.layers, self.norm_f]
        return [list(m.parameters()) for m in parts]

    def _before(self, layer: int) -> None:
        if self.before_layer is not None:
            self.before_layer(layer)

    def hidden_states(self, idx: Tensor, reset: Tensor | None = None) -> Tensor:
        self._before(0)
        x = self.embedding(idx)
        # The MLP output a block leaves to the next (Block.forward). The first block's: zeros
        # in the dtype every block's MLP returns, needing a gradient where theirs do, so that
        # one compiled graph serves every block.
        pending = torch.zeros_like(x, dtype=autocast_dtype(x)).requires_grad_(x.requires_grad)
        for i, block in enumerate(self.layers, start=1):
            self._before(i)
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x, pending = checkpoint(block, x, pending, reset, use_reentrant=False)
            else:
                x, pending = block(x, pending, reset)
        self._before(len(self.layers) + 1)
        return self.norm_f(x + pending)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        reset: Tensor | None = None,
        eos_id: int | None = None,
    ) -> Tensor:
        """``idx`` (b, t) token ids. With ``targets`` (b, t) returns the mean cross-entropy over
        targets ≠ -100 (never materialising fp32 logits for all tokens); else logits (b, t, V).

        Packed windows: ``reset`` (b, t) bool zeroes every mixer's scan state before each True
        token, so no document sees the one before it; or ``eos_id`` builds it from ``idx``
        (:func:`document_starts`: a reset on every token after an ``eos_id``). Not both."""
        if eos_id is not None:
            if reset is not None:
                raise ValueError(
                    "pass reset or eos_id, not both (eos_id builds reset from idx: "
                    "document_starts(idx, eos_id))"
                )
            reset = document_starts(idx, eos_id)
        h = self.hidden_states(idx, reset)
        if targets is not None:  # the padded embedding: aligned matmuls, padding rows no class
            return self.loss_fn(
                h,
                self.embedding.weight,
                targets,
                n_classes=self.config.vocab_size,
                backend=self.config.scan_backend,
            )
        return F.linear(h, self.head_weight.to(h.dtype))

    # -- decoding ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, idx: Tensor) -> tuple[Tensor, list[State]]:
        """Run the prompt through the chunked scan and return the last logits and the per-layer
        recurrent states."""
        x = self.embedding(idx)
        states = []
        for block in self.layers:
            x, st = block.forward_with_state(x, None)
            states.append(st)
        h = self.norm_f(x[:, -1:])
        return F.linear(h, self.head_weight.to(h.dtype))[:, 0], states

    @torch.no_grad()
    def decode_step(self, token: Tensor, states: list[State]) -> tuple[Tensor, list[State]]:
        """One token per sequence (b,) → logits (b, V) and the new states. O(1) in the prefix."""
        x = self.embedding(token[:, None])
        new_states = []
        for block, st in zip(self.layers, states, strict=True):
            x, st = block.step(x, st)
            new_states.append(st)
        h = self.norm_f(x)
        return F.linear(h, self.head_weight.to(h.dtype))[:, 0], new_states

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
    ) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (b, t) with the recurrent state.

        temperature 0 is greedy; top_k keeps the k most likely tokens; top_p keeps the smallest
        set whose probability mass reaches p. Stops early when every row has emitted ``eos_id``.
        """
        steps = self.stream(idx, max_new_tokens, temperature, top_k, top_p, generator, eos_id)
        return torch.cat([idx, *(nxt[:, None] for nxt in steps)], dim=1)

    def stream(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
    ) -> Iterator[Tensor]:
        """`generate`, one sampled token per row (b,) at a time, as each is drawn. The arguments
        are checked here, at the call, not at the first token."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be ≥ 1 or None, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must be (batch, t ≥ 1) token ids, got shape {tuple(idx.shape)}")
        return self._stream(idx, max_new_tokens, temperature, top_k, top_p, generator, eos_id)

    def _stream(self, idx, max_new_tokens, temperature, top_k, top_p, generator, eos_id):
        logits, states = self.prefill(idx)
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for i in range(max_new_tokens):
            nxt = sample(logits, temperature, top_k, top_p, generator)
            yield nxt
            if eos_id is not None:
                done |= nxt == eos_id
                if bool(done.all()):
                    return
            if i + 1 < max_new_tokens:
                logits, states = self.decode_step(nxt, states)


def compile_options(mode: str | None = None) -> dict:
    """Inductor's options for this model under torch.compile ``mode`` (None: the default): the
    mode's own, and no padding of row strides. When in_proj was one product with 4,336-column
    rows (z, x, B, C, Δ, A, λ, θ at the 434m preset), inductor padded them to 4,352 and then
    copied x and z back to the traced strides for the scan kernels, whose strides it cannot
    change: four copies of a (b, t, d_inner) tensor per layer and micro-batch. Kept off since
    in_proj became separate products (Mamba3Mixer._in_proj); padding has not been measured on
    those."""
    from torch._inductor import list_mode_options

    return {**(list_mode_options(mode) if mode else {}), "comprehensive_padding": False}


def document_starts(idx: Tensor, eos_id: int) -> Tensor:
    """The scan's reset mask (b, t) for packed token ids (b, t): True on every token after an
    ``eos_id`` (a document's first token), False on token 0 (the window's state starts at zero)."""
    reset = torch.zeros_like(idx, dtype=torch.bool)
    reset[:, 1:] = idx[:, :-1] == eos_id
    return reset


def sample(
    logits: Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row from ``logits`` (b, V)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# Parameters that are gains, offsets or per-head scalars: weight decay would pull them to 0.
_NO_DECAY_NAMES = ("dt_bias", "D", "B_bias", "C_bias", "B_norm_weight", "C_norm_weight")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: matrices (linear weights, the tied embedding) decay; norm weights, biases,
    dt_bias, D and the B/C biases do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() < 2 or leaf in _NO_DECAY_NAMES or "norm" in name or leaf == "bias":
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


__all__ = [
    "IGNORE_INDEX",
    "Mamba3LM",
    "compile_options",
    "document_starts",
    "param_groups",
    "sample",
]
