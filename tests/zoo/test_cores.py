"""Each attention core against its readable twin, its exact special case and its padding contract."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.model.attention import REGISTRY, build_attention
from yoso_serve.model.attention.linear import linear_attention, linear_attention_ref
from yoso_serve.model.attention.linformer import linformer_attention, linformer_attention_ref
from yoso_serve.model.attention.nystrom import iterative_pinv, nystrom_attention, nystrom_attention_ref
from yoso_serve.model.attention.reformer import lsh_buckets, make_rotations, reformer_attention, reformer_attention_ref
from yoso_serve.model.attention.softmax import softmax_attention, softmax_attention_ref
from yoso_serve.model.attention.sparse import sparse_attention, sparse_attention_ref, sparse_mask
from yoso_serve.model.config import ATTENTION_TYPES

LENGTHS = [37, 20, 5]  # awkward sizes: not multiples of any block, chunk or segment size


def qkv(lengths=LENGTHS, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = max(lengths)
    q, k, v = (torch.randn(len(lengths), heads, n, dim, generator=gen) for _ in range(3))
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return q, k, v, mask


def pairs():
    """(name, fast op, readable twin) with the settings each takes."""
    proj = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) / 4
    proj_v = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) / 4
    rot = make_rotations(3, 3, 2, 8, 16)
    out = [
        ("softmax", softmax_attention, softmax_attention_ref),
        ("linear", linear_attention, linear_attention_ref),
        ("linformer", lambda q, k, v, m: linformer_attention(q, k, v, m, proj, proj_v),
         lambda q, k, v, m: linformer_attention_ref(q, k, v, m, proj, proj_v)),
    ]
    for bucket in (4, 8):
        out.append((f"reformer-c{bucket}", lambda q, k, v, m, c=bucket: reformer_attention(q, v, m, rot, bucket_size=c),
                    lambda q, k, v, m, c=bucket: reformer_attention_ref(q, v, m, rot, bucket_size=c)))
    for pattern in ("strided", "fixed"):
        for stride in (4, 16):
            kw = dict(pattern=pattern, stride=stride)
            out.append((f"sparse-{pattern}-{stride}", lambda q, k, v, m, kw=kw: sparse_attention(q, k, v, m, **kw),
                        lambda q, k, v, m, kw=kw: sparse_attention_ref(q, k, v, m, **kw)))
    for landmarks in (4, 8, 64):
        out.append((f"nystrom-{landmarks}", lambda q, k, v, m, n=landmarks: nystrom_attention(q, k, v, m, landmarks=n),
                    lambda q, k, v, m, n=landmarks: nystrom_attention_ref(q, k, v, m, landmarks=n)))
    return out


PAIRS = pairs()


def test_registry_holds_every_attention_type():
    assert sorted(REGISTRY) == sorted(ATTENTION_TYPES)


@pytest.mark.parametrize("name,fast,ref", PAIRS, ids=[p[0] for p in PAIRS])
def test_op_equals_its_readable_twin_with_padding(name, fast, ref):
    q, k, v, mask = qkv()
    out = fast(q, k, v, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref(q, k, v, mask), atol=2e-5, rtol=2e-5)
    rows = out.transpose(1, 2)  # (B, N, H, D): index by the (B, N) mask
    assert rows[~mask].abs().max() == 0  # padded query rows are zero
    assert rows[mask].abs().mean() > 0.05


@pytest.mark.parametrize("name,fast,ref", PAIRS, ids=[p[0] for p in PAIRS])
def test_text_alone_equals_text_in_padded_batch(name, fast, ref):
    q, k, v, mask = qkv()
    batched = fast(q, k, v, mask)
    for row, length in enumerate(LENGTHS):
        sl = (slice(row, row + 1), slice(None), slice(0, length))
        alone = fast(q[sl], k[sl], v[sl], None)
        torch.testing.assert_close(batched[sl], alone, atol=2e-5, rtol=2e-5)
    garbage = [x.clone() for x in (q, k, v)]
    for x in garbage:
        x.transpose(1, 2)[~mask] = 100.0  # what sits under the padding must not matter
    torch.testing.assert_close(fast(*garbage, mask), batched, atol=2e-5, rtol=2e-5)


def test_softmax_ref_is_the_textbook_formula():
    q, k, v, _ = qkv([9])
    weights = torch.exp(q @ k.transpose(-1, -2) / 8 ** 0.5)
    torch.testing.assert_close(softmax_attention_ref(q, k, v), weights @ v / weights.sum(-1, keepdim=True))


def test_linformer_with_identity_projections_is_softmax():
    q, k, v, _ = qkv([37, 37])
    eye = torch.eye(37, 64)  # k = N rows and E[:, :N] = F[:, :N] = I: nothing is compressed
    torch.testing.assert_close(linformer_attention(q, k, v, None, eye, eye), softmax_attention(q, k, v),
                               atol=1e-5, rtol=1e-5)


def test_linformer_rejects_inputs_longer_than_its_projections():
    q, k, v, _ = qkv([40])
    with pytest.raises(ValueError, match="exceeds the Linformer projection length 32"):
        linformer_attention(q, k, v, None, torch.randn(8, 32), torch.randn(8, 32))


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_sparse_patterns(pattern):
    mask = sparse_mask(32, pattern, 8)
    assert mask.diagonal().all()
    assert mask[20, 21] and mask[21, 20]  # bidirectional: no j <= i restriction
    if pattern == "strided":
        assert torch.equal(mask, mask.t())
        assert mask[20, 13] and mask[20, 27] and mask[20, 4] and not mask[20, 5]
    else:
        assert mask[20, 16] and mask[20, 23] and mask[20, 7] and not mask[20, 6]  # c = 1: summaries at 7, 15, …
    q, k, v, m = qkv()
    # a stride past the longest text makes both patterns full attention
    torch.testing.assert_close(sparse_attention(q, k, v, m, pattern=pattern, stride=64),
                               softmax_attention(q, k, v, m), atol=1e-5, rtol=1e-5)


def test_nystrom_with_a_landmark_per_token_is_softmax():
    q, k, v, mask = qkv()
    exact = nystrom_attention_ref(q, k, v, mask, landmarks=64, iterations=None)
    torch.testing.assert_close(exact, softmax_attention(q, k, v, mask), atol=1e-4, rtol=1e-4)


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    gen = torch.Generator().manual_seed(0)
    mat = torch.softmax(torch.randn(2, 16, 16, generator=gen), dim=-1).double()
    exact = torch.linalg.pinv(mat)
    errors = [(iterative_pinv(mat, n) - exact).norm().item() for n in (2, 6, 20)]
    assert errors[2] < errors[1] < errors[0]
    assert errors[2] < 1e-8 * exact.norm().item()


def test_reformer_rotations_are_seeded():
    q, _, v, mask = qkv([64], heads=2, dim=8)
    one, again = (reformer_attention(q, v, mask, make_rotations(5, 1, 2, 8, 8), bucket_size=8) for _ in range(2))
    assert torch.equal(one, again)
    other = reformer_attention(q, v, mask, make_rotations(6, 1, 2, 8, 8), bucket_size=8)
    assert not torch.allclose(one, other)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_cores_built_from_config_keep_shape_and_dtype(attention_type, kit):
    core = build_attention(kit.tiny_config(attention_type), seed=3).eval()
    q, k, v, mask = qkv(heads=4, dim=8)
    extra = {"hashes": 4} if core.uses_hashes else {}
    with torch.no_grad():
        out = core(q, k, v, mask, **extra)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all() and out.transpose(1, 2)[~mask].abs().max() == 0


def test_reformer_buckets_are_the_argmax_of_rotations_and_their_negation():
    q, _, _, _ = qkv([50], heads=2, dim=8)
    rot = make_rotations(9, 3, 2, 8, 16)
    scores = torch.einsum("bhnd,rhdc->bhrnc", q, rot[..., :7])  # ⌈50 / 8⌉ = 7 columns in use
    expected = torch.cat([scores, -scores], dim=-1).argmax(dim=-1)
    assert torch.equal(lsh_buckets(q, rot, torch.ones(1, 50, dtype=torch.bool), 8), expected)
    assert expected.unique().numel() > 8  # the tokens really spread over the 14 buckets


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_scratch_budgets_cut_the_work_without_changing_it(pattern, monkeypatch):
    """Sparse query-block groups and Reformer hashing slices, forced small, give the same numbers."""
    from yoso_serve.model.attention import reformer, sparse

    q, k, v, mask = qkv()
    whole = sparse_attention(q, k, v, mask, pattern=pattern, stride=4)
    rot = make_rotations(3, 2, 2, 8, 16)
    hashed = lsh_buckets(q, rot, mask, 4)
    monkeypatch.setattr(sparse, "_LOGIT_BUDGET", 64)  # one query block per group
    monkeypatch.setattr(reformer, "_HASH_BUDGET", 64)  # a few positions per hashing slice
    torch.testing.assert_close(sparse_attention(q, k, v, mask, pattern=pattern, stride=4), whole, atol=1e-6, rtol=0)
    assert torch.equal(lsh_buckets(q, rot, mask, 4), hashed)


@pytest.mark.parametrize("backend", ["torch", "auto", "cuda"])
@pytest.mark.parametrize("hashes", [0, 4])
def test_yoso_core_in_fp16_normalises_before_the_sum_can_overflow(kit, backend, hashes):
    """Keys that all collide sum N values: 600 of 128.0 is 76800, past fp16's 65504. The op's
    un-normalised B·V stays fp32 until N-YOSO's row norm, so the half-precision output is finite
    and equals the fp32 core's (before: inf, then NaN from the norm, at 4096 real tokens)."""
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    device = "cuda" if backend == "cuda" else "cpu"
    config = kit.tiny_config("yoso")
    config.attention_backend = backend
    core = build_attention(config, seed=3).eval()
    n, heads, dim = 600, 4, 8
    q = torch.ones(1, heads, n, dim, device=device)
    v = torch.full((1, heads, n, dim), 128.0, device=device)
    with torch.no_grad():
        expected = core(q, q, v, None, hashes=hashes)
        half = core(q.half(), q.half(), v.half(), None, hashes=hashes)
    assert half.dtype == torch.float16 and bool(torch.isfinite(half).all())
    torch.testing.assert_close(half.float(), expected, atol=2e-3, rtol=2e-3)
