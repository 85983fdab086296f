"""The fp32 sum of a bf16 dense layer's K-block outputs (kernels/dense_parts.py, csrc/yoso_cpu_parts.cpp): the
C++ pass bit for bit against the PyTorch twin and a float64 oracle's order, the residual left as it was, the
encoder's K-blocked layer giving the twin's bits, and errors that name the limit."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import dense_parts, sum_parts, sum_parts_ref


def parts_of(shape, count, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over decades, so the order of the additions shows in the low bits
    return [(torch.randn(shape, generator=gen) * 10 ** float(j % 3)).to(dtype) for j in range(count)]


@pytest.mark.parametrize("shape", [(1, 384), (7, 5), (300, 384), (2, 33, 96)])
@pytest.mark.parametrize("count", [1, 2, 4])
@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_parts_gives_the_twins_bits(ext, monkeypatch, shape, count, with_start, dtype):
    parts = parts_of(shape, count, dtype)
    start = torch.randn(shape, generator=torch.Generator().manual_seed(9)) * 100 if with_start else None
    want = sum_parts_ref(parts, start)
    monkeypatch.setattr(dense_parts, "sum_parts_ref", None)  # the C++ pass must not fall back
    got = sum_parts(parts, start)
    assert got.dtype == torch.float32 and got.shape == torch.Size(shape)
    assert torch.equal(got, want)
    # the order is the formula's: start first, then the parts one by one, each addition rounded to fp32
    acc = parts[0].float() if start is None else (start.double() + parts[0].double()).float()
    for part in parts[1:]:
        acc = (acc.double() + part.double()).float()  # a double sum of two floats, rounded once: fp32's addition
    assert torch.equal(got, acc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fn", [sum_parts, sum_parts_ref])
def test_sum_parts_leaves_the_residual_and_parts_as_they_were(ext, fn, dtype):
    parts, start = parts_of((64, 384), 3, dtype), torch.randn(64, 384)
    before = [p.clone() for p in parts], start.clone()
    for out in (fn(parts, start), fn(parts)):
        assert all(out.data_ptr() != t.data_ptr() for t in (start, *parts))
    assert all(torch.equal(a, b) for a, b in zip(parts, before[0])) and torch.equal(start, before[1])


def test_the_encoders_k_blocked_bf16_layer_sums_its_parts_as_the_twin(monkeypatch):
    """Linear.plus over K 1536 in bf16: the K-blocks' bf16 outputs summed after the residual by the C++ pass give
    the bits of the PyTorch ops it replaced."""
    from yoso_serve.model import linear

    if not linear.bf16_gemms():
        pytest.skip("this torch build or CPU has no oneDNN bf16 linear")
    monkeypatch.setattr(linear, "BF16_K_BLOCK", linear.BF16_SAFE_K)  # K-blocked, as with AMX
    torch.manual_seed(0)
    lin = linear.Linear(1536, 384)
    linear.set_dense_dtype(lin, "bf16")
    x, residual = torch.randn(2, 40, 1536), torch.randn(2, 40, 384)
    with torch.no_grad():
        got, fast = lin.plus(x, residual), lin(x)
        monkeypatch.setattr(linear, "sum_parts", sum_parts_ref)
        assert torch.equal(got, lin.plus(x, residual)) and torch.equal(fast, lin(x))


def test_sum_parts_errors_name_the_limit(ext):
    with pytest.raises(ValueError, match="at least one part"):
        sum_parts([])
    a = torch.zeros(3, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"every part must be \(R, N\) = \(3, 4\)"):
        ext.sum_parts([a, torch.zeros(3, 5, dtype=torch.bfloat16)], None)
    with pytest.raises(RuntimeError, match="every part must be BFloat16"):
        ext.sum_parts([a, torch.zeros(3, 4)], None)
    with pytest.raises(RuntimeError, match="parts must be BFloat16 or Float, got Half"):
        ext.sum_parts([a.half()], None)
    with pytest.raises(RuntimeError, match=r"start must be \(R, N\) = \(3, 4\)"):
        ext.sum_parts([a], torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match="start must be Float"):
        ext.sum_parts([a], torch.zeros(3, 4, dtype=torch.bfloat16))
