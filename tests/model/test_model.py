"""Mamba3LM: presets, parameter count, decode == forward, packed documents, the loss, parameter
groups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from m3run.model import PRESETS, Mamba3LM, ModelConfig
from m3run.model.lm import document_starts, param_groups, sample
from m3run.model.loss import linear_cross_entropy

F64 = torch.float64


def tiny(**kw) -> ModelConfig:
    small = dict(vocab_size=97, d_model=32, headdim=16, d_state=8, d_intermediate=48, chunk_size=8)
    return ModelConfig.preset("tiny", **{**small, **kw})


def test_434m_preset_parameter_count():
    with torch.device("meta"):
        model = Mamba3LM(ModelConfig.preset("434m"))
    n = model.num_params()
    print(f"434m preset: {n:,} parameters")
    assert 430e6 <= n <= 440e6
    cfg = model.config
    assert (cfg.d_inner, cfg.nheads, cfg.n_angles, cfg.padded_vocab_size) == (2048, 32, 16, 50304)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds(name):
    with torch.device("meta"):
        model = Mamba3LM(ModelConfig.preset(name))
    assert model.num_params() > 0


def test_config_rejects_typos_and_bad_shapes():
    with pytest.raises(ValidationError, match="extra"):
        ModelConfig(d_modle=64)
    with pytest.raises(ValidationError, match="divisible by headdim"):
        ModelConfig(d_model=100, headdim=64)
    with pytest.raises(ValidationError, match="power of two"):
        ModelConfig(chunk_size=48)
    with pytest.raises(ValueError, match="unknown model preset 'big'"):
        ModelConfig.preset("big")


@pytest.mark.parametrize("ngroups", [1, 4], ids=["g1", "gh"])
def test_recurrent_decode_reproduces_full_forward_logits(ngroups):
    torch.manual_seed(0)
    cfg = tiny(ngroups=ngroups)
    model = Mamba3LM(cfg).to(F64).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 21))
    full = model(idx)  # (b, t, V)
    # prefill a prompt of 5 through the chunked scan, then decode token by token
    logits, states = model.prefill(idx[:, :5])
    torch.testing.assert_close(logits, full[:, 4], rtol=1e-10, atol=1e-10)
    for i in range(5, 21):
        logits, states = model.decode_step(idx[:, i], states)
        torch.testing.assert_close(logits, full[:, i], rtol=1e-10, atol=1e-10)


def test_in_proj_as_two_products_equals_one_product_split():
    """Mamba3Mixer._in_proj: the outputs (z and x together, then the rest) and the gradients of
    the input and the weight equal those of one product split, and the weight keeps its one
    (width, d_model) shape."""
    from m3run.model.mixer import Mamba3Mixer

    torch.manual_seed(0)
    cfg = tiny()
    mixer = Mamba3Mixer(cfg).to(F64)
    width = sum(mixer.split_sizes)
    assert mixer.in_proj.weight.shape == (width, cfg.d_model)
    u = torch.randn(2, 7, cfg.d_model, dtype=F64, requires_grad=True)
    got = mixer._in_proj(u)
    E = cfg.d_inner
    want = F.linear(u, mixer.in_proj.weight).split([2 * E, *mixer.split_sizes[2:]], dim=-1)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert got[0].is_contiguous()
    probes = [torch.randn_like(w) for w in want]
    grads = []
    for outs in (got, want):
        total = sum((o * p).sum() for o, p in zip(outs, probes, strict=True))
        grads.append(torch.autograd.grad(total, (u, mixer.in_proj.weight)))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_the_deferred_residual_add_computes_what_the_block_adding_its_own_does(monkeypatch):
    """Block.forward leaves its MLP output for the next block's first norm to add: the loss and
    every gradient equal, bitwise, those of a model whose blocks are ``x + mixer(...);
    x + mlp(...)`` written out, adding their own output and leaving nothing (zeros) pending."""
    from m3run.model.lm import Block

    torch.manual_seed(0)
    model = Mamba3LM(tiny(n_layers=3))
    idx = torch.randint(0, 97, (2, 16))
    y = torch.randint(0, 97, (2, 16))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(idx, y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def written_out(self, x, pending, reset=None):  # DESIGN's block, nothing deferred
        assert not pending.any()  # the model's first zeros, then this block's own
        x = x + pending
        x = x + self.mixer(self.mixer_norm(x), reset=reset)
        x = x + self.mlp(self.mlp_norm(x))
        return x, torch.zeros_like(x)

    deferred = loss_and_grads()
    monkeypatch.setattr(Block, "forward", written_out)
    plain = loss_and_grads()
    assert torch.equal(deferred[0], plain[0])
    assert all(map(torch.equal, deferred[1], plain[1]))


def test_generate_uses_recurrent_state_and_is_greedy_consistent():
    torch.manual_seed(0)
    cfg = tiny()
    model = Mamba3LM(cfg).to(F64).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 4))
    out = model.generate(prompt, max_new_tokens=6, temperature=0)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], prompt)
    # greedy decode must equal argmax of a full forward re-run at every position
    for i in range(4, 10):
        assert torch.equal(model(out[:, :i])[:, -1].argmax(-1), out[:, i])


def test_reset_built_from_eos_equals_passing_it():
    torch.manual_seed(0)
    cfg = tiny()
    model = Mamba3LM(cfg).to(F64)
    eos = cfg.vocab_size - 1
    idx = torch.randint(0, eos, (2, 21))
    idx[0, [0, 6, 20]] = eos  # on token 0 and on the last token too
    idx[1, [7, 8]] = eos  # a document of one EOS token
    want = torch.zeros(2, 21, dtype=torch.bool)
    want[0, [1, 7]] = want[1, [8, 9]] = True
    assert torch.equal(document_starts(idx, eos), want)
    torch.testing.assert_close(model(idx, eos_id=eos), model(idx, reset=want), rtol=0, atol=0)
    # Through activation checkpointing as well.
    loss = model(idx, idx, eos_id=eos)
    model.activation_checkpointing = True
    torch.testing.assert_close(model(idx, idx, eos_id=eos), loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass reset or eos_id, not both"):
        model(idx, reset=want, eos_id=eos)


@pytest.mark.parametrize("eos_at", [8, 11], ids=["doc2-at-chunk-start", "doc2-inside-chunk"])
def test_with_resets_a_packed_document_gives_its_logits_alone(eos_at):
    torch.manual_seed(0)
    cfg = tiny()  # chunk 8
    model = Mamba3LM(cfg).to(F64).eval()
    eos = cfg.vocab_size - 1
    idx = torch.randint(0, eos, (2, 24))
    idx[:, eos_at - 1] = eos
    second = idx[:, eos_at:]
    packed = model(idx, eos_id=eos)[:, eos_at:]
    torch.testing.assert_close(packed, model(second), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(model(idx)[:, eos_at:], packed, atol=1e-6)  # it leaked before


def test_sampling_filters():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {0, 1}
    draws = {int(sample(logits, 1.0, top_p=0.5, generator=gen)) for _ in range(50)}
    assert draws == {0}
    with pytest.raises(ValueError, match="top_p must be in"):
        Mamba3LM(tiny()).generate(torch.zeros(1, 1, dtype=torch.long), 1, top_p=0)


def test_loss_is_mean_cross_entropy_with_ignore_index_and_exact_grads():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=F64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :3] = -100
    got = linear_cross_entropy(hidden, weight, targets, chunk_tokens=4)
    want = F.cross_entropy(
        (hidden @ weight.t()).reshape(-1, 50), targets.reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(2.5 * got, (hidden, weight))
    g2 = torch.autograd.grad(2.5 * want, (hidden, weight))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_padding_rows_of_the_head_are_no_class_and_get_no_gradient():
    """The padded head (rows from n_classes on) gives the loss and gradients of the unpadded
    one, and its padding rows a zero gradient."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=F64, requires_grad=True)
    weight = torch.randn(64, 16, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    targets[1, 2] = -100
    padded = linear_cross_entropy(hidden, weight, targets, chunk_tokens=4, n_classes=50)
    plain = linear_cross_entropy(hidden, weight[:50], targets, chunk_tokens=4)
    torch.testing.assert_close(padded, plain, rtol=1e-12, atol=1e-12)
    gh_p, gw_p = torch.autograd.grad(padded, (hidden, weight))
    gh, gw = torch.autograd.grad(plain, (hidden, weight))
    torch.testing.assert_close(gh_p, gh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw_p, gw, rtol=1e-12, atol=1e-12)  # gw's rows 50.. are 0 too
    assert not gw_p[50:].any()
    with pytest.raises(ValueError, match=r"n_classes must be in 1\.\.64 \(weight rows\), got 65"):
        linear_cross_entropy(hidden, weight, targets, n_classes=65)


def test_model_loss_matches_materialised_logits():
    torch.manual_seed(0)
    cfg = tiny()
    model = Mamba3LM(cfg).to(F64)
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    tgt = torch.randint(0, cfg.vocab_size, (2, 12))
    loss = model(idx, tgt)
    ref = F.cross_entropy(model(idx).reshape(-1, cfg.vocab_size), tgt.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)


def test_training_path_never_builds_full_fp32_logits():
    """The loss graph saves no (tokens × vocab) tensor: only chunk-sized logits ever exist."""
    cfg = tiny(vocab_size=4000)
    model = Mamba3LM(cfg)
    idx = torch.randint(0, cfg.vocab_size, (4, 64))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, idx)
    n_tokens = idx.numel()
    assert max(saved) < n_tokens * cfg.vocab_size
    loss.backward()
    assert model.embedding.weight.grad is not None


