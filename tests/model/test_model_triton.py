"""Model-level parity of the scan backends: the loss and every parameter gradient of Mamba3LM
with model.scan_backend=triton match pytorch (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from m3run.model import Mamba3LM, ModelConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton scan needs a CUDA GPU"),
]


@pytest.mark.parametrize("ngroups", [1, 16], ids=["g1", "gh"])
def test_triton_and_pytorch_backends_give_the_same_loss_and_gradients(ngroups):
    torch.manual_seed(0)
    base = ModelConfig.preset("tiny", d_model=256, n_layers=2, ngroups=ngroups, vocab_size=1000)
    ref_model = Mamba3LM(base.model_copy(update={"scan_backend": "pytorch"})).cuda()
    tri_model = Mamba3LM(base.model_copy(update={"scan_backend": "triton"})).cuda()
    tri_model.load_state_dict(ref_model.state_dict())
    idx = torch.randint(0, base.vocab_size, (4, 300), device="cuda")
    losses, grads = [], []
    for model in (ref_model, tri_model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=2e-3)
    for name, g_ref in grads[0].items():
        g_tri = grads[1][name]
        rel = ((g_tri - g_ref).norm() / g_ref.norm().clamp_min(1e-12)).item()
        assert rel < 5e-2, f"{name}: relative gradient error {rel:.2e}"
