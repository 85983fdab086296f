"""Shifted int8 rows (kernels/dense_int8.py ``shift``): an input that stays above -shift (FFN out's, GELU's output)
quantized as row + shift to [0, 127]. The C++ passes give the PyTorch twin's bits, the product is that of
``x + shift`` (a float64 oracle from the formula), the u8 route takes the rows as they are with ±127 weights and
sums them exactly (an int64 oracle, at the pairs' largest), and a row's bits do not depend on the row count."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import (Int8Rows, dense_int8, int8_linear, int8_linear_ref, int8_linear_rows, int8_rows,
                                int8_sums)

SHIFT = 0.17


def weights(n, k, levels=127, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-levels, levels + 1, (n, k), generator=gen, dtype=torch.int8)
    return w, torch.rand(n, generator=gen) * 1e-2 + 1e-4, torch.randn(n, generator=gen)


def gelu_like(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.gelu(torch.randn(*shape, generator=gen) * 2)


@pytest.fixture(params=["int_mm", "u8s8"])
def route(request, monkeypatch):
    if request.param == "u8s8" and not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch has no onednn::qlinear_pointwise")
    monkeypatch.setattr(dense_int8, "INT8_GEMM", request.param)
    return request.param


def test_shifted_rows_go_to_0_127_by_their_own_max_rounded_half_to_even(ext):
    x = torch.tensor([[127.0 - SHIFT, 0.5 - SHIFT, 1.5 - SHIFT, -SHIFT, -5.0], [0.0] * 5, [-1.0] * 5])
    q, scale = int8_rows(x, shift=SHIFT)
    assert q[0].tolist() == [127, 0, 2, 0, 0]  # ties to even; below -shift is 0
    assert scale[0, 0].item() == pytest.approx(1.0) and q[1].tolist() == [127] * 5
    assert q[2].tolist() == [0] * 5 and scale[2, 0].item() == pytest.approx(1e-12 / 127)  # all below: the floor
    for rows in (x, gelu_like(301, 1536)):
        cq, cscale = ext.quantize_rows(rows, None, SHIFT)
        pq, pscale = int8_rows(rows, shift=SHIFT)
        assert torch.equal(cq, pq) and torch.equal(cscale, pscale)
    smooth = torch.exp2(torch.randint(-2, 3, (1536,), generator=torch.Generator().manual_seed(1)).float())
    x = gelu_like(40, 1536, seed=2)
    pairs = zip(ext.quantize_rows(x, smooth, SHIFT), int8_rows(x / smooth, shift=SHIFT))
    assert all(torch.equal(a, b) for a, b in pairs)


def test_the_u8_route_sums_shifted_rows_exactly_with_127_weights_without_int_mm(route):
    gen = torch.Generator().manual_seed(3)
    for m, k, n in ((7, 1024, 384), (1, 384, 1536), (300, 1536, 384)):
        q = torch.randint(0, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        q[0], w[0], w[1] = 127, 127, -127  # every pair at 2 * 127 * 127, the most the 16-bit pair sums hold
        exact = q.long() @ w.long().t()
        with pytest.MonkeyPatch.context() as mp:
            if route == "u8s8":
                mp.setattr(torch, "_int_mm", None)  # the u8 route alone
            sums = int8_sums(q, w, shifted=True)
            for rows in (1, 2):
                assert torch.equal(int8_sums(q[:rows].contiguous(), w, shifted=True), sums[:rows])
        if route == "int_mm" or k * 127 * 127 < 2 ** 24:
            assert torch.equal(sums.long(), exact)
        else:  # past 2^24 one rounding to fp32, the same at any row count
            assert torch.equal(sums.double(), exact.double().float().double())


@pytest.mark.parametrize("with_start", [False, True])
def test_a_shifted_layer_is_the_product_of_x_plus_shift_with_the_twins_bits(ext, route, with_start):
    x = gelu_like(3, 41, 1536, seed=4)
    w, w_scale, bias = weights(384, 1536, seed=5)
    start = torch.randn(3, 41, 384) if with_start else None
    fast = int8_linear(x, w, w_scale, bias, start=start, shift=SHIFT)
    assert torch.equal(fast, int8_linear_ref(x, w, w_scale, bias, start=start, shift=SHIFT))
    rows = (x.reshape(-1, 1536) + SHIFT).double()
    scale = rows.amax(dim=1, keepdim=True) / 127
    want = (torch.round(rows / scale).clamp(0, 127) @ w.double().t()) * scale * w_scale.double() + bias.double()
    if start is not None:
        want = want + start.reshape(-1, 384).double()
    torch.testing.assert_close(fast.reshape(-1, 384).double(), want, rtol=1e-5, atol=1e-4)
    plain = torch.nn.functional.linear(x + SHIFT, w.float() * w_scale[:, None], bias)
    plain = plain if start is None else plain + start
    assert ((fast - plain).norm() / plain.norm()).item() < 0.01  # the step: max(row + shift) / 127
    for rows_n in (1, 17):
        assert torch.equal(int8_linear(x[1, :rows_n], w, w_scale, bias, start=None if start is None else
                                       start[1, :rows_n], shift=SHIFT), fast[1, :rows_n])


@pytest.mark.parametrize("with_bias", [False, True])
def test_requantize_with_a_shift_gives_the_bits_of_scaling_back_then_quantizing_shifted(ext, with_bias):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(257, 384, generator=gen)
    w, w_scale, bias = weights(1536, 384, seed=7)
    bias = bias if with_bias else None
    q, scale = ext.quantize_rows(x, None)
    acc = torch._int_mm(q, w.t())
    q2, scale2 = ext.requantize_rows(acc, scale, w_scale, bias, True, SHIFT)
    want = ext.quantize_rows(ext.dequantize_rows(acc, scale, w_scale, bias, None, True), None, SHIFT)
    assert torch.equal(q2, want[0]) and torch.equal(scale2, want[1]) and int(q2.min()) == 0
    x3 = x.reshape(1, 257, 384)
    w2, s2, b2 = weights(384, 1536, seed=8)
    rows = int8_linear_rows(x3, w, w_scale, bias, gelu=True, shift=SHIFT)
    assert isinstance(rows, Int8Rows) and rows.shifted and torch.equal(rows.q, q2)
    fused = int8_linear(rows, w2, s2, b2, start=x3[..., :384])
    apart = int8_linear(int8_linear(x3, w, w_scale, bias, gelu=True), w2, s2, b2, start=x3[..., :384], shift=SHIFT)
    assert torch.equal(fused, apart)
    with pytest.raises(ValueError, match="takes no smoothing vector or shift"):
        int8_linear(rows, w2, s2, b2, shift=SHIFT)
