"""Int8 hashing (``int8=True`` / a model's ``hash_int8``): rows and planes quantized to int8, the sums
taken exactly in integers.

* the definition, pinned by hand: ``x8 = round_half_even((x / max|x|) · 127)``, a zero row stays zero,
  a bit is ``Σ x8·w > 0``;
* the C++ kernel (AVX-512 VNNI here), PyTorch's ``hash_codes`` and the readable ``hash_codes_ref`` give
  the same codes bit for bit, and so do the AVX2 and portable bodies (forced in subprocesses);
* the fused op equals those codes cumulated, for any thread count and for head-split views, and
  ``yoso_attention`` gives the same bits with and without autograd and on the PyTorch backend's codes;
* it is still LSH: collision rates follow (1 − θ/π)^τ, and codes differ from fp32 hashing's only rarely.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from yoso_serve.kernels import yoso_attention, yoso_attention_ref
from yoso_serve.kernels.hashing import (MAX_INT8_DIM, projection_planes, hash_codes, hash_codes_ref, int8_planes,
                                        quantize_rows)
from yoso_serve.kernels.yoso import _kernels

CPU = torch.device("cpu")

# (D, τ, m, N, fast): D not a multiple of 4 or 16, m·τ not a multiple of 16, τ = 1 and 16
CASES = [(32, 8, 32, 100, False), (64, 8, 32, 77, False), (17, 5, 7, 50, True), (5, 16, 3, 33, False),
         (32, 1, 9, 41, True), (100, 12, 5, 30, False), (48, 8, 3, 25, True)]


def awkward_rows(b: int, h: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Gaussian rows plus a zero row, a subnormal row, a huge row and a row of exact .5 ties."""
    x = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(seed))
    x[0, 0, 0] = 0.0
    x[-1, -1, 1] *= 1e-39
    x[-1, 0, 2] *= 1e30
    x[0, -1, 3] = torch.arange(d, dtype=torch.float32) % 4 - 1.5  # x / 1.5 · 127 lands on .5 often: ±63.5, ±127
    return x


def test_quantize_rows_is_round_half_even_of_the_scaled_row():
    x = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 1.5, 0.75, 0.1]])
    # 2 → 127; -1/2·127 = -63.5 → -64 (even); 0.5/2·127 = 31.75 → 32; -0.5·127 = -63.5 → -64 again
    expected = torch.tensor([[127.0, -64.0, 32.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-127.0, 64.0, 32.0, 4.0]])
    assert torch.equal(quantize_rows(x), expected)
    planes = int8_planes(torch.tensor([[[0.5, 0.0], [-1.0, 0.0], [0.25, 0.0]]]))  # (1, D=3, 2 columns)
    assert torch.equal(planes, torch.tensor([[[64.0, 0.0], [-127.0, 0.0], [32.0, 0.0]]]))  # 63.5 → 64, 31.75 → 32


def test_the_kernel_rounds_half_to_even_and_sums_exactly(ext):
    """x = (2, -1): x8 = (127, -64). Against w = (1, 2) the sum is -1 (bit 0); rounding -63.5 up to -63,
    or truncating it, would give +1; w = (-1, -2) gives +1 (bit 1); w = (64, 127) gives 0 (bit 0)."""
    x = torch.tensor([2.0, -1.0]).view(1, 1, 1, 2)
    w = torch.tensor([[1.0, -1.0, 64.0], [2.0, -2.0, 127.0]]).view(1, 2, 3)
    codes = ext.fast_hash_codes(x, w, 1, 3, True)
    assert codes.item() == 0b010
    assert torch.equal(codes, hash_codes_ref_planes(x, w, 3))


def hash_codes_ref_planes(x: torch.Tensor, w: torch.Tensor, bits: int) -> torch.Tensor:
    """The definition with explicit integer planes w (H, D, m·τ), in int64."""
    x8 = quantize_rows(x).long()  # (B, H, N, D)
    sums = torch.einsum("bhnd,hdc->bhnc", x8, w.long())
    b, h, n, _ = x.shape
    bit = (sums > 0).view(b, h, n, -1, bits).long()
    return (bit << torch.arange(bits)).sum(-1).permute(0, 1, 3, 2).int()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "d{}-tau{}-m{}-n{}-{}".format(*c[:4], "fast" if c[4] else "gauss"))