def test_param_groups_split_decay_and_no_decay():
    model = Mamba3LM(tiny())
    groups = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decay | no_decay == set(names.values()) and not decay & no_decay
    for n in no_decay:
        assert any(k in n for k in ("norm", "dt_bias", ".D", "B_bias", "C_bias"))
    assert "embedding.weight" in decay
    assert all(
        n.endswith(
            (
                "in_proj.weight",
                "out_proj.weight",
                "gate_up.weight",
                "down.weight",
                "embedding.weight",
            )
        )
        for n in decay
    )


def test_layer_params_cover_every_parameter_once_in_forward_order():
    """layer_params (the update's layers) holds each parameter once, and the forward calls
    before_layer with each layer's index, in order, before it uses that layer."""
    model = Mamba3LM(tiny())
    layers = model.layer_params()
    ids = [id(p) for layer in layers for p in layer]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert layers[0] == [model.embedding.weight] and layers[-1] == [model.norm_f.weight]
    seen = []
    model.before_layer = seen.append
    idx = torch.randint(0, model.config.vocab_size, (1, 8))
    model(idx, idx)
    assert seen == list(range(len(layers)))


def test_tied_head_and_initialisation():
    cfg = tiny()
    model = Mamba3LM(cfg)
    assert model.head_weight.data_ptr() == model.embedding.weight.data_ptr()
    mixer = model.layers[0].mixer
    dt0 = F.softplus(mixer.dt_bias)
    assert ((dt0 >= cfg.dt_init_floor * 0.999) & (dt0 <= cfg.dt_max * 1.001)).all()
    assert torch.all(mixer.D == 1) and torch.all(mixer.B_bias == 1) and torch.all(mixer.C_bias == 1)
    std = model.layers[0].mlp.down.weight.std().item()
    assert std == pytest.approx(cfg.init_std / (2 * cfg.n_layers) ** 0.5, rel=0.2)
