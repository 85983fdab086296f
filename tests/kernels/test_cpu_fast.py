"""The extension's fused paths: ``lsh_attention`` (hashing + cumulation in one pass, inference)
and the blockwise YOSO-E kernels (``exact_forward`` / ``exact_backward``), against exact oracles.

* fused LSH: bit for bit ``lsh_cumulate(fast_hash_codes(q), fast_hash_codes(k), v)`` with masked
  codes, for any thread count; and ``yoso_attention`` gives the same bits with and without autograd.
* exact: the float64 closed form (forward, the paper's bound and the true derivative), the
  PyTorch twin, the polynomial arccos against ``torch.arccos`` within its stated error, and
  bit-identical results across thread counts.
* the portable (non-AVX2) bodies, forced by YOSO_CPU_PORTABLE=1 in a subprocess, against the
  same oracles.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from yoso_serve.kernels import yoso_attention
from yoso_serve.kernels.exact import ARCCOS_MAX_ERROR, MIN_SINE
from yoso_serve.kernels.hashing import projection_planes
from yoso_serve.kernels.yoso import _int8_packed


def masked_codes(ext, x, proj, m, bits, keep):
    codes = ext.fast_hash_codes(x, proj, m, bits)  # (B, H, m, N)
    if keep is not None:
        codes = codes.masked_fill(~keep[:, None, None, :], -1)
    return codes.view(-1, m, x.shape[2])


# (B, H, N, D, Dv, m, τ, padded tail): N = 1, 137, 300; D = 48, 7, 32, 64; τ = 1, 8, 12 (compact tables); padded tails
FUSED = [(2, 3, 137, 48, 48, 7, 6, 30), (1, 1, 1, 8, 8, 3, 8, 0), (1, 2, 300, 32, 17, 32, 8, 0),
         (2, 1, 90, 7, 5, 4, 12, 60), (3, 2, 64, 16, 16, 5, 1, 10),
         (2, 3, 300, 32, 32, 32, 8, 40), (1, 2, 70, 64, 64, 6, 10, 5)]  # Dv 32, 64: fixed-width bodies


@pytest.mark.parametrize("case", FUSED, ids=lambda c: "b{}-h{}-n{}-d{}-dv{}-m{}-tau{}-pad{}".format(*c))
def test_fused_lsh_equals_codes_then_cumulate_bit_for_bit(ext, case):
    b, h, n, d, dv, m, bits, pad = case
    gen = torch.Generator().manual_seed(n + d)
    q, k = (torch.randn(b, h, n, d, generator=gen) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=gen)
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[-1, n - pad :] = False
    proj = projection_planes(5, h, m, bits, d, True, torch.device("cpu"))
    for mask in (None, keep):
        got = ext.lsh_attention(q, k, v, proj, mask, m, bits)
        qc, kc = (masked_codes(ext, x, proj, m, bits, mask) for x in (q, k))
        expected = ext.lsh_cumulate(qc, kc, v.view(b * h, n, dv), bits).view(b, h, n, dv)
        assert torch.equal(got, expected)
    if pad:
        assert not got[-1, :, n - pad :].any()  # padded queries read zeros
        assert got[-1, :, : n - pad].abs().sum() > 0


@pytest.mark.parametrize("bh", [(1, 1), (2, 3)])
def test_fused_and_exact_bit_identical_across_thread_counts(ext, bh):
    """One thread, a team sharing one (batch*head), one thread per (batch*head): the same bits."""
    b, h = bh
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(b, h, 777, 40, generator=gen) for _ in range(3))
    keep = torch.rand(b, 777, generator=gen) > 0.1
    proj = projection_planes(1, h, 16, 8, 40, True, torch.device("cpu"))
    qh, kh = (torch.nn.functional.normalize(x, dim=-1).view(b * h, 777, 40) for x in (q, k))
    keep_f = keep.float()[:, None].expand(b, h, 777).reshape(b * h, 777).contiguous()
    grad = torch.randn(b * h, 777, 40, generator=gen)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 4, 2):
            torch.set_num_threads(threads)
            flat_v = v.view(b * h, 777, 40)
            results.append((ext.lsh_attention(q, k, v, proj, keep, 16, 8), ext.exact_forward(qh, kh, flat_v, keep_f, 8),
                            *ext.exact_backward(qh, kh, flat_v, keep_f, grad, 8, True, MIN_SINE)))
    finally:
        torch.set_num_threads(before)
    for result in results[1:]:
        for got, first in zip(result, results[0]):
            assert torch.equal(got, first)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "lsh"])
def test_a_row_gives_the_same_bits_alone_or_padded_in_a_batch(oracles, exact):
    """Padding after a text (a longer batch mate) changes none of its output bits: the exact kernel stops at
    each row's last real key and query, so its blocks are those of the text alone (before, the key tail's
    vector remainder moved results by ~1e-7, which bf16 dense layers amplified to ~1e-4 in an embedding)."""
    args = dict(exact=True, hash_bits=8) if exact else dict(num_hashes=8, hash_bits=8, seed=4)
    for length, padded in ((150, 300), (97, 1000), (256, 263), (1, 50)):
        q, k, v = oracles.random_qkv(2, 3, padded, 32, seed=length)
        mask = oracles.lengths_mask([padded, length], padded)
        with torch.inference_mode():
            batch = yoso_attention(q, k, v, mask, backend="cpp", **args)
            alone = yoso_attention(*(x[1:, :, :length] for x in (q, k, v)), mask[1:, :length], backend="cpp", **args)
        assert torch.equal(batch[1:, :, :length], alone), (length, padded)
        assert not batch[1:, :, length:].any()  # padded queries read zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_yoso_attention_same_bits_with_and_without_autograd(oracles, dtype):
    q, k, v = oracles.random_qkv(2, 3, 137, 48, seed=3, dtype=dtype)
    mask = oracles.lengths_mask([137, 100], 137)
    args = dict(num_hashes=8, hash_bits=6, seed=2, backend="cpp")
    with torch.inference_mode():
        fused = yoso_attention(q, k, v, mask, **args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.equal(fused, yoso_attention(*leaves, mask, **args).detach())
    assert fused.dtype == dtype


@pytest.mark.parametrize(("batch", "length", "dim", "hash_bits"), [(2, 137, 48, 8), (1, 1, 8, 4), (2, 300, 5, 16),
                                                                     (1, 513, 32, 1)])
def test_cpp_exact_forward_matches_the_float64_closed_form(oracles, batch, length, dim, hash_bits):
    q, k, v = oracles.random_qkv(batch, 2, length, dim, seed=length)
    mask = oracles.lengths_mask([length, max(1, length - 9)][:batch], length)
    expected = oracles.naive_yoso_e(q, k, v, mask, hash_bits)
    for backend in ("cpp", "torch"):
        for autograd in (False, True):  # the fused inference op, and the autograd Function's forward
            leaves = [t.clone().requires_grad_(autograd) for t in (q, k, v)]
            got = yoso_attention(*leaves, mask, exact=True, hash_bits=hash_bits, backend=backend).detach()
            torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5, msg=f"{backend} {autograd}")


def grads(q, k, v, mask, grad_out, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    yoso_attention(*leaves, mask, exact=True, **kwargs).backward(grad_out)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("exact_backward", ["bound", "true"])
@pytest.mark.parametrize(("length", "dim", "hash_bits"), [(137, 48, 8), (1, 8, 4), (300, 33, 3), (50, 16, 16)])
def test_cpp_exact_backward_matches_the_pytorch_twin_and_the_closed_form(oracles, exact_backward, length, dim,
                                                                        hash_bits):
    q, k, v = oracles.random_qkv(2, 2, length, dim, seed=length + 1)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    mask = oracles.lengths_mask([length, max(1, length - 7)], length)
    args = dict(hash_bits=hash_bits, exact_backward=exact_backward)
    got = grads(q, k, v, mask, grad_out, backend="cpp", **args)
    twin = grads(q, k, v, mask, grad_out, backend="torch", **args)
    if exact_backward == "bound":
        expected = oracles.naive_lower_bound_grads(q, k, v, mask, grad_out, hash_bits)
    else:  # autograd of the float64 closed form
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        qh, kh = (torch.nn.functional.normalize(t, dim=-1) for t in leaves[:2])
        weights = (1 - torch.arccos((qh @ kh.transpose(-1, -2)).clamp(-1, 1)) / math.pi) ** hash_bits
        keep = mask.double()
        ((weights * keep[:, None, None, :]) @ leaves[2] * keep[:, None, :, None]).backward(grad_out.double())
        expected = [t.grad for t in leaves]
    for name, g, t, e in zip("qkv", got, twin, expected):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-5, msg=f"grad {name} vs twin")
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5, msg=f"grad {name} vs closed form")
    assert not got[0][1, :, max(1, length - 7) :].any() or length == 1  # padded queries get no gradient


def test_polynomial_arccos_within_its_stated_error(ext):
    cosines = torch.cat([torch.linspace(-1, 1, 200_001), torch.tensor([-1.0, -0.0, 0.0, 1.0, 1 - 2**-24, -1 + 2**-24])])
    probability = ext.collision_probability(cosines, 1)  # 1 − θ/π
    theta = math.pi * (1 - probability.double())
    truth = torch.arccos(cosines.double())
    # the stated polynomial error plus fp32 rounding of θ/π and of 1 − θ/π (a few ulp of 1, times π)
    assert (theta - truth).abs().max().item() <= ARCCOS_MAX_ERROR + 4 * math.pi * 2**-24
    assert (ext.collision_probability(torch.tensor([1.5, -3.0]), 8) == torch.tensor([1.0, 0.0])).all()  # clamped
    tau8 = ext.collision_probability(cosines, 8).double()
    torch.testing.assert_close(tau8, (1 - truth / math.pi) ** 8, rtol=2e-6, atol=1e-7)


def test_new_bindings_name_the_limit(ext):
    q = torch.zeros(1, 2, 5, 8)
    proj = torch.zeros(2, 8, 12)
    with pytest.raises(RuntimeError, match=re.escape("proj must be (H, D, num_hashes*hash_bits) = (2, 8, 12)")):
        ext.lsh_attention(q, q, q, proj[:1].contiguous(), None, 3, 4)
    with pytest.raises(RuntimeError, match=re.escape("keep must be (B, N) = (1, 5)")):
        ext.lsh_attention(q, q, q, proj, torch.ones(1, 4, dtype=torch.bool), 3, 4)
    with pytest.raises(RuntimeError, match="keep must be Bool"):
        ext.lsh_attention(q, q, q, proj, torch.ones(1, 5), 3, 4)
    with pytest.raises(RuntimeError, match="hash_bits must be in 1..16"):
        ext.lsh_attention(q, q, q, torch.zeros(2, 8, 51), None, 3, 17)
    flat, keep = torch.zeros(2, 5, 8), torch.ones(2, 5)
    with pytest.raises(RuntimeError, match=re.escape("keep must be (BH, N) = (2, 5)")):
        ext.exact_forward(flat, flat, flat, torch.ones(2, 4), 8)
    with pytest.raises(RuntimeError, match="v must be \\(BH, N, Dv\\)"):
        ext.exact_forward(flat, flat, torch.zeros(2, 4, 8), keep, 8)
    with pytest.raises(RuntimeError, match="grad must have v's shape"):
        ext.exact_backward(flat, flat, flat, keep, torch.zeros(2, 5, 7), 8, False, 1e-3)
    with pytest.raises(RuntimeError, match="q must be contiguous"):
        ext.exact_forward(torch.zeros(2, 8, 5).transpose(1, 2), flat, flat, keep, 8)


_PORTABLE = r"""
import json, torch
from yoso_serve.kernels import _build
from yoso_serve.kernels.hashing import projection_planes
ext = _build.cpu_extension()
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 3, 137, 48, generator=gen) for _ in range(3))
keep = torch.ones(2, 137, dtype=torch.bool); keep[1, 100:] = False
proj = projection_planes(2, 3, 7, 6, 48, True, torch.device("cpu"))
qh, kh = (torch.nn.functional.normalize(x, dim=-1).view(6, 137, 48) for x in (q, k))
keep_f = keep.float()[:, None].expand(2, 3, 137).reshape(6, 137).contiguous()
grad = torch.randn(6, 137, 48, generator=gen)
codes = [ext.fast_hash_codes(x, proj, 7, 6).masked_fill(~keep[:, None, None, :], -1).view(6, 7, 137) for x in (q, k)]
torch.save({"cumulated": ext.lsh_cumulate(*codes, v.view(6, 137, 48), 6).view(2, 3, 137, 48),"level": ext.simd_level(), "codes": ext.fast_hash_codes(q, proj, 7, 6),
            "fused": ext.lsh_attention(q, k, v, proj, keep, 7, 6),
            "exact": ext.exact_forward(qh, kh, v.view(6, 137, 48), keep_f, 8),
            "grads": ext.exact_backward(qh, kh, v.view(6, 137, 48), keep_f, grad, 8, True, 1e-3)}, __import__("sys").argv[1])
