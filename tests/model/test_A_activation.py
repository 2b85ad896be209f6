"""model.A_activation: A = min(−f(dd_A), −A_floor) with f heavy-tail (the default) or softplus,
checked in float64 against the documented formulas, through the mixer's forward and backward,
the whole LM and its decode step."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from m3run.model import Mamba3LM, ModelConfig
from m3run.model.mixer import A_ACTIVATIONS, Mamba3Mixer

F64 = torch.float64
ACTIVATIONS = ["heavy_tail", "softplus"]


def tiny(**kw) -> ModelConfig:
    small = dict(vocab_size=97, d_model=32, headdim=16, d_state=8, d_intermediate=48, chunk_size=8)
    return ModelConfig.preset("tiny", **{**small, "scan_backend": "pytorch", **kw})


# The documented f and f', written out apart from the code under test.
def f_documented(name: str, x: float) -> float:
    if name == "heavy_tail":
        return 1 + x if x >= 0 else 1 / (1 - x)
    return math.log1p(math.exp(x))


def df_documented(name: str, x: float) -> float:
    if name == "heavy_tail":
        return 1.0 if x >= 0 else 1 / (1 - x) ** 2
    return 1 / (1 + math.exp(-x))


def test_new_configs_default_to_heavy_tail_and_reject_other_names():
    assert ModelConfig().A_activation == "heavy_tail"
    assert ModelConfig.preset("434m").A_activation == "heavy_tail"
    with pytest.raises(ValueError, match="heavy_tail"):
        ModelConfig(A_activation="relu")


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_activation_and_its_gradient_are_the_documented_ones(name):
    # Points on both sides of 0, 0 itself, and 1 (where 1/(1 − x) has its pole).
    points = [-30.0, -3.0, -1.0, -0.25, 0.0, 0.5, 1.0, 4.0]
    x = torch.tensor(points, dtype=F64, requires_grad=True)
    y = A_ACTIVATIONS[name](x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    want = torch.tensor([f_documented(name, p) for p in points], dtype=F64)
    dwant = torch.tensor([df_documented(name, p) for p in points], dtype=F64)
    torch.testing.assert_close(y, want, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, dwant, rtol=1e-14, atol=0)
    assert bool((y > 0).all())  # A = −f < 0: every head decays


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_mixer_computes_A_and_its_gradient_by_the_activation(name):
    """A as the scan receives it (adt / Δ) is min(−f(dd_A), −A_floor) of the in_proj's dd_A
    rows, and the gradient of a loss on adt reaches the mixer's input through f' and Δ's
    softplus, as the chain rule with the documented derivatives gives it."""
    torch.manual_seed(0)
    cfg = tiny(A_activation=name, A_floor=0.1)
    mixer = Mamba3Mixer(cfg).to(F64)
    E, N, H = cfg.d_inner, cfg.d_state, cfg.nheads
    rows = 2 * E + 2 * N
    with torch.no_grad():  # dd_A of order 10: both branches of f, and the floor, are reached
        mixer.in_proj.weight[rows + H : rows + 2 * H] *= 40
    u = (3 * torch.randn(2, 11, cfg.d_model, dtype=F64)).requires_grad_()
    p = mixer._project(u)
    w_dt, w_A = mixer.in_proj.weight[rows : rows + H], mixer.in_proj.weight[rows + H : rows + 2 * H]
    dd_dt, dd_A = (u @ w_dt.T).detach(), (u @ w_A.T).detach()
    assert float(dd_A.min()) < -1 and float(dd_A.max()) > 1

    f = dd_A.clone().apply_(lambda v: f_documented(name, v))
    df = dd_A.clone().apply_(lambda v: df_documented(name, v))
    A_want = torch.clamp(-f, max=-cfg.A_floor)
    dt = F.softplus(dd_dt + mixer.dt_bias.detach())
    torch.testing.assert_close(p["adt"] / p["dt"], A_want, rtol=1e-10, atol=0)
    torch.testing.assert_close(p["adt"], A_want * dt, rtol=1e-10, atol=0)

    g = torch.randn_like(p["adt"])
    (du,) = torch.autograd.grad((g * p["adt"]).sum(), u)
    floored = -f > -cfg.A_floor  # the clamp passes no gradient to dd_A there
    assert bool(floored.any()) and bool((~floored).any())
    d_dd_A = torch.where(floored, 0.0, g * dt * -df)
    d_dd_dt = g * A_want * torch.sigmoid(dd_dt + mixer.dt_bias.detach())
    want = d_dd_A @ w_A.detach() + d_dd_dt @ w_dt.detach()
    torch.testing.assert_close(du, want, rtol=1e-9, atol=1e-9 * float(want.abs().max()))


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_lm_loss_gradient_matches_finite_differences(name):
    """Through the whole model (scan, gate, MLP, loss), along a random direction of every
    in_proj weight: autograd's directional derivative against a central difference."""
    torch.manual_seed(1)
    model = Mamba3LM(tiny(A_activation=name)).to(F64)
    idx = torch.randint(0, 97, (2, 19))
    targets = torch.randint(0, 97, (2, 19))
    weights = [block.mixer.in_proj.weight for block in model.layers]
    dirs = [torch.randn_like(w) for w in weights]
    grads = torch.autograd.grad(model(idx, targets), weights)
    analytic = sum(float((g * d).sum()) for g, d in zip(grads, dirs, strict=True))
    eps = 1e-6
    with torch.no_grad():
        losses = []
        for sign in (1, -1):
            for w, d in zip(weights, dirs, strict=True):
                w.add_(sign * eps * d)
            losses.append(float(model(idx, targets)))
            for w, d in zip(weights, dirs, strict=True):
                w.sub_(sign * eps * d)
    numeric = (losses[0] - losses[1]) / (2 * eps)
    assert analytic == pytest.approx(numeric, rel=1e-6)


