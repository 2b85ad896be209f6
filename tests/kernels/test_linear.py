"""The row-block linear operator (kernels/linear.py): outputs and gradients of the plain
F.linear per block, on the CPU in fp32 and float64 and on a GPU in bf16 with an fp32 weight (the
production path, its weight gradient written by cuBLAS in fp32); the operator's registration
(opcheck); compiled as eagerly; two backward calls bitwise equal; and the model's three products
taking it under the Triton backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from m3run.kernels.linear import linear_rows, linear_rows_bwd_op, linear_rows_op

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 path needs a CUDA GPU"),
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def plain(x, w, sizes, dtype):
    return [F.linear(x.to(dtype), w_i.to(dtype)) for w_i in w.split(sizes)]


def grads(fn, x, w, sizes, dtype, gys):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ys = fn(x, w, sizes, dtype)
    torch.autograd.backward(ys, gys)
    return [y.detach() for y in ys], x.grad, w.grad


def inputs(device, dtype, sizes, k=96, rows=(3, 37)):
    torch.manual_seed(0)
    x = torch.randn(*rows, k, device=device, dtype=dtype)
    w = (
        torch.randn(
            sum(sizes), k, device=device, dtype=torch.float32 if dtype != torch.float64 else dtype
        )
        / k**0.5
    )
    gys = [torch.randn(*rows, n, device=device, dtype=dtype) for n in sizes]
    return x, w, gys


@pytest.mark.parametrize("sizes", [[40], [64, 24, 8]], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "f64"])
def test_cpu_outputs_and_gradients_equal_the_plain_products(sizes, dtype):
    x, w, gys = inputs("cpu", dtype, sizes)
    got = grads(linear_rows, x, w, sizes, dtype, gys)
    want = grads(plain, x, w, sizes, dtype, gys)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip([*got[0], *got[1:]], [*want[0], *want[1:]], strict=True):
        assert a.dtype == b.dtype and rel(a, b) < tol


def test_cpu_a_lower_dtype_still_returns_the_weight_gradient_in_its_own():
    """On the CPU cuBLAS's fp32 output is not there: the product in bf16, then cast."""
    sizes = [16, 8]
    x, w, gys = inputs("cpu", torch.bfloat16, sizes, rows=(2, 5))
    ys, dx, dw = grads(linear_rows, x, w, sizes, torch.bfloat16, gys)
    assert [y.dtype for y in ys] == [torch.bfloat16] * 2 and dx.dtype == torch.bfloat16
    assert dw.dtype == torch.float32
    _, dx_p, dw_p = grads(plain, x, w, sizes, torch.bfloat16, gys)
    assert rel(dw, dw_p) < 1e-2 and rel(dx, dx_p) < 1e-2


def test_the_operators_pass_opcheck_and_compile_as_eagerly():
    sizes = [24, 8]
    x, w, gys = inputs("cpu", torch.float32, sizes, rows=(2, 7))
    torch.library.opcheck(linear_rows_op, (x, w, w, sizes))
    torch.library.opcheck(linear_rows_bwd_op, (x, w, w, gys, sizes))
    compiled = torch.compile(linear_rows, backend="aot_eager", fullgraph=True)
    got = grads(compiled, x, w, sizes, torch.float32, gys)
    want = grads(linear_rows, x, w, sizes, torch.float32, gys)
    for a, b in zip([*got[0], *got[1:]], [*want[0], *want[1:]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("sizes", "why"),
    [([40, 1], "summing to w's 40 rows"), ([0, 40], "positive"), ([], "summing")],
    ids=["too-many", "empty-block", "none"],
)
def test_row_blocks_that_do_not_tile_the_weight_are_refused(sizes, why):
    x, w, _ = inputs("cpu", torch.float32, [40])
    with pytest.raises(ValueError, match=why):
        linear_rows(x, w, sizes, torch.float32)


@pytest.mark.parametrize("sizes", [[2048], [4096, 240]], ids=["out_proj", "in_proj"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_gpu_bf16_with_an_fp32_weight_matches_autocast_and_is_deterministic(sizes, device):
    """In bf16 against float64 on the same bf16-rounded values: as accurate as F.linear under
    autocast, the weight gradient fp32 from the product; two backward calls bitwise equal."""
    k = 1024
    x, w, gys = inputs(device, torch.bfloat16, sizes, k=k, rows=(4, 512))
    got = grads(linear_rows, x, w, sizes, torch.bfloat16, gys)
    again = grads(linear_rows, x, w, sizes, torch.bfloat16, gys)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], again[1:], strict=True))
    assert got[2].dtype == torch.float32

    def autocast(x, w, sizes, dtype):
        with torch.autocast("cuda", torch.bfloat16):
            return plain(x, w, sizes, x.dtype)

    base = grads(autocast, x, w, sizes, torch.bfloat16, gys)
    exact = grads(
        plain, x.double(), w.bfloat16().double(), sizes, torch.float64, [g.double() for g in gys]
    )
    for name, g, b, e in zip(["dx", "dw"], got[1:], base[1:], exact[1:], strict=True):
        assert rel(g, e) <= 1.25 * rel(b, e) + 1e-6, (name, rel(g, e), rel(b, e))
    for y, e in zip(got[0], exact[0], strict=True):
        assert rel(y, e) < 1e-2


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_gpu_the_models_products_take_the_operator_under_the_triton_backend(device, monkeypatch):
    import m3run.kernels.linear as op
    from m3run.model.config import ModelConfig
    from m3run.model.lm import Block

    cfg = ModelConfig.preset("tiny", scan_backend="triton")
    torch.manual_seed(0)
    block = Block(cfg, 0).to(device)
    x = torch.randn(2, 128, cfg.d_model, device=device)
    pending = torch.randn(2, 128, cfg.d_model, device=device).bfloat16()
    calls = []
    real = op.linear_rows

    def counted(*args):
        calls.append(args[2])
        return real(*args)

    def plain(x, w, sizes, dtype):  # linear_rows' products without the operator
        return [F.linear(x, w_i) for w_i in w.split(sizes)]

    def run(on: bool):
        monkeypatch.setattr(op, "linear_rows", counted if on else plain)
        block.zero_grad()
        xi, pi = x.clone().requires_grad_(), pending.clone().requires_grad_()
        with torch.autocast(device, torch.bfloat16):
            s, out = block(xi, pi)
        (s.square().sum() + out.float().square().sum()).backward()
        return [s, out, xi.grad, pi.grad, *(p.grad.clone() for p in block.parameters())]

    fused = run(True)
    assert len(calls) == 3, calls  # in_proj (two blocks), out_proj, gate_up
    for a, b in zip(fused, run(False), strict=True):
        assert a.dtype == b.dtype and rel(a, b) < 2e-2
