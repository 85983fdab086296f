"""hash_codes / hash_codes_ref: range, twin agreement, sign-hash structure, seeding, bad input."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import hash_codes, hash_codes_ref
from yoso_serve.kernels import hashing

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = [pytest.param(True, id="fast"), pytest.param(False, id="gauss")]


def sylvester(size: int) -> torch.Tensor:
    """float64 unnormalised Walsh–Hadamard matrix, built by Sylvester's doubling."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


def oracle_projections(x, num_hashes, hash_bits, seed, fast_hash):
    """float64 (B, H, m, N, τ) projections, from the seeded draws and dense matrices.

    The rotation is built as the explicit product H·D3·H·D2·H·D1, independently of the
    butterfly in hashing.py.
    """
    batch, heads, length, dim = x.shape
    out = torch.empty(batch, heads, num_hashes, length, hash_bits, dtype=torch.float64)
    for head in range(heads):
        xh = x[:, head].double()
        if fast_hash:
            signs = hashing.rotation_signs(seed, head, num_hashes, hash_bits, dim).double()
            size = signs.shape[-1]
            walsh = sylvester(size)
            for h in range(num_hashes):
                d1, d2, d3 = (torch.diag(signs[h, r]) for r in range(3))
                rotation = walsh @ d3 @ walsh @ d2 @ walsh @ d1
                out[:, head, h] = xh @ rotation[:hash_bits, :dim].T
        else:
            planes = hashing.gaussian_planes(seed, head, num_hashes, hash_bits, dim).double()
            for h in range(num_hashes):
                out[:, head, h] = xh @ planes[h]
    return out


@pytest.mark.parametrize("fast_hash", FAMILIES)
@pytest.mark.parametrize(("length", "dim", "hash_bits"), [(1, 48, 8), (137, 48, 1), (37, 3, 16), (20, 130, 5)])
def test_codes_match_the_oracle_and_the_ref(oracles, fast_hash, length, dim, hash_bits):
    x, _, _ = oracles.random_qkv(2, 3, length, dim, seed=length + dim)
    args = dict(num_hashes=6, hash_bits=hash_bits, seed=11, fast_hash=fast_hash)
    codes = hash_codes(x, **args)
    ref = hash_codes_ref(x, **args)
    assert codes.dtype == ref.dtype == torch.int32 and codes.shape == ref.shape == (2, 3, 6, length)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**hash_bits
    proj = oracle_projections(x, **args)  # (B, H, m, N, τ)
    # A projection within rounding of zero may take either sign (for D < P some rotation
    # rows vanish on the first D coordinates: exactly 0 in one evaluation order, ±1e-8 in
    # another); every other bit is fixed by the seed.
    decisive = proj.abs() > 1e-4 * x.double().norm(dim=-1)[:, :, None, :, None]
    expected = proj > 0
    for got in (codes, ref):
        bits = (got[..., None] >> torch.arange(hash_bits)) & 1 == 1
        assert torch.equal(bits[decisive], expected[decisive])
    assert decisive.float().mean() > (0.75 if dim < 8 else 0.999)


@pytest.mark.parametrize("fast_hash", FAMILIES)
def test_sign_hash_structure(oracles, fast_hash):
    """A sign hash ignores positive scale, and negation flips every bit."""
    x, _, _ = oracles.random_qkv(1, 2, 64, 48, seed=3)
    args = dict(num_hashes=16, hash_bits=8, seed=5, fast_hash=fast_hash)
    codes = hash_codes(x, **args)
    assert torch.equal(hash_codes(4.0 * x, **args), codes)  # ×4 is exact in binary floating point
    assert torch.equal(hash_codes(-x, **args), 255 - codes)
    assert torch.equal(hash_codes(x.half(), **args), hash_codes(x.half().float(), **args))


@pytest.mark.parametrize("fast_hash", FAMILIES)
def test_projections_come_only_from_the_seed(oracles, fast_hash):
    x, _, _ = oracles.random_qkv(2, 2, 50, 32, seed=4)
    args = dict(num_hashes=8, hash_bits=8, seed=9, fast_hash=fast_hash)
    first = hash_codes(x, **args)
    torch.manual_seed(1234)  # the global RNG must play no part
    hashing._head_matrix.cache_clear()
    hashing.projection_planes.cache_clear()
    assert torch.equal(hash_codes(x, **args), first)
    assert not torch.equal(hash_codes(x, **{**args, "seed": 10}), first)


@pytest.mark.parametrize("fast_hash", FAMILIES)
def test_codes_do_not_depend_on_batch_or_length(oracles, fast_hash):
    x, _, _ = oracles.random_qkv(3, 2, 90, 48, seed=6)
    args = dict(num_hashes=8, hash_bits=8, seed=2, fast_hash=fast_hash)
    full = hash_codes(x, **args)
    assert torch.equal(hash_codes(x[1:2], **args), full[1:2])
    assert torch.equal(hash_codes(x[:, :, :17], **args), full[..., :17])


def test_heads_have_their_own_projections(oracles):
    x, _, _ = oracles.random_qkv(1, 1, 40, 32, seed=8)
    codes = hash_codes(x.expand(1, 2, 40, 32), num_hashes=8, hash_bits=8)
    assert (codes[0, 0] != codes[0, 1]).float().mean() > 0.5


def test_distinct_inputs_get_distinct_codes(oracles):
    """The codes are computed from the tensor given (the key-codes-for-both bug would fail)."""
    q, k, _ = oracles.random_qkv(1, 2, 60, 32, seed=1)
    args = dict(num_hashes=8, hash_bits=8)
    assert (hash_codes(q, **args) != hash_codes(k, **args)).float().mean() > 0.9


def test_rotation_signs_are_the_documented_shape():
    signs = hashing.rotation_signs(0, 0, num_hashes=4, hash_bits=8, dim=48)
    assert signs.shape == (4, 3, 64)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert hashing.padded_dim(3, 16) == 16 and hashing.padded_dim(130, 8) == 256


def test_walsh_hadamard_is_the_sylvester_matrix():
    assert torch.equal(hashing.walsh_hadamard(torch.eye(16, dtype=torch.float64)), sylvester(16))


@pytest.mark.parametrize("fn", [hash_codes, hash_codes_ref])
@pytest.mark.parametrize(
    ("x", "kwargs", "message"),
    [
        (torch.randn(2, 5, 8), {}, "rank 4"),
        (torch.randn(1, 1, 0, 8), {}, "N = 0"),
        (torch.randn(1, 1, 4, 0), {}, "D = 0"),
        (torch.randn(1, 1, 4, 8).int(), {}, "float32"),
        (torch.full((1, 1, 4, 8), float("nan")), {}, "NaN"),
        (torch.randn(1, 1, 4, 8), {"hash_bits": 0}, "hash_bits"),
        (torch.randn(1, 1, 4, 8), {"hash_bits": 17}, "hash_bits"),
        (torch.randn(1, 1, 4, 8), {"num_hashes": 0}, "num_hashes"),
        (torch.randn(1, 1, 4, 8), {"seed": 1.5}, "seed"),
    ],
)
def test_bad_input_is_a_value_error(fn, x, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(x, **{"num_hashes": 2, "hash_bits": 4, **kwargs})
