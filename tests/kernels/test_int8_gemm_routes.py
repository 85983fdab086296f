"""The int8 GEMM's two routes (kernels/dense_int8.py ``int8_mm``): ``torch._int_mm`` where the CPU has AVX-512
VNNI, oneDNN's u8 × s8 linear with ±63 weights on AVX2 CPUs (where ``_int_mm`` runs as plain loops). Both give
the exact integer product (an int64 oracle), a row's sums at any row count, and the route follows the CPU's flags;
weights past ±63 or a K too long for exact fp32 sums take ``_int_mm`` on either route."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import dense_int8, int8_linear, int8_linear_ref, int8_mm, int8_rows, weight_levels

ROUTES = ["int_mm", "u8s8"]


def operands(m, k, n, levels, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    q[:1, : min(k, 8)] = -128  # the one value per-row quantization never makes, still summed exactly
    return q, torch.randint(-levels, levels + 1, (n, k), generator=gen, dtype=torch.int8)


@pytest.fixture(params=ROUTES)
def route(request, monkeypatch):
    if request.param == "u8s8" and not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch has no onednn::qlinear_pointwise")
    monkeypatch.setattr(dense_int8, "INT8_GEMM", request.param)
    return request.param


def test_the_route_follows_the_cpu_flags():
    route = dense_int8.int8_gemm_route
    u8s8 = "u8s8" if hasattr(torch.ops.onednn, "qlinear_pointwise") else "int_mm"
    assert route(["fpu", "avx", "avx2", "fma"]) == u8s8  # AMD Zen 3, Intel Skylake client
    assert route(["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]) == "int_mm"  # Zen 4
    assert route(["avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"]) == "int_mm"  # Sapphire Rapids
    assert route(["sse4_2"]) == "int_mm" and route([]) == "int_mm"  # no AVX2, or flags unknown
    assert weight_levels() == (127 if dense_int8.INT8_GEMM == "int_mm" else 63)


@pytest.mark.parametrize("m,k,n", [(1, 384, 1152), (7, 384, 1536), (300, 1536, 384), (17, 37, 5), (3, 2080, 9)])
def test_each_route_gives_the_exact_integer_product_and_a_rows_sums_at_any_row_count(route, m, k, n):
    q, w = operands(m, k, n, weight_levels(), seed=m + k)
    exact = q.long() @ w.long().t()
    out = int8_mm(q, w)
    assert out.dtype == torch.int32 and torch.equal(out.long(), exact)
    for rows in (1, 2, m):
        assert torch.equal(int8_mm(q[:rows].contiguous(), w), out[:rows])


def test_weights_past_63_or_a_k_past_2080_take_int_mm_and_stay_exact(route):
    for k, levels in ((64, 127), (2081, 63)):
        q, w = operands(5, k, 6, levels, seed=k)
        assert torch.equal(int8_mm(q, w).long(), q.long() @ w.long().t())
    q, w = operands(5, 64, 6, 63, seed=1)
    w[2, 3] = -128  # past ±63 though its abs() (still -128 in int8) is not
    assert torch.equal(int8_mm(q, w).long(), q.long() @ w.long().t())
    q, w = operands(0, 16, 4, 63)
    assert int8_mm(q, w).shape == (0, 4)


def test_a_weight_changed_in_place_is_packed_again(route):
    q, w = operands(4, 32, 8, 63)
    first = int8_mm(q, w)
    w.neg_()
    assert torch.equal(int8_mm(q, w), -first)


def test_int8_linear_on_each_route_keeps_a_rows_bits_and_its_pytorch_twins():
    """The weights quantized to the route's levels; the C++ passes around the GEMM give the PyTorch twin's bits."""
    gen = torch.Generator().manual_seed(3)
    x, weight, bias = torch.randn(2, 33, 384, generator=gen), torch.randn(1536, 384, generator=gen), torch.randn(1536)
    x[..., 5] *= 20
    errors = {}
    for name in ROUTES:
        saved = dense_int8.INT8_GEMM
        dense_int8.INT8_GEMM = name
        try:
            wq, ws = int8_rows(weight, weight_levels())
            assert int(wq.abs().max()) == weight_levels()
            out = int8_linear(x, wq, ws[:, 0], bias)
            assert torch.equal(out, int8_linear_ref(x, wq, ws[:, 0], bias))
            assert torch.equal(int8_linear(x[1:, 4:9], wq, ws[:, 0], bias), out[1:, 4:9])
            errors[name] = ((out - torch.nn.functional.linear(x, weight, bias)).norm() / out.norm()).item()
        finally:
            dense_int8.INT8_GEMM = saved
    # the input's int8 step (its outlier channel) dominates: ±63 weights add little to the error
    assert errors["int_mm"] < 0.04 and errors["int_mm"] < errors["u8s8"] < 1.25 * errors["int_mm"], errors


def test_the_cpp_passes_read_fp32_sums_as_the_int32_ones_and_name_the_types_they_take(ext):
    """The u8 route's fp32 sums (exact integers) go to the C++ passes as they are: the bits of the int32 sums."""
    q, w = operands(37, 384, 1536, 63, seed=5)
    acc = q.long() @ w.long().t()
    gen = torch.Generator().manual_seed(6)
    scale, col = torch.rand(37, 1, generator=gen) * 1e-2, torch.rand(1536, generator=gen) * 1e-2
    bias = torch.randn(1536, generator=gen)
    start = torch.randn(37, 1536, generator=gen)
    for gelu, bf16 in ((False, False), (True, False), (False, True)):
        as_int = ext.dequantize_rows(acc.int(), scale, col, bias, start, gelu, bf16, None, None, 1e-12)
        assert torch.equal(ext.dequantize_rows(acc.float(), scale, col, bias, start, gelu, bf16, None, None, 1e-12),
                           as_int)
    norm = torch.rand(1536) + 0.5, torch.randn(1536)
    assert torch.equal(ext.dequantize_rows(acc.float(), scale, col, bias, None, False, False, *norm, 1e-12),
                       ext.dequantize_rows(acc.int(), scale, col, bias, None, False, False, *norm, 1e-12))
    for a, b in zip(ext.requantize_rows(acc.float(), scale, col, bias, True),
                    ext.requantize_rows(acc.int(), scale, col, bias, True)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="acc must be int32 or float32, got Long"):
        ext.dequantize_rows(acc, scale, col, bias, None, False, False, None, None, 1e-12)