"""


def test_portable_bodies_agree_with_the_avx2_ones(ext, tmp_path):
    """Forced portable loops (what a CPU without AVX2 runs) give the same codes and close floats."""
    results = {}
    for level, env in (("default", {}), ("portable", {"YOSO_CPU_PORTABLE": "1"})):
        path = tmp_path / f"{level}.pt"
        subprocess.run([sys.executable, "-c", _PORTABLE, str(path)], check=True, env={**os.environ, **env})
        results[level] = torch.load(path)
    assert results["portable"]["level"] == "portable"
    fast, slow = results["default"], results["portable"]
    differ = (fast["codes"] != slow["codes"]).float().mean().item()
    assert differ < 1e-3  # codes may differ only where a projection lies within rounding of zero
    for run in (fast, slow):  # each body's fused op equals its own codes, then cumulated
        assert torch.equal(run["fused"], run["cumulated"])
    torch.testing.assert_close(slow["exact"], fast["exact"], rtol=1e-4, atol=1e-5)
    for got, expected in zip(slow["grads"], fast["grads"]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [5, 13, 32, 40])  # the row norms sum 8 lanes then a tail: below, at and past 8
def test_exact_attention_normalises_raw_rows_like_its_oracle(ext, oracles, dim):
    """exact_attention takes raw q, k (any scale, strided head-split views), makes unit rows and the
    transposed keys itself, and equals the oracle on unit rows and exact_forward on pre-normalised ones."""
    gen = torch.Generator().manual_seed(dim)
    q, k, v = (torch.randn(2, 61, 3, dim, generator=gen).transpose(1, 2) for _ in range(3))
    q, k = q * 7.5, k * 0.01  # the scale of a row never reaches the collision probability
    keep = oracles.lengths_mask([61, 40], 61)
    got = ext.exact_attention(q, k, v, keep, 8)
    expected = oracles.naive_yoso_e(q, k, v, keep, 8)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    unit = [torch.nn.functional.normalize(t, dim=-1).reshape(6, 61, dim).contiguous() for t in (q, k)]
    keep_rows = keep[:, None, :].expand(2, 3, 61).reshape(6, 61).float()
    flat = ext.exact_forward(*unit, v.reshape(6, 61, dim).contiguous(), keep_rows, 8)
    torch.testing.assert_close(got.reshape(6, 61, dim), flat, rtol=1e-4, atol=1e-5)  # rounding of the norms only


@pytest.mark.parametrize("dim", [48, 32])  # 32: the cumulation's fixed-width body, reading strided values
def test_fused_ops_read_head_split_views_and_write_merged_heads(ext, oracles, dim):
    """(B, H, N, D) views of (B, N, H, D) memory go in without copies; the output is such a view,
    so merging heads is free; values equal those of contiguous inputs (and YOSO-E its oracle)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 137, 3, dim, generator=gen).transpose(1, 2) for _ in range(3))
    keep = oracles.lengths_mask([137, 90], 137)
    proj = projection_planes(3, 3, 8, 6, dim, True, torch.device("cpu"))
    dense = [t.contiguous() for t in (q, k, v)]
    for run in (lambda *x: ext.lsh_attention(*x, proj, keep, 8, 6), lambda *x: ext.exact_attention(*x, keep, 8)):
        got = run(q, k, v)
        assert got.shape == (2, 3, 137, dim) and got.transpose(1, 2).is_contiguous()
        assert torch.equal(got, run(*dense))
    expected = oracles.naive_yoso_e(q, k, v, keep, 8)
    torch.testing.assert_close(ext.exact_attention(q, k, v, keep, 8).double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="q must have unit stride along D"):
        ext.exact_attention(q.transpose(2, 3), k.transpose(2, 3), v, keep, 8)


