"""The optimised training step (torch.compile, the chunked linear cross-entropy, fused/foreach
AdamW) computes the same loss and gradients as a plain eager step with materialised logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from m3run.model import Mamba3LM, ModelConfig

ON_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)


def _grads_after_step(model, step_fn, batches):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in batches:
        loss = step_fn(x, y)
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compiled_fused_step_equals_plain_step(scope, device):
    """Both compile scopes of train.compile_scope; under "blocks" the layers share one graph. On
    CUDA in bf16 under inductor (the production path), on CPU in fp32."""
    torch.manual_seed(0)
    cuda = device == "cuda"
    cfg = ModelConfig.preset("tiny", vocab_size=512, d_model=64, d_intermediate=128)
    model = Mamba3LM(cfg).to(device)
    batches = [
        (x[:, :-1], x[:, 1:])
        for x in torch.randint(0, cfg.vocab_size, (2, 4, 129), device=device).unbind(0)
    ]
    amp = torch.autocast(device, dtype=torch.bfloat16, enabled=cuda)

    def plain(x, y):
        with amp:
            logits = model(x).float()  # materialised (tokens × vocab) logits
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))

    # inductor on GPU (the production path); on CPU the same graph capture through aot_eager,
    # which keeps the test fast on 2 cores
    backend = "inductor" if cuda else "aot_eager"

    def optimised(x, y):
        with amp:
            return compiled(x, y)  # chunked linear cross-entropy, never full fp32 logits

    loss_p, grads_p = _grads_after_step(model, plain, batches)
    torch._dynamo.reset()
    counters.clear()
    if scope == "model":
        compiled = torch.compile(model, backend=backend)
    else:
        model.compile_blocks(backend=backend)
        compiled = model
    loss_o, grads_o = _grads_after_step(model, optimised, batches)
    if scope == "blocks":  # one graph for every layer (no recompile per layer), one for the loss
        assert cfg.n_layers > 1 and counters["stats"]["unique_graphs"] == 2, counters["stats"]
    tol = 2e-2 if cuda else 1e-5
    assert loss_o == pytest.approx(loss_p, rel=tol)
    for name, g in grads_p.items():
        rel = ((grads_o[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < (5e-2 if cuda else 1e-4), f"{name}: relative gradient error {rel:.2e}"

    # one AdamW update from the same gradients: fused (CUDA) or foreach vs the for-loop path
    params = [p.detach().clone() for p in model.parameters()]
    updated = []
    for kind in ("loop", "fast"):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads_o.values(), strict=True):
            p.grad = g.to(p.dtype).clone()
        kw = (
            {"foreach": False}
            if kind == "loop"
            else ({"fused": True} if cuda else {"foreach": True})
        )
        opt = torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw)
        opt.step()
        updated.append(ps)
    for a, b in zip(*updated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
