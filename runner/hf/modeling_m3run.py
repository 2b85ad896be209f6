"""Mamba-3-Lite for Hugging Face `transformers`, as exported by `m3run export`.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    print(tokenizer.decode(model.generate(ids, max_new_tokens=32, do_sample=False)[0]))

This file wraps m3run's own model rather than copying it: it needs the `m3run` package
(`pip install m3run`, the version in config.json's `m3run_version` or later), which holds the
Mamba-3 mixer and its scan kernels (Triton on a GPU, PyTorch elsewhere). One definition of the
model means an export computes what the run trained, and `generate` here gives the tokens
`m3run generate` gives: both run the prompt through the chunked scan once, then one recurrent
step a token (the state is the cache, `cache_params`).

Padding is not supported: a recurrent model reads every token, so generate one sequence at a
time or a batch of equal-length prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from m3run.model import Mamba3LM
from m3run.model.config import ModelConfig

from .configuration_m3run import M3RunConfig


@dataclass
class M3RunCausalLMOutput(ModelOutput):
    """`logits` (b, t, V); `cache_params` the per-layer recurrent states after the last token
    (when decoding with the cache); `loss` the next-token cross-entropy when labels are given."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache_params: list | None = None


class M3RunForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = M3RunConfig
    # The checkpoint holds m3run's own parameter names (embedding.*, layers.*, norm_f.*),
    # which are this model's under `lm.`.
    base_model_prefix = "lm"
    main_input_name = "input_ids"
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    # The cache is a recurrent state, not keys and values: no cache class, no assisted decoding.
    _is_stateful = True
    _supports_cache_class = False

    def __init__(self, config: M3RunConfig):
        super().__init__(config)
        self.lm = Mamba3LM(ModelConfig(**config.model))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Mamba3LM initialises itself; an export's weights replace that."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.lm.embedding

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.lm.embedding = value

    def get_output_embeddings(self) -> None:
        return None  # the head is the embedding itself (Mamba3LM.head_weight)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache_params: list | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> M3RunCausalLMOutput:
        """Logits for `input_ids` (b, t). With `use_cache` (generation) the prompt is read once
        and each later call takes the newest token with the state in `cache_params`; only the
        last position's logits come back. With `labels` (b, t), the mean next-token
        cross-entropy over labels ≠ -100 (labels are the input ids, shifted here)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "this model does not support padding (the attention_mask has zeros): pass "
                "sequences without padding, one at a time or of equal length"
            )
        if use_cache or cache_params is not None:
            if cache_params is None:
                logits, cache = self.lm.prefill(input_ids)
            else:
                logits, cache = self.lm.decode_step(input_ids[:, -1], cache_params)
            return M3RunCausalLMOutput(logits=logits[:, None], cache_params=cache)
        logits = self.lm(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return M3RunCausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, cache_params: list | None = None, **kwargs
    ) -> dict:
        if cache_params is not None:
            input_ids = input_ids[:, -1:]
        return {"input_ids": input_ids, "cache_params": cache_params, "use_cache": True}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs) -> dict:
        model_kwargs["cache_params"] = outputs.cache_params
        return model_kwargs