def test_the_two_activations_give_different_models():
    torch.manual_seed(2)
    heavy = Mamba3LM(tiny()).to(F64)
    soft = Mamba3LM(tiny(A_activation="softplus")).to(F64)
    soft.load_state_dict(heavy.state_dict())  # the same weights: only f differs
    idx = torch.randint(0, 97, (1, 16))
    assert not torch.allclose(heavy(idx), soft(idx))


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_the_decode_step_uses_the_same_A_as_the_forward(name):
    torch.manual_seed(3)
    model = Mamba3LM(tiny(A_activation=name)).to(F64).eval()
    idx = torch.randint(0, 97, (2, 13))
    full = model(idx)
    logits, states = model.prefill(idx[:, :4])
    torch.testing.assert_close(logits, full[:, 3], rtol=1e-10, atol=1e-10)
    for i in range(4, 13):
        logits, states = model.decode_step(idx[:, i], states)
        torch.testing.assert_close(logits, full[:, i], rtol=1e-10, atol=1e-10)


def test_an_export_made_before_the_key_loads_with_softplus(tmp_path):
    """An export's config.json from before model.A_activation existed lacks it: the model
    trained with softplus and loads so; a newer export names its activation."""
    torch.manual_seed(4)
    model = Mamba3LM(tiny(A_activation="softplus"))
    saved = model.config.model_dump()
    del saved["A_activation"]
    (tmp_path / "config.json").write_text(json.dumps({"model": saved}))
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    loaded = Mamba3LM.from_export(tmp_path)
    assert loaded.config.A_activation == "softplus"
    idx = torch.randint(0, 97, (1, 9))
    torch.testing.assert_close(loaded(idx), model.eval()(idx), rtol=0, atol=0)

    saved["A_activation"] = "heavy_tail"
    (tmp_path / "config.json").write_text(json.dumps({"model": saved}))
    assert Mamba3LM.from_export(tmp_path).config.A_activation == "heavy_tail"