def test_cpp_torch_and_reference_codes_agree_bit_for_bit(ext, case):
    d, bits, m, n, fast = case
    x = awkward_rows(2, 3, n, d, seed=d + bits)
    args = dict(num_hashes=m, hash_bits=bits, seed=4, fast_hash=fast, int8=True)
    proj = projection_planes(4, 3, m, bits, d, fast, CPU, True)
    assert proj.abs().max() == 127 and torch.equal(proj, proj.round())
    cpp = ext.fast_hash_codes(x, proj, m, bits, True)
    assert torch.equal(cpp, hash_codes(x, **args))
    assert torch.equal(cpp, hash_codes_ref(x, **args))
    assert torch.equal(cpp, hash_codes_ref_planes(x, proj, bits))
    assert cpp.min() >= 0 and cpp.max() < 2 ** bits


def test_codes_move_only_near_zero_projections(ext):
    """Int8 codes differ from fp32 hashing's (same seed) only where a projection is within ~1 % of |x|·|w|."""
    x = torch.randn(1, 4, 2000, 32, generator=torch.Generator().manual_seed(1))
    args = dict(num_hashes=32, hash_bits=8, seed=0, fast_hash=False)
    changed = (hash_codes(x, **args, int8=True) != hash_codes(x, **args)).float().mean().item()
    assert 0.0 < changed < 0.04  # measured 0.018: ~0.24 % of bits, 8 bits a code


@pytest.mark.parametrize(("fast_hash", "dim"), [(False, 32), (True, 64)])
@pytest.mark.parametrize("hash_bits", [1, 8])
def test_int8_collision_rates_follow_the_formula(fast_hash, dim, hash_bits):
    """P[f(x) = f(y)] = (1 − θ/π)^τ within 3σ over 4000 hashes, as for fp32 hashing."""
    gen = torch.Generator().manual_seed(7 * dim + hash_bits)
    for angle in (math.pi / 8, math.pi / 4, math.pi / 2):
        a = torch.randn(dim, generator=gen, dtype=torch.float64)
        a /= a.norm()
        b = torch.randn(dim, generator=gen, dtype=torch.float64)
        b -= (b @ a) * a
        b /= b.norm()
        pair = torch.stack([a, math.cos(angle) * a + math.sin(angle) * b]).float()[None, None]
        codes = hash_codes(pair, num_hashes=4000, hash_bits=hash_bits, fast_hash=fast_hash, int8=True)
        expected = (1 - angle / math.pi) ** hash_bits
        rate = (codes[0, 0, :, 0] == codes[0, 0, :, 1]).double().mean().item()
        sigma = math.sqrt(expected * (1 - expected) / 4000)
        assert abs(rate - expected) <= 3 * sigma, f"θ={angle:.3f}: {rate:.4f} vs {expected:.4f}±{sigma:.4f}"


@pytest.mark.parametrize("dim", [32, 48])
def test_fused_int8_equals_its_codes_cumulated_for_any_threads_and_views(ext, dim):
    gen = torch.Generator().manual_seed(dim)
    q, k, v = (torch.randn(2, 137, 3, dim, generator=gen).transpose(1, 2) for _ in range(3))  # head-split views
    keep = torch.ones(2, 137, dtype=torch.bool)
    keep[1, 100:] = False
    proj = projection_planes(3, 3, 16, 8, dim, False, CPU, True)
    codes = [ext.fast_hash_codes(x.contiguous(), proj, 16, 8, True).masked_fill(~keep[:, None, None, :], -1)
             .view(6, 16, 137) for x in (q, k)]
    expected = ext.lsh_cumulate(*codes, v.contiguous().view(6, 137, dim), 8).view(2, 3, 137, dim)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            assert torch.equal(ext.lsh_attention(q, k, v, proj, keep, 16, 8, True), expected)
    finally:
        torch.set_num_threads(before)


