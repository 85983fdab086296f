"""Forward of yoso_attention: exact oracles, masks, determinism, dtypes, dispatch, bad input."""

from __future__ import annotations

import pytest
import torch
from yoso_testkit import random_codes

from yoso_serve.kernels import _build, hash_codes, yoso_attention, yoso_attention_ref
from yoso_serve.kernels import cumulate as cumulate_module
from yoso_serve.kernels import exact as exact_module
from yoso_serve.kernels.cumulate import lsh_cumulate, lsh_weighted_cumulate
from yoso_serve.kernels.hashing import quantize_rows

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = [pytest.param(True, id="fast"), pytest.param(False, id="gauss")]


@pytest.mark.parametrize(
    ("nq", "nk", "dv", "hash_bits"), [(137, 137, 48, 3), (1, 1, 5, 8), (29, 64, 7, 16), (64, 9, 48, 1)]
)
def test_lsh_cumulate_equals_the_dense_b_matrix(oracles, nq, nk, dv, hash_bits):
    q_codes = random_codes(1, 5, 7, nq, hash_bits)
    k_codes = random_codes(2, 5, 7, nk, hash_bits)
    v = torch.randn(5, nk, dv, generator=torch.Generator().manual_seed(3))
    expected = oracles.dense_collisions(q_codes, k_codes) @ v.double()  # (BH, Nq, Dv)
    got = lsh_cumulate(q_codes, k_codes, v, hash_bits)
    assert got.dtype == torch.float32 and got.shape == (5, nq, dv)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert not got[(q_codes < 0).all(1)].any()  # masked queries read zeros


@pytest.mark.parametrize(
    ("nq", "nk", "dw", "dv", "hash_bits"), [(137, 137, 48, 48, 4), (1, 3, 2, 5, 8), (40, 17, 6, 3, 16)]
)
def test_lsh_weighted_cumulate_equals_the_dense_formula(oracles, nq, nk, dw, dv, hash_bits):
    gen = torch.Generator().manual_seed(4)
    q_codes = random_codes(5, 3, 5, nq, hash_bits)
    k_codes = random_codes(6, 3, 5, nk, hash_bits)
    q_w = torch.randn(3, nq, dw, generator=gen)
    k_w, v = torch.randn(3, nk, dw, generator=gen), torch.randn(3, nk, dv, generator=gen)
    coupling = oracles.dense_collisions(q_codes, k_codes) * (q_w.double() @ k_w.double().transpose(1, 2))
    got = lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, hash_bits)
    torch.testing.assert_close(got.double(), coupling @ v.double(), rtol=1e-5, atol=1e-5)


def test_cumulations_do_not_depend_on_chunking(monkeypatch):
    q_codes, k_codes = random_codes(7, 6, 4, 33, 8), random_codes(8, 6, 4, 33, 8)
    gen = torch.Generator().manual_seed(9)
    q_w, k_w, v = (torch.randn(6, 33, 4, generator=gen) for _ in range(3))
    whole = lsh_cumulate(q_codes, k_codes, v, 8), lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, 8)
    monkeypatch.setattr(cumulate_module, "_CHUNK_BUDGET", 1)  # one (batch·head) row per chunk
    assert torch.equal(lsh_cumulate(q_codes, k_codes, v, 8), whole[0])
    assert torch.equal(lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, 8), whole[1])


def test_renumbered_tables_change_nothing():
    """With 2^τ + 1 > Nq + Nk the used buckets are renumbered: same codes, same bits out."""
    q_codes, k_codes = random_codes(10, 3, 5, 40, 4), random_codes(11, 3, 5, 30, 4)
    gen = torch.Generator().manual_seed(12)
    q_w = torch.randn(3, 40, 6, generator=gen)
    k_w, v = torch.randn(3, 30, 6, generator=gen), torch.randn(3, 30, 5, generator=gen)
    assert torch.equal(lsh_cumulate(q_codes, k_codes, v, 12), lsh_cumulate(q_codes, k_codes, v, 4))
    wide, narrow = (lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits) for bits in (12, 4))
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize(
    ("batch", "length", "dim", "hash_bits"), [(2, 137, 48, 8), (1, 1, 48, 8), (3, 17, 5, 2), (1, 64, 64, 16)]
)
def test_exact_mode_equals_the_naive_formula(oracles, batch, length, dim, hash_bits):
    q, k, v = oracles.random_qkv(batch, 3, length, dim, seed=length)
    mask = oracles.lengths_mask([max(1, length - 5 * b) for b in range(batch)], length)
    expected = oracles.naive_yoso_e(q, k, v, mask, hash_bits)
    for fn in (yoso_attention, yoso_attention_ref):
        got = fn(q, k, v, mask, exact=True, hash_bits=hash_bits, backend="torch")
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(yoso_attention(q, k, v, mask, num_hashes=0, hash_bits=hash_bits, backend="torch"), got)