@pytest.mark.parametrize("length", [1, 61, 137, 300])  # one query block, several, and past one key block (256)
@pytest.mark.parametrize("dim", [32, 13])
def test_fused_ops_read_bf16_as_its_fp32_values_and_exact_writes_every_row(ext, oracles, length, dim):
    """bf16 q, k, v (head-split views, as the bf16 projections give them) give the bits of their fp32 copies in
    both fused ops (LSH with fp32 and int8 hashing; exact where it has no bf16 dot products); exact's output is not cleared first, so every row, padded
    ones as zeros, must be written."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(3, length, 4, dim, generator=gen).bfloat16().transpose(1, 2) for _ in range(3))
    keep = oracles.lengths_mask([length, max(1, length // 2), max(1, length - 3)], length)
    keep[2, 0] = False  # a hole before the last real token
    for _ in range(3):
        torch.full((3, length, 4, dim), float("nan"))  # freed memory the next output may reuse
        got = ext.exact_attention(q, k, v, keep, 8)
        wide = ext.exact_attention(q.float(), k.float(), v.float(), keep, 8)
        if ext.bf16_dots() and dim % 2 == 0:  # bf16 dot products (test_exact_bf16.py): within fp32 rounding
            torch.testing.assert_close(got, wide, rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(got, wide)
        assert not got.isnan().any() and (got[~keep[:, None, :].expand(3, 4, length)] == 0).all()
    proj = projection_planes(5, 4, 6, 8, dim, True, torch.device("cpu"))
    wide = [t.float() for t in (q, k, v)]
    assert torch.equal(ext.lsh_attention(q, k, v, proj, keep, 6, 8), ext.lsh_attention(*wide, proj, keep, 6, 8))
    proj8, packed = _int8_packed(ext, 5, 4, 6, 8, dim, True)  # int8 hashing
    assert torch.equal(ext.lsh_attention(q, k, v, proj8, keep, 6, 8, True, packed),
                       ext.lsh_attention(*wide, proj8, keep, 6, 8, True, packed))
    with pytest.raises(RuntimeError, match="k must be BFloat16, got Float"):
        ext.exact_attention(q, k.float(), v, keep, 8)
    with pytest.raises(RuntimeError, match="v must be Float, got BFloat16"):
        ext.exact_attention(q.float(), k.float(), v, keep, 8)