def test_yoso_attention_int8_same_bits_fused_autograd_and_torch_codes(oracles):
    q, k, v = oracles.random_qkv(2, 3, 137, 32, seed=5)
    mask = oracles.lengths_mask([137, 90], 137)
    args = dict(num_hashes=8, hash_bits=8, seed=2, int8_hash=True)
    with torch.inference_mode():
        fused = yoso_attention(q, k, v, mask, backend="cpp", **args)
        plain = yoso_attention(q, k, v, mask, backend="cpp", num_hashes=8, hash_bits=8, seed=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.equal(fused, yoso_attention(*leaves, mask, backend="cpp", **args).detach())
    torch.testing.assert_close(yoso_attention(q, k, v, mask, backend="torch", **args), fused, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(yoso_attention_ref(q, k, v, mask, **args), fused, rtol=1e-5, atol=1e-6)
    assert not torch.equal(fused, plain)  # the setting reaches the kernel
    cpp_codes = _kernels("cpp", CPU).codes(q, 8, 8, 2, True, True)
    assert torch.equal(cpp_codes, _kernels("torch", CPU).codes(q, 8, 8, 2, True, True))


def test_planes_packed_once_give_the_same_bits_as_packed_per_call(ext):
    """pack_int8_planes(proj) is what kernels/yoso.py caches per projection; passing it skips the per-call
    validation and packing (about 0.3 ms, more than hashing a 512-token input)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 70, 48, generator=gen) for _ in range(3))
    proj = projection_planes(1, 3, 7, 6, 48, False, CPU, True)  # 42 columns: three 16-column groups, the last partial
    packed = ext.pack_int8_planes(proj)
    if ext.int8_level() == "avx512-vnni":
        assert packed[0].dtype == torch.int8 and packed[0].numel() == 3 * 48 * 48  # heads × 48 columns × D
        assert packed[1].dtype == torch.int32 and packed[1].numel() == 3 * 48
    else:  # the other bodies read proj itself
        assert packed[0].numel() == 0 and packed[1].numel() == 0
    assert torch.equal(ext.fast_hash_codes(q, proj, 7, 6, True, packed), ext.fast_hash_codes(q, proj, 7, 6, True))
    assert torch.equal(ext.lsh_attention(q, k, v, proj, None, 7, 6, True, packed),
                       ext.lsh_attention(q, k, v, proj, None, 7, 6, True))
    with pytest.raises(RuntimeError, match="packed must be \\[w8, offset\\] from pack_int8_planes\\(proj\\), got 1"):
        ext.fast_hash_codes(q, proj, 7, 6, True, packed[:1])
    if packed[0].numel():
        with pytest.raises(RuntimeError, match="packed must be pack_int8_planes\\(proj\\) for proj"):
            ext.lsh_attention(q, k, v, proj, None, 7, 6, True, [packed[0][:-1], packed[1]])
    with pytest.raises(RuntimeError, match="int8 hashing needs proj of integers"):
        ext.pack_int8_planes(proj + 0.5)


def test_bad_int8_input_names_the_limit(ext):
    x = torch.zeros(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match=re.escape("int8 hashing needs proj of integers in [-127, 127], got 0.5")):
        ext.fast_hash_codes(x, torch.full((1, 4, 8), 0.5), 1, 8, True)
    with pytest.raises(RuntimeError, match="got 128 at flat index 0"):
        ext.lsh_attention(x, x, x, torch.full((1, 4, 8), 128.0), None, 1, 8, True)
    big = MAX_INT8_DIM + 1
    with pytest.raises(RuntimeError, match=f"int8 hashing takes head dimensions D <= 1024, got D = {big}"):
        ext.fast_hash_codes(torch.zeros(1, 1, 2, big), torch.zeros(1, big, 8), 1, 8, True)
    with pytest.raises(ValueError, match=f"int8 hashing takes head dimensions D <= 1024, got D = {big}"):
        hash_codes(torch.ones(1, 1, 2, big), num_hashes=1, hash_bits=8, int8=True)


_BODIES = r"""
import sys, torch
from yoso_serve.kernels import _build
from yoso_serve.kernels.hashing import projection_planes
ext = _build.cpu_extension()
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 3, 137, 48, generator=gen) for _ in range(3))
q[0, 0, 0] = 0; q[1, 1, 5] = torch.arange(48.) % 4 - 1.5
keep = torch.ones(2, 137, dtype=torch.bool); keep[1, 100:] = False
proj = projection_planes(2, 3, 7, 6, 48, False, torch.device("cpu"), True)
odd = projection_planes(2, 3, 5, 3, 48, True, torch.device("cpu"), True)  # 15 columns
torch.save({"level": ext.int8_level(), "codes": ext.fast_hash_codes(q, proj, 7, 6, True),
            "odd": ext.fast_hash_codes(k, odd, 5, 3, True),
            "fused": ext.lsh_attention(q, k, v, proj, keep, 7, 6, True),
            "packed": ext.lsh_attention(q, k, v, proj, keep, 7, 6, True, ext.pack_int8_planes(proj))}, sys.argv[1])
"""


def test_every_int8_body_gives_the_same_bits(ext, tmp_path):
    """VNNI (where the CPU has it), AVX2 (an exact fp32 GEMM of the integers) and portable loops."""
    runs = {}
    for name, env in (("default", {}), ("avx2", {"YOSO_CPU_NO_VNNI": "1"}), ("portable", {"YOSO_CPU_PORTABLE": "1"})):
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _BODIES, str(path)], check=True, env={**os.environ, **env})
        runs[name] = torch.load(path)
    assert runs["portable"]["level"] == "portable"
    assert runs["avx2"]["level"] in ("avx2", "portable")
    assert runs["default"]["level"] in ("avx512-vnni", "avx2", "portable")
    for name in ("avx2", "portable"):
        for key in ("codes", "odd", "fused", "packed"):
            assert torch.equal(runs[name][key], runs["default"][key]), (name, key)
