"""The optimizer update behind the non-finite guard (runner/worker/update.py), on the host path
(plain AdamW) and on the kernel's (fused AdamW, on CPU and CUDA, the update skipped inside the
kernel; on CUDA also layer by layer on a stream of its own): a non-finite loss or gradient norm
leaves weights, moments and step count bitwise as they were, a finite step updates exactly as a
plain ``step()`` does, and the clip the update applies is ``clip_grad_norm_``'s."""

from __future__ import annotations

import copy

import pytest
import torch

from m3run.runner.worker.update import GuardedUpdate

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# (device, optimizer): the host's guard; the kernel's skip on CPU; the kernel's on CUDA (the
# trainer's), the host reading the numbers while the update runs.
CASES = [
    pytest.param("cpu", "plain", id="cpu-host"),
    pytest.param("cpu", "fused", id="cpu-fused"),
    pytest.param("cuda", "fused", id="cuda-fused", marks=CUDA),
    pytest.param("cuda", "layered", id="cuda-layered", marks=CUDA),  # on a side stream
]


def _optimizer(params, kind: str):
    return torch.optim.AdamW(params, lr=1e-2, fused=kind in ("fused", "layered"))


def _update(net, opt, device: str, kind: str) -> GuardedUpdate:
    """The trainer's update; "layered": the net's two linears as two layers (LayeredStep)."""
    layers = [list(net[0].parameters()), list(net[2].parameters())]
    update = GuardedUpdate(opt, torch.device(device), layers if kind == "layered" else None)
    assert (update.side is not None) == (kind == "layered")
    return update


def _net_and_optimizer(device: str, kind: str):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    net = net.to(device)
    return net, _optimizer(net.parameters(), kind)


def _backward(net, device: str, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 16, device=device)
    loss = net(x).square().mean()
    if poison:
        loss = loss * float("nan")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    return loss, norm


def _snapshot(net, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in net.parameters()]
    for state in opt.state.values():
        out += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize(("device", "kind"), CASES)
def test_a_non_finite_step_changes_nothing_and_a_finite_one_steps_as_plain_adamw(device, kind):
    net, opt = _net_and_optimizer(device, kind)
    update = _update(net, opt, device, kind)
    assert update.in_kernel == (kind != "plain")
    # A first real step, so that the moments and the step count exist and are non-zero.
    loss, norm = _backward(net, device)
    got = update(loss, norm)
    assert got[0] == pytest.approx(loss.item()) and got[1] == pytest.approx(norm.item())
    assert all(p.grad is None for p in net.parameters())  # dropped by the update
    before = _snapshot(net, opt)

    loss, norm = _backward(net, device, poison=True)
    got_loss, _ = update(loss, norm)
    assert all(p.grad is None for p in net.parameters())  # dropped by a skipped update too
    assert got_loss != got_loss  # NaN came back to the host
    after = _snapshot(net, opt)
    assert len(after) == len(before) and all(map(torch.equal, before, after))

    # A finite step after it: bitwise what a plain step() gives from the same state.
    plain_net = copy.deepcopy(net)
    plain_opt = _optimizer(plain_net.parameters(), kind)
    plain_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own moments
    torch.manual_seed(1)
    loss, norm = _backward(net, device)
    update(loss, norm)
    torch.manual_seed(1)
    _backward(plain_net, device)
    plain_opt.step()
    ours, plain = _snapshot(net, opt), _snapshot(plain_net, plain_opt)
    assert len(ours) == len(plain) and all(map(torch.equal, ours, plain))


@pytest.mark.parametrize(("device", "kind"), CASES)
def test_the_update_clips_as_clip_grad_norm_does(device, kind):
    """``update(loss, norm, max_norm)`` on unclipped gradients: the weights and moments of
    ``clip_grad_norm_`` and a plain step, bitwise on the host path; in the fused kernel the clip
    is a division by the coefficient's inverse, within fp32 rounding."""
    net, opt = _net_and_optimizer(device, kind)
    plain_net = copy.deepcopy(net)
    plain_opt = _optimizer(plain_net.parameters(), kind)
    update = _update(net, opt, device, kind)
    for seed in (1, 2):  # the second step runs on moments the first clipped step made
        torch.manual_seed(seed)
        loss = net(torch.randn(8, 16, device=device)).square().mean() * 100
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
        assert norm.item() > 0.05  # so that the clip below does clip
        update(loss, norm, 0.05)
        torch.manual_seed(seed)
        (plain_net(torch.randn(8, 16, device=device)).square().mean() * 100).backward()
        torch.nn.utils.clip_grad_norm_(plain_net.parameters(), 0.05)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        ours, plain = _snapshot(net, opt), _snapshot(plain_net, plain_opt)
        assert len(ours) == len(plain)
        if kind == "plain":
            assert all(map(torch.equal, ours, plain))
        else:
            for a, b in zip(ours, plain, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
