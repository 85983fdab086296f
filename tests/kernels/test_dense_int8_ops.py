"""The int8 dense layers' passes around the GEMM (kernels/dense_int8.py, csrc/yoso_cpu_quant.cpp): the C++
quantize and dequantize against a float64/int64 oracle written from the formula, bit for bit against the
PyTorch twin, a row's bits at any row count and thread count, and errors that name the limit."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import Int8Rows, LayerNormArgs, int8_linear, int8_linear_ref, int8_linear_rows


def weights(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return w, torch.rand(n, generator=gen) * 1e-2 + 1e-4, torch.randn(n, generator=gen)


def oracle(x, w, w_scale, bias, smooth=None, start=None):
    """From the formula, the integer product in int64: rows of x / smooth quantized by max|row| / 127."""
    rows = x.reshape(-1, x.shape[-1])
    if smooth is not None:
        rows = rows / smooth
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    q = torch.round(rows / scale).clamp(-127, 127).long()
    out = (q @ w.long().t()).double() * scale.double() * w_scale.double()
    if bias is not None:
        out = out + bias.double()
    if start is not None:
        out = out + start.reshape(out.shape).double()
    return out.reshape(*x.shape[:-1], w.shape[0])


@pytest.mark.parametrize("k,n", [(384, 1536), (1536, 384), (37, 5)])
@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_cpp_passes_match_the_pytorch_twin_bit_for_bit_and_the_oracle(ext, k, n, smoothed, with_start):
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(3, 41, k, generator=gen)
    x[..., 7 % k] *= 20  # an outlier channel, as a LayerNorm's output has
    w, w_scale, bias = weights(n, k)
    smooth = torch.exp2(torch.randint(-3, 4, (k,), generator=gen).float()) if smoothed else None
    start = torch.randn(3, 41, n, generator=gen) if with_start else None
    fast = int8_linear(x, w, w_scale, bias, smooth=smooth, start=start)
    ref = int8_linear_ref(x, w, w_scale, bias, smooth=smooth, start=start)
    assert fast.shape == (3, 41, n) and fast.dtype == torch.float32
    assert torch.equal(fast, ref)
    torch.testing.assert_close(fast.double(), oracle(x, w, w_scale, bias, smooth, start), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k,n", [(384, 1152), (37, 5)])
@pytest.mark.parametrize("with_start", [False, True])
def test_bf16_output_is_the_fp32_output_rounded_to_nearest_even(ext, k, n, with_start):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(2, 33, k, generator=gen)
    w, w_scale, bias = weights(n, k, seed=1)
    start = torch.randn(2, 33, n, generator=gen) if with_start else None
    wide = int8_linear(x, w, w_scale, bias, start=start)
    out = int8_linear(x, w, w_scale, bias, start=start, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 33, n)
    assert torch.equal(out, wide.bfloat16())
    assert torch.equal(out, int8_linear_ref(x, w, w_scale, bias, start=start, out_dtype=torch.bfloat16))
    acc = torch.tensor([[1, -1, 3, 0]], dtype=torch.int32)  # ties: 1 + 2^-8 and 1 + 3 * 2^-8 round to even
    ties = ext.dequantize_rows(acc, torch.ones(1, 1), torch.full((4,), 2.0 ** -8), torch.ones(4), None, False, True)
    assert ties.tolist() == [[1.0, 1.0 - 2.0 ** -8, 1.0 + 2.0 ** -6, 1.0]]
    with pytest.raises(ValueError, match="out_dtype must be torch.float32 or torch.bfloat16"):
        int8_linear(x, w, w_scale, bias, out_dtype=torch.float16)


def test_quantize_rows_rounds_half_to_even_clamps_and_keeps_zero_rows(ext):
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, scale = ext.quantize_rows(x, None)
    assert q.tolist() == [[127, 0, 2, -2, -127], [0, 0, 0, 0, 0]]
    assert scale[0, 0].item() == 1.0 and scale[1, 0].item() == pytest.approx(1e-12 / 127)
    # a row wide enough for the vector loops: every half rounds to even there too, as torch.round does, and the
    # ends stay at +-127
    halves = torch.arange(-126, 127, dtype=torch.float32) + 0.5
    wide = torch.cat([torch.tensor([127.0, -127.0]), halves, torch.tensor([126.9999, -126.9999])])[None]
    q, scale = ext.quantize_rows(wide, None)
    assert scale.item() == 1.0 and torch.equal(q[0].long(), torch.round(wide[0]).long())


def test_a_row_has_the_same_bits_at_any_row_count_and_thread_count(ext):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(900, 384, generator=gen)
    w, w_scale, bias = weights(1536, 384)
    smooth = torch.exp2(torch.randint(-2, 3, (384,), generator=gen).float())
    full = int8_linear(x, w, w_scale, bias, smooth=smooth)
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            for rows in (1, 2, 17, 300):
                assert torch.equal(int8_linear(x[:rows], w, w_scale, bias, smooth=smooth), full[:rows])
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_raise_errors_that_name_the_limit(ext):
    w, w_scale, bias = weights(8, 16)
    with pytest.raises(ValueError, match="weight's in = 16"):
        int8_linear(torch.randn(2, 15), w, w_scale, bias)
    with pytest.raises(ValueError, match=r"weight_scale must be \(8,\)"):
        int8_linear(torch.randn(2, 16), w, w_scale[:3], bias)
    with pytest.raises(RuntimeError, match=r"smooth must be \(K,\) = \(16,\)"):
        ext.quantize_rows(torch.randn(2, 16), torch.ones(15))
    q, scale = ext.quantize_rows(torch.randn(2, 16), None)
    acc = torch._int_mm(q, w.t())
    with pytest.raises(RuntimeError, match=r"start must be \(R, N\) = \(2, 8\)"):
        ext.dequantize_rows(acc, scale, w_scale, bias, torch.zeros(2, 9), False)
    with pytest.raises(RuntimeError, match=r"bias must be \(N,\) = \(8,\)"):
        ext.dequantize_rows(acc, scale, w_scale, torch.zeros(7), None, False)


def test_fused_gelu_is_within_1e7_of_atens_and_keeps_a_rows_bits_at_any_row_count(ext):
    x = torch.linspace(-12, 12, 24001).reshape(1, -1)
    identity = torch.ones(1, 1)
    acc = torch.round(x * 1000).int()  # acc * 1e-3 = x to the float: the epilogue's GELU of exactly those values
    out = ext.dequantize_rows(acc, identity * 1e-3, torch.ones(acc.shape[1]), None, None, True)
    plain = ext.dequantize_rows(acc, identity * 1e-3, torch.ones(acc.shape[1]), None, None, False)
    exact = torch.nn.functional.gelu(plain.double())
    assert ((out.double() - exact).abs() <= 2e-7 * plain.double().abs().clamp_min(1)).all()
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(300, 384, generator=gen)
    w, w_scale, bias = weights(1536, 384)
    full = int8_linear(xs, w, w_scale, bias, gelu=True)
    for rows in (1, 3, 77):
        assert torch.equal(int8_linear(xs[:rows], w, w_scale, bias, gelu=True), full[:rows])
    torch.testing.assert_close(full, int8_linear_ref(xs, w, w_scale, bias, gelu=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_requantize_rows_gives_the_bits_of_scaling_back_then_quantizing(ext, gelu, with_bias):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(301, 384, generator=gen)
    x[:, 11] *= 15
    x[5] = 0  # a zero row keeps the smallest scale, as quantize_rows gives it
    w, w_scale, bias = weights(1536, 384)
    bias = bias if with_bias else None
    q, scale = ext.quantize_rows(x, None)
    acc = torch._int_mm(q, w.t())
    q2, scale2 = ext.requantize_rows(acc, scale, w_scale, bias, gelu)
    want_q, want_scale = ext.quantize_rows(ext.dequantize_rows(acc, scale, w_scale, bias, None, gelu), None)
    assert q2.dtype == torch.int8 and q2.shape == (301, 1536) and scale2.shape == (301, 1)
    assert torch.equal(q2, want_q) and torch.equal(scale2, want_scale)
    for rows in (0, 1, 64):  # a row's bits at any row count; no rows at all
        part_q, part_scale = ext.requantize_rows(acc[:rows].contiguous(), scale[:rows].contiguous(), w_scale, bias,
                                                 gelu)
        assert torch.equal(part_q, q2[:rows]) and torch.equal(part_scale, scale2[:rows])
    empty_q, empty_scale = ext.requantize_rows(acc[:, :0].contiguous(), scale, w_scale[:0], None, gelu)
    assert empty_q.shape == (301, 0) and torch.equal(empty_scale, ext.quantize_rows(x[:, :0].contiguous(), None)[1])
    with pytest.raises(RuntimeError, match=r"scale must be \(R, 1\) = \(301, 1\)"):
        ext.requantize_rows(acc, scale[:300].contiguous(), w_scale, bias, gelu)
    with pytest.raises(RuntimeError, match=r"col_scale must be \(N,\) = \(1536,\)"):
        ext.requantize_rows(acc, scale, w_scale[:9].contiguous(), bias, gelu)


def test_a_layer_fed_int8_rows_gives_the_bits_of_the_two_layers_one_after_the_other(ext):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 70, 384, generator=gen)
    smooth = torch.exp2(torch.randint(-2, 3, (384,), generator=gen).float())
    w1, s1, b1 = weights(1536, 384, seed=1)
    w2, s2, b2 = weights(384, 1536, seed=2)
    rows = int8_linear_rows(x, w1, s1, b1, smooth=smooth, gelu=True)
    assert isinstance(rows, Int8Rows) and rows.shape == (2, 70, 1536)
    fused = int8_linear(rows, w2, s2, b2, start=x)
    apart = int8_linear(int8_linear(x, w1, s1, b1, smooth=smooth, gelu=True), w2, s2, b2, start=x)
    assert fused.shape == (2, 70, 384) and torch.equal(fused, apart)
    with pytest.raises(ValueError, match="takes no smoothing vector"):
        int8_linear(rows, w2, s2, b2, smooth=torch.ones(1536))
    with pytest.raises(ValueError, match="weight's in = 384"):
        int8_linear(rows, w1, s1, b1)
    assert int8_linear_rows(x.double(), w1, s1, b1) is None  # no C++ pass for it: the caller goes the long way


@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_in_the_scale_back_pass(ext, with_bias):
    """dequantize_rows with a LayerNorm's weight (and bias): nn.LayerNorm of the plain result to within float
    rounding, a row's bits at any row count, bf16 out as the fp32 result rounded; int8_linear's ``norm`` on both
    paths; bad arguments name the limit."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 150, 384, generator=gen)
    x[..., 11] *= 15
    start = torch.randn(2, 150, 384, generator=gen) * 4
    w, w_scale, bias = weights(384, 384, seed=3)
    nw, nb = torch.rand(384, generator=gen) + 0.5, (torch.randn(384, generator=gen) if with_bias else None)
    q, scale = ext.quantize_rows(x.reshape(-1, 384), None)
    acc, st = torch._int_mm(q, w.t()), start.reshape(-1, 384)
    plain = ext.dequantize_rows(acc, scale, w_scale, bias, st, False, False)
    normed = ext.dequantize_rows(acc, scale, w_scale, bias, st, False, False, nw, nb, 1e-12)
    want = torch.nn.functional.layer_norm(plain.double(), (384,), nw.double(), None if nb is None else nb.double(),
                                          1e-12)
    assert (normed.double() - want).abs().max() < 4e-6
    for rows in (1, 77):
        part = ext.dequantize_rows(acc[:rows].contiguous(), scale[:rows].contiguous(), w_scale, bias,
                                   st[:rows].contiguous(), False, False, nw, nb, 1e-12)
        assert torch.equal(part, normed[:rows])
    as_bf16 = ext.dequantize_rows(acc, scale, w_scale, bias, st, False, True, nw, nb, 1e-12)
    assert torch.equal(as_bf16.view(torch.int16), normed.bfloat16().view(torch.int16))
    args = LayerNormArgs(nw, nb, 1e-12)
    fused = int8_linear(x, w, w_scale, bias, start=start, norm=args)
    assert fused.shape == (2, 150, 384) and torch.equal(fused.reshape(-1, 384), normed)
    torch.testing.assert_close(fused, int8_linear_ref(x, w, w_scale, bias, start=start, norm=args),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(int8_linear(x, w, w_scale, bias, start=start, norm=args, backend="torch"), fused,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"norm_weight must be \(N,\) = \(384,\)"):
        ext.dequantize_rows(acc, scale, w_scale, bias, st, False, False, nw[:9].contiguous(), None, 1e-12)
    with pytest.raises(RuntimeError, match="norm_bias needs norm_weight"):
        ext.dequantize_rows(acc, scale, w_scale, bias, st, False, False, None, nw, 1e-12)
    with pytest.raises(RuntimeError, match="eps must be positive"):
        ext.dequantize_rows(acc, scale, w_scale, bias, st, False, False, nw, nb, 0.0)
    assert LayerNormArgs.of(torch.nn.LayerNorm(384, elementwise_affine=False)) is None