def test_exact_mode_chunking_is_invisible(oracles, monkeypatch):
    q, k, v = oracles.random_qkv(2, 2, 50, 16, seed=12)
    whole = yoso_attention(q, k, v, exact=True, backend="torch")
    monkeypatch.setattr(exact_module, "_CHUNK_BUDGET", 1)  # one query row per chunk
    torch.testing.assert_close(yoso_attention(q, k, v, exact=True, backend="torch"), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fast_hash", FAMILIES)
@pytest.mark.parametrize(("length", "dim"), [(137, 48), (1, 48), (40, 7)])
def test_lsh_mode_equals_the_dense_reference(oracles, fast_hash, length, dim):
    q, k, v = oracles.random_qkv(2, 3, length, dim, seed=dim)
    mask = oracles.lengths_mask([length, max(1, length // 2)], length)
    args = dict(num_hashes=8, hash_bits=6, seed=3, fast_hash=fast_hash)
    got = yoso_attention(q, k, v, mask, backend="torch", **args)
    torch.testing.assert_close(got, yoso_attention_ref(q, k, v, mask, **args), rtol=1e-5, atol=1e-5)


def test_query_and_key_codes_come_from_their_own_inputs(oracles):
    q, k, v = oracles.random_qkv(1, 2, 80, 32, seed=21)
    args = dict(num_hashes=16, hash_bits=4, seed=0)
    unit = torch.nn.functional.normalize
    q_codes, k_codes = (hash_codes(unit(x, dim=-1), **args).view(2, 16, 80) for x in (q, k))
    flat_v = v.view(2, 80, 32)
    got = yoso_attention(q, k, v, backend="torch", **args).view(2, 80, 32)
    torch.testing.assert_close(got, lsh_cumulate(q_codes, k_codes, flat_v, 4), rtol=1e-6, atol=1e-6)
    key_codes_for_both = lsh_cumulate(k_codes, k_codes, flat_v, 4)
    assert (got - key_codes_for_both).abs().max() > 0.5


@pytest.mark.parametrize("exact", [True, False])
def test_padding_is_invisible(oracles, exact):
    """Padded keys contribute nothing, padded queries are zero, and batching changes nothing."""
    q, k, v = oracles.random_qkv(3, 2, 137, 48, seed=5)
    lengths = [137, 50, 1]
    mask = oracles.lengths_mask(lengths, 137)
    args = dict(num_hashes=16, hash_bits=8, seed=4, exact=exact, backend="torch")
    batched = yoso_attention(q, k, v, mask, **args)
    for b, n in enumerate(lengths):
        alone = yoso_attention(q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], **args)
        assert (batched[b : b + 1, :, :n] - alone).abs().max() <= 1e-6
        assert not batched[b, :, n:].any()
    garbage = mask[:, None, :, None]
    noisy = [torch.where(garbage, t, 1e3 * torch.randn_like(t)) for t in (q, k, v)]
    assert (yoso_attention(*noisy, mask.int(), **args) - batched).abs().max() <= 1e-6


@pytest.mark.parametrize("exact", [True, False])
def test_deterministic_across_calls(oracles, exact):
    q, k, v = oracles.random_qkv(2, 4, 100, 32, seed=8)
    args = dict(num_hashes=32, hash_bits=8, seed=7, exact=exact, backend="torch")
    first = yoso_attention(q, k, v, **args)
    torch.manual_seed(99)
    assert torch.equal(yoso_attention(q, k, v, **args), first)
    assert torch.equal(yoso_attention(q, k, v, **args), first)
    if not exact:
        assert not torch.equal(yoso_attention(q, k, v, **{**args, "seed": 8}), first)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_inputs_give_their_dtype_back(oracles, exact, dtype, tolerance):
    q, k, v = oracles.random_qkv(2, 2, 61, 48, seed=9)
    args = dict(num_hashes=16, hash_bits=8, exact=exact, backend="torch")
    low = [t.to(dtype) for t in (q, k, v)]
    got = yoso_attention(*low, **args)
    assert got.dtype == dtype and got.shape == q.shape
    # inside everything is fp32: the only extra error is the final rounding to dtype
    assert torch.equal(got, yoso_attention(*(t.float() for t in low), **args).to(dtype))
    if exact:  # against fp32 inputs the error is that of rounding q, k, v and the output
        reference = yoso_attention(q, k, v, **args)
        assert ((got.float() - reference).abs().max() / reference.abs().max()) < tolerance


class _CountingExtension:
    """Stands in for the C++ module: the torch ops, counted, with the binding's checks."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _check(codes, tensors):
        assert all(c.dtype == torch.int32 and c.is_contiguous() for c in codes)
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)

    def fast_hash_codes(self, x, proj, num_hashes, hash_bits, int8=False):
        self._check((), (x, proj))
        self.calls.append("fast_hash_codes")
        scores = torch.matmul(quantize_rows(x) if int8 else x, proj).view(*x.shape[:3], num_hashes, hash_bits) > 0
        weights = 1 << torch.arange(hash_bits, dtype=torch.int32)
        return (scores.to(torch.int32) * weights).sum(-1, dtype=torch.int32).permute(0, 1, 3, 2).contiguous()

    def lsh_cumulate(self, q_codes, k_codes, v, hash_bits):
        self._check((q_codes, k_codes), (v,))
        self.calls.append("lsh_cumulate")
        return lsh_cumulate(q_codes, k_codes, v, hash_bits)

    def lsh_weighted_cumulate(self, q_codes, k_codes, q_w, k_w, v, hash_bits):
        self._check((q_codes, k_codes), (q_w, k_w, v))
        self.calls.append("lsh_weighted_cumulate")
        return lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, hash_bits)


def test_dispatch_uses_the_extension_when_there_is_one(oracles, monkeypatch):
    fake = _CountingExtension()
    monkeypatch.setattr(_build, "cpu_extension", lambda: fake)
    # (B, N, H, D) seen as (B, H, N, D): a strided view, as a model's head split produces
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in oracles.random_qkv(1, 20, 2, 8, seed=1))
    expected = yoso_attention(q, k, v, backend="torch")
    assert fake.calls == []
    for backend in ("auto", "cpp"):
        fake.calls.clear()
        out = yoso_attention(q, k, v, backend=backend)
        out.sum().backward()
        assert torch.equal(out, expected)
        assert sorted(fake.calls) == ["fast_hash_codes"] * 2 + ["lsh_cumulate"] * 2 + ["lsh_weighted_cumulate"] * 2


def test_unavailable_backends_are_value_errors(oracles, monkeypatch):
    monkeypatch.setattr(_build, "cpu_extension", lambda: None)
    monkeypatch.setattr(_build, "backend_info", lambda: {"backend": "torch", "reason": "build failed (test)"})
    q, k, v = oracles.random_qkv(1, 1, 4, 8)
    torch.testing.assert_close(yoso_attention(q, k, v, backend="auto"), yoso_attention(q, k, v, backend="torch"))
    with pytest.raises(ValueError, match="'cpp' is not available: build failed"):
        yoso_attention(q, k, v, backend="cpp")
    with pytest.raises(ValueError, match="'cuda' is not available"):
        yoso_attention(q, k, v, backend="cuda", exact=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        yoso_attention(q, k, v, backend="gpu")


def _bad_cases():
    good = torch.randn(1, 2, 4, 8)
    nan = good.clone()
    nan[0, 1, 2, 3] = float("nan")
    inf = good.clone()
    inf[0, 0, 0, 0] = float("inf")
    return [
        ((good[0], good[0], good[0]), {}, "rank 4"),
        ((good, good[:, :, :3], good), {}, "same shape"),
        ((good, good, torch.randn(1, 2, 4, 6)), {}, "same shape"),
        ((good[:, :, :0], good[:, :, :0], good[:, :, :0]), {}, "N = 0"),
        ((good[..., :0], good[..., :0], good[..., :0]), {}, "D = 0"),
        ((good, good, good.half()), {}, "one dtype"),
        ((good, good, good.int()), {}, "float32"),
        ((nan, good, good), {}, "q contains NaN"),
        ((good, good, inf), {}, "v contains NaN or inf"),
        ((good.bfloat16(), nan.bfloat16(), good.bfloat16()), {}, "k contains NaN"),  # bf16 sums in its own dtype
        ((good.bfloat16(), good.bfloat16(), inf.bfloat16()), {}, "v contains NaN or inf"),
        ((good, good, good), {"hash_bits": 0}, "hash_bits"),
        ((good, good, good), {"hash_bits": 17}, "hash_bits"),
        ((good, good, good), {"num_hashes": -1}, "num_hashes"),
        ((good, good, good), {"seed": "0"}, "seed"),
        ((good, good, good, torch.ones(1, 5, dtype=torch.bool)), {}, "key_mask must have shape"),
        ((good, good, good, torch.full((1, 4), 2)), {}, "only 0 and 1"),
        ((good, good, good, [[1, 1, 1, 1]]), {}, "key_mask must be a torch.Tensor"),
    ]


def test_finite_values_whose_sum_overflows_are_accepted():
    """The finiteness check's one sum (bf16's in bf16) can overflow on finite values: the exact check then
    decides, so they pass."""
    q = torch.full((1, 2, 4, 8), 3e38).bfloat16()
    assert torch.isfinite(q).all() and not torch.isfinite(q.sum())
    yoso_attention(q, q, q, backend="torch", num_hashes=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_finiteness_check_reads_exactly_the_view(dtype):
    """all_finite (the check once the C++ module is loaded) flags NaN, inf and -inf anywhere in a strided
    (B, H, N, D) view, such as q sliced out of a fused (B, N, 3, H, D) projection, and nothing outside it; finite
    extremes (a sum that would overflow, subnormals) pass."""
    ext = _build.cpu_extension()
    if ext is None:
        pytest.skip("C++ extension not built")
    qkv = torch.randn(2, 70, 3, 5, 32).to(dtype)
    view = lambda t, i: t[:, :, i].transpose(1, 2)  # noqa: E731
    qkv[:, :, 1] = float("nan")  # k: all NaN; q and v beside it stay finite
    assert ext.all_finite(view(qkv, 0)) and ext.all_finite(view(qkv, 2)) and not ext.all_finite(view(qkv, 1))
    for where in [(0, 0, 0, 0), (1, 69, 4, 31), (1, 33, 2, 17)]:
        for bad in (float("nan"), float("inf"), float("-inf")):
            x = qkv.clone()
            x[(where[0], where[1], 0, where[2], where[3])] = bad
            assert not ext.all_finite(view(x, 0)), (where, bad)
            assert ext.all_finite(view(x, 2))
    big = torch.full((1, 2, 4, 8), 3e38).to(dtype)
    tiny = torch.full((1, 2, 4, 8), 1e-40).to(dtype)
    assert ext.all_finite(big) and ext.all_finite(tiny) and ext.all_finite(big[:, :, :0])
    q = view(qkv, 0).clone()
    q[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="q contains NaN or inf"):
        yoso_attention(q, view(qkv, 0), view(qkv, 2), num_hashes=2)


@pytest.mark.parametrize("fn", [yoso_attention, yoso_attention_ref])
@pytest.mark.parametrize(("args", "kwargs", "message"), _bad_cases())
def test_bad_input_is_a_value_error(fn, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(*args, backend="torch", **kwargs)



def _bad_cumulations():
    codes = torch.zeros(2, 3, 5, dtype=torch.int32)
    v = torch.randn(2, 5, 4)
    return [
        ((codes.long(), codes, v, 4), "q_codes must be"),
        ((codes, codes[:1], v, 4), "one BH"),
        ((codes, codes, v[:, :4], 4), "v must be"),
        ((codes, codes, v.double(), 4), "v must be"),
        ((codes, codes + 16, v, 4), "code ≥ 2\\*\\*hash_bits"),
        ((codes, codes, v, 17), "hash_bits"),
    ]


@pytest.mark.parametrize(("args", "message"), _bad_cumulations())
def test_bad_cumulation_input_is_a_value_error(args, message):
    with pytest.raises(ValueError, match=message):
        lsh_cumulate(*args)
    q_codes, k_codes, v, hash_bits = args
    with pytest.raises(ValueError, match=message):
        lsh_weighted_cumulate(q_codes, k_codes, torch.randn(2, 5, 3), torch.randn(2, 5, 3), v, hash_bits)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_out_dtype_and_the_forward_without_gradients(backend):
    """out_dtype picks the result's dtype (the N-YOSO core asks for fp32 before its norm); a bad
    one is a ValueError. The LSH forward without gradients (no q̂, k̂) equals the one with them."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 33, 16, generator=gen).half() for _ in range(3))
    args = dict(num_hashes=8, hash_bits=6, seed=3, backend=backend)
    with torch.no_grad():
        fast = yoso_attention(q, k, v, out_dtype=torch.float32, **args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    traced = yoso_attention(*leaves, out_dtype=torch.float32, **args)
    assert fast.dtype == traced.dtype == torch.float32
    torch.testing.assert_close(fast, traced.detach(), atol=1e-6, rtol=1e-6)
    assert yoso_attention(q, k, v, **args).dtype == torch.float16
    with pytest.raises(ValueError, match="out_dtype must be"):
        yoso_attention(q, k, v, out_dtype=torch.int32, **args)
