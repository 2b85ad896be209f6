"""The configuration of an m3run export for Hugging Face `transformers`.

`m3run export` copies this file into the export folder, beside `config.json`, whose
`auto_map` names it: `AutoConfig.from_pretrained(folder, trust_remote_code=True)`. The model's
shape is m3run's ModelConfig, kept whole under `model`; `vocab_size`, `hidden_size` and
`num_hidden_layers` restate it in Hugging Face's names for the tools that read those.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class M3RunConfig(PretrainedConfig):
    """Mamba-3-Lite as trained by m3run: `model` is the ModelConfig's fields; `step`,
    `config_hash` and `m3run_version` say which checkpoint of which run it is."""

    model_type = "m3run_mamba3"

    def __init__(
        self,
        model: dict | None = None,
        step: int | None = None,
        config_hash: str | None = None,
        m3run_version: str | None = None,
        **kwargs,
    ):
        self.model = dict(model or {})
        self.step = step
        self.config_hash = config_hash
        self.m3run_version = m3run_version
        for name, key in (
            ("vocab_size", "vocab_size"),
            ("hidden_size", "d_model"),
            ("num_hidden_layers", "n_layers"),
        ):
            if key in self.model:
                kwargs.setdefault(name, self.model[key])
        # The LM head is the embedding (there is no separate lm_head to tie).
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
