"""`make demo`: a short look at the model on CPU (replaced by a supervised run once the worker
and supervisor exist)."""

from __future__ import annotations

import torch

from model import Mamba3LM, ModelConfig


def main() -> None:
    torch.manual_seed(0)
    for name in ("tiny", "434m"):
        with torch.device("meta"):
            n = Mamba3LM(ModelConfig.preset(name)).num_params()
        print(f"preset {name:>5}: {n / 1e6:8.2f}M parameters")
    cfg = ModelConfig.preset("tiny")
    model = Mamba3LM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 8))
    out = model.generate(prompt, max_new_tokens=24, temperature=1.0, top_k=50)
    print("untrained tiny model, 24 sampled token ids:", out[0, 8:].tolist())


if __name__ == "__main__":
    main()
