"""The CUDA kernels (kernels/csrc/yoso_cuda.cu) against the pure-PyTorch ops and dense oracles.

Runs only where torch sees a GPU (marker ``cuda``; skipped cleanly elsewhere). On such a
machine the CUDA extension ships with the project, so a failed build FAILS these tests.
Matrix: exact-oracle equality for fixed codes on every table path (shared memory; sorted, for
deterministic mode or τ ≥ 11, with packed tables when Nk < 2^τ; hash groups), the weighted
cumulation on both of its bucket schemes, fp16/bf16 inputs, masks, batch invariance (also above
the scratch budget), bit-identical deterministic mode, out-of-range codes with and without the
check, no host sync (sync debug mode, CUDA-graph capture), the hash kernels (the rotation equals
hash_codes_ref bit for bit), expectation convergence, gradients through
yoso_attention(backend="cuda") in fp32/fp16/bf16, and compute-sanitizer on a small case.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from yoso_testkit import close, random_codes

from yoso_serve.kernels import _build, hash_codes, hash_codes_ref, hashing, yoso_attention, yoso_attention_ref
from yoso_serve.kernels.cumulate import lsh_cumulate, lsh_weighted_cumulate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def ext():
    loader = getattr(_build, "cuda_extension", None)
    if loader is None:
        pytest.fail("kernels._build has no cuda_extension(): the CUDA build is not wired (docs/cuda.md)")
    module = loader()
    if module is None:
        pytest.fail(f"the CUDA extension must build on a GPU machine: {_build.backend_info()}")
    return module


def cuda(*tensors):
    return tuple(t.cuda() for t in tensors)


# (BH, m, Nq, Nk, Dv, hash_bits, masked fraction). τ ≤ 10: shared-memory tables; τ = 13 and 16:
# sorted tables packed to Nk rows (Nk < 2^τ); τ = 11 with Nk > 2^τ: sorted, one row per bucket;
# τ = 16 with m = 9: global sort cursors;
# N = 1, 137 (no multiple of 8), Dv = 33, 48, 200 (> 128 columns per lane loop).
CUMULATE_CASES = [
    (1, 1, 1, 1, 1, 1, 0.0),
    (3, 4, 137, 129, 48, 8, 0.2),
    (2, 3, 1, 300, 64, 4, 0.0),
    (2, 5, 64, 64, 200, 2, 0.3),
    (1, 2, 257, 513, 33, 13, 0.1),
    (1, 2, 100, 3000, 16, 11, 0.1),
    (2, 9, 50, 70, 64, 16, 0.0),
    (1, 7, 5, 300, 48, 3, 0.9),
]
IDS = "bh{}-m{}-nq{}-nk{}-dv{}-tau{}-mask{}".format


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CUMULATE_CASES, ids=lambda c: IDS(*c))
def test_cumulate_equals_torch_op_for_fixed_codes(ext, case, deterministic):
    bh, m, nq, nk, dv, bits, mask = case
    gen = torch.Generator().manual_seed(hash(case) & 0xFFFF)
    q_codes, k_codes = random_codes(gen, bh, m, nq, bits, mask), random_codes(gen, bh, m, nk, bits, mask)
    v = torch.randn(bh, nk, dv, generator=gen)
    out = ext.lsh_cumulate_cuda(*cuda(q_codes, k_codes, v), bits, deterministic)
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == (bh, nq, dv)
    close(out, lsh_cumulate(q_codes, k_codes, v, bits))
    assert bool((out.cpu()[(q_codes < 0).all(1)] == 0).all())  # masked queries read zeros


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cumulate_half_inputs_accumulate_in_fp32(ext, dtype):
    gen = torch.Generator().manual_seed(11)
    q_codes, k_codes = random_codes(gen, 2, 8, 300, 3, 0.1), random_codes(gen, 2, 8, 400, 3, 0.1)
    v = torch.randn(2, 400, 64, generator=gen).to(dtype)
    out = ext.lsh_cumulate_cuda(*cuda(q_codes, k_codes, v), 3, False)
    assert out.dtype == torch.float32
    # Inputs convert exactly; ~50 keys per bucket would lose digits if summed in half precision.
    close(out, lsh_cumulate(q_codes, k_codes, v.float(), 3))


# (BH, m, Nq, Nk, Dw, Dv, hash_bits, masked fraction). τ = 8, N ≈ 300: buckets of ~1 key
# (pairwise scheme); τ = 2, N = 2000: buckets of ~500 (Dw×Dv table scheme, Dv split into
# passes of 64 columns when Dv = 72); τ = 1 with 400 queries and 12 keys: pairwise buckets of ~200
# queries (several query tiles), Dw and Dv no multiple of 4; Dw = 500: tables never fit, pairwise
# from global memory everywhere.
WEIGHTED_CASES = [
    (1, 1, 1, 1, 1, 1, 1, 0.0),
    (2, 3, 137, 300, 48, 48, 8, 0.2),
    (2, 3, 2000, 1800, 64, 64, 2, 0.1),
    (1, 2, 700, 900, 40, 72, 1, 0.0),
    (1, 2, 400, 12, 30, 26, 1, 0.0),
    (1, 2, 300, 200, 500, 16, 2, 0.0),
    (2, 9, 60, 80, 16, 16, 16, 0.3),
]


W_IDS = "bh{}-m{}-nq{}-nk{}-dw{}-dv{}-tau{}-mask{}".format


@pytest.mark.parametrize("case", WEIGHTED_CASES, ids=lambda c: W_IDS(*c))
def test_weighted_cumulate_equals_torch_op_for_fixed_codes(ext, case):
    bh, m, nq, nk, dw, dv, bits, mask = case
    gen = torch.Generator().manual_seed(hash(case) & 0xFFFF)
    q_codes, k_codes = random_codes(gen, bh, m, nq, bits, mask), random_codes(gen, bh, m, nk, bits, mask)
    q_w, k_w = torch.randn(bh, nq, dw, generator=gen), torch.randn(bh, nk, dw, generator=gen)
    v = torch.randn(bh, nk, dv, generator=gen)
    out = ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, k_codes, q_w, k_w, v), bits)
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == (bh, nq, dv)
    close(out, lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits), rtol=2e-5)
    assert bool((out.cpu()[(q_codes < 0).all(1)] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weighted_cumulate_half_inputs(ext, dtype):
    gen = torch.Generator().manual_seed(5)
    q_codes, k_codes = random_codes(gen, 1, 4, 500, 2, 0.0), random_codes(gen, 1, 4, 500, 2, 0.0)
    q_w, k_w, v = (torch.randn(1, 500, 32, generator=gen).to(dtype) for _ in range(3))
    out = ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, k_codes, q_w, k_w, v), 2)
    close(out, lsh_weighted_cumulate(q_codes, k_codes, q_w.float(), k_w.float(), v.float(), 2), rtol=2e-5)


def test_masked_keys_add_nothing(ext):
    """Masking a key equals deleting it; masking a query zeroes its row (both ops)."""
    gen = torch.Generator().manual_seed(2)
    q_codes, k_codes = random_codes(gen, 2, 6, 90, 3, 0.0), random_codes(gen, 2, 6, 120, 3, 0.0)
    q_w = torch.randn(2, 90, 16, generator=gen)
    k_w, v = torch.randn(2, 120, 16, generator=gen), torch.randn(2, 120, 16, generator=gen)
    keep = torch.rand(120, generator=gen) < 0.6
    masked = k_codes.masked_fill(~keep, -1)
    kept_codes, kept_w, kept_v = (t.contiguous() for t in (k_codes[:, :, keep], k_w[:, keep], v[:, keep]))
    for det in (False, True):
        full = ext.lsh_cumulate_cuda(*cuda(q_codes, masked, v), 3, det)
        close(full, ext.lsh_cumulate_cuda(*cuda(q_codes, kept_codes, kept_v), 3, det))
    full = ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, masked, q_w, k_w, v), 3)
    close(full, ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, kept_codes, q_w, kept_w, kept_v), 3))


def test_batch_invariance_bit_exact(ext):
    """A (batch·head) row gives the same bits alone and inside a batch (deterministic paths)."""
    gen = torch.Generator().manual_seed(4)
    q_codes, k_codes = random_codes(gen, 4, 8, 333, 4, 0.1), random_codes(gen, 4, 8, 333, 4, 0.1)
    q_w, k_w, v = (torch.randn(4, 333, 32, generator=gen) for _ in range(3))
    batch = ext.lsh_cumulate_cuda(*cuda(q_codes, k_codes, v), 4, True)
    weighted = ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, k_codes, q_w, k_w, v), 4)
    for row in range(4):
        one = [t[row : row + 1] for t in (q_codes, k_codes, q_w, k_w, v)]
        assert torch.equal(ext.lsh_cumulate_cuda(*cuda(one[0], one[1], one[4]), 4, True)[0], batch[row])
        assert torch.equal(ext.lsh_weighted_cumulate_cuda(*cuda(*one), 4)[0], weighted[row])


def test_batch_invariance_above_the_budget(ext):
    """bh = 300 rows at τ = 8, Dv = 64, m = 32: the hashes per pass once came from the scratch
    budget divided by bh (32 for one row, 13 for 300), so a row's bits changed with its batch."""
    gen = torch.Generator().manual_seed(12)
    bh, m, n, bits = 300, 32, 333, 8
    q_codes, k_codes = random_codes(gen, bh, m, n, bits, 0.1), random_codes(gen, bh, m, n, bits, 0.1)
    v = torch.randn(bh, n, 64, generator=gen)
    batch = ext.lsh_cumulate_cuda(*cuda(q_codes, k_codes, v), bits, True)
    close(batch, lsh_cumulate(q_codes, k_codes, v, bits))
    for row in (0, 157, 299):
        one = ext.lsh_cumulate_cuda(*cuda(q_codes[row : row + 1], k_codes[row : row + 1], v[row : row + 1]), bits, True)
        assert torch.equal(one[0], batch[row]), row


def test_out_of_range_codes_are_refused_by_default_and_ignored_without_the_check(ext):
    """check_codes=True (default) is the CPU's error; check_codes=False (the op's hot path: no
    host sync) treats a code ≥ 2^τ like a masked one instead of reading out of bounds."""
    gen = torch.Generator().manual_seed(13)
    q_codes, k_codes = random_codes(gen, 2, 4, 60, 3, 0.0), random_codes(gen, 2, 4, 70, 3, 0.0)
    v, w = torch.randn(2, 70, 16, generator=gen), torch.randn(2, 70, 8, generator=gen)
    bad = k_codes.clone()
    bad[1, 2, 5] = 1 << 3
    with pytest.raises(RuntimeError, match="hash_bits=3 allows codes below 2\\^hash_bits = 8"):
        ext.lsh_cumulate_cuda(*cuda(q_codes, bad, v), 3)
    masked = bad.masked_fill(bad >= 8, -1)
    for det in (False, True):
        got = ext.lsh_cumulate_cuda(*cuda(q_codes, bad, v), 3, det, False)
        close(got, lsh_cumulate(q_codes, masked, v, 3))
    q_w = torch.randn(2, 60, 8, generator=gen)
    got = ext.lsh_weighted_cumulate_cuda(*cuda(q_codes, bad, q_w, w, v), 3, False)
    close(got, lsh_weighted_cumulate(q_codes, masked, q_w, w, v, 3), rtol=2e-5)


def test_forward_makes_no_host_sync_and_captures_in_a_cuda_graph(ext):
    """No codes.max().item(), no finiteness read-back: the fp16 forward runs under
    torch.cuda.set_sync_debug_mode("error") and replays from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[1, 250:] = False
    args = dict(num_hashes=16, hash_bits=8, seed=1, backend="cuda")
    with torch.no_grad():
        expected = yoso_attention(q, k, v, mask, **args)  # warm-up: projections and signs cached on the GPU
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yoso_attention(q, k, v, mask, **args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = yoso_attention(q, k, v, mask, **args)
    graph.replay()
    torch.cuda.synchronize()
    close(captured.float(), expected.float(), rtol=2e-3)


def test_deterministic_mode_is_bit_identical(ext):
    """Heavy collisions (τ=2, 8k keys) are where atomics reorder sums; the sorted path must not."""
    gen = torch.Generator().manual_seed(9)
    q_codes, k_codes = random_codes(gen, 6, 16, 8192, 2, 0.05), random_codes(gen, 6, 16, 8192, 2, 0.05)
    v = torch.randn(6, 8192, 64, generator=gen)
    args = cuda(q_codes, k_codes, v)
    first = ext.lsh_cumulate_cuda(*args, 2, True)
    for _ in range(3):
        assert torch.equal(ext.lsh_cumulate_cuda(*args, 2, True), first)
    close(first, lsh_cumulate(q_codes, k_codes, v, 2))
    w_args = cuda(q_codes, k_codes, v[..., :32].contiguous(), v[..., 32:].contiguous(), v)
    first_w = ext.lsh_weighted_cumulate_cuda(*w_args, 2)
    for _ in range(2):
        assert torch.equal(ext.lsh_weighted_cumulate_cuda(*w_args, 2), first_w)


@pytest.mark.parametrize("dim,bits", [(48, 8), (64, 16), (20, 8), (3, 5), (128, 8)])
def test_hash_rotate_equals_hash_codes_ref_bit_for_bit(ext, dim, bits):
    batch, heads, length, hashes, seed = 2, 3, 137, 4, 17
    x = torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(dim))
    signs = torch.stack([hashing.rotation_signs(seed, h, hashes, bits, dim) for h in range(heads)])  # (H, m, 3, P)
    codes = ext.hash_rotate_cuda(x.reshape(batch * heads, length, dim).cuda(), signs.cuda(), bits)
    expected = hash_codes_ref(x, num_hashes=hashes, hash_bits=bits, seed=seed, fast_hash=True)
    assert torch.equal(codes.view(batch, heads, hashes, length).cpu(), expected)


def test_hash_pack_equals_sign_bits(ext):
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(6, 101, 5 * 7, generator=gen)
    proj[0, 0, :7] = 0.0  # exact zeros are not positive
    codes = ext.hash_pack_cuda(proj.cuda(), 5, 7).cpu()
    bits = (proj.view(6, 101, 5, 7) > 0).int()
    expected = (bits << torch.arange(7, dtype=torch.int32)).sum(-1, dtype=torch.int32).permute(0, 2, 1)
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("fast_hash", [True, False])
def test_hash_codes_on_cuda_agree_with_cpu(fast_hash):
    """Same seeded projections on either device; codes differ only where a projection is ~0."""
    x = torch.randn(2, 3, 500, 64, generator=torch.Generator().manual_seed(0))
    args = dict(num_hashes=8, hash_bits=8, seed=3, fast_hash=fast_hash)
    on_gpu, on_cpu = hash_codes(x.cuda(), **args).cpu(), hash_codes(x, **args)
    assert on_gpu.shape == on_cpu.shape and on_gpu.dtype == torch.int32
    assert (on_gpu == on_cpu).float().mean().item() > 0.999


@pytest.mark.parametrize("dim", [32, 64, 96])
@pytest.mark.parametrize("fast_hash", [True, False])
def test_int8_codes_of_the_cuda_op_equal_the_cpu_kernels_bit_for_bit(ext, fast_hash, dim):
    """Int8 hashing on CUDA (hash_int8_cuda up to D = 64; past it quantized rows, the binding's GEMM
    and hash_pack_cuda) sums integers exactly, so its codes equal hash_codes(int8=True) and the CPU
    extension's, every one."""
    from yoso_serve.kernels.yoso import _kernels

    x = torch.randn(2, 3, 300, dim, generator=torch.Generator().manual_seed(6))
    x[0, 0, 0] = 0  # a zero row quantizes to zeros: every code 0
    x[0, 1, 1] = 0
    x[0, 1, 1, :2] = torch.tensor([2.0, 1.0])  # 1 / 2 · 127 = 63.5: rounds half to even
    args = (16, 8, 5, fast_hash, True)
    on_gpu = _kernels("cuda", torch.device("cuda")).codes(x.cuda(), *args).cpu()
    assert torch.equal(on_gpu, hash_codes(x, num_hashes=16, hash_bits=8, seed=5, fast_hash=fast_hash, int8=True))
    assert torch.equal(on_gpu, _kernels("cpp", torch.device("cpu")).codes(x, *args))


def test_expectation_converges_like_one_over_sqrt_m(ext, oracles):
    """Mean over m hashes → YOSO-E; the error at m = 256 is well under the error at m = 16."""
    q, k, v = oracles.random_qkv(1, 2, 64, 8, seed=5)
    bits = 4
    expected = oracles.naive_yoso_e(q, k, v, None, bits).reshape(2, 64, 8)
    q_hat, k_hat = (torch.nn.functional.normalize(t, dim=-1).cuda() for t in (q, k))
    errors = {}
    for m in (16, 256):
        args = dict(num_hashes=m, hash_bits=bits, seed=0, fast_hash=False)
        q_codes = hash_codes(q_hat, **args).view(2, m, 64)
        k_codes = hash_codes(k_hat, **args).view(2, m, 64)
        out = ext.lsh_cumulate_cuda(q_codes, k_codes, v.reshape(2, 64, 8).cuda(), bits, False)
        errors[m] = (out.cpu().double() - expected).norm().item() / expected.norm().item()
    assert errors[256] < errors[16] / 2.5  # 1/sqrt(m) predicts a factor of 4
    assert errors[256] < 0.25  # about 0.15 for these inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fast_hash", [True, False], ids=["rotation", "gaussian"])
def test_yoso_attention_cuda_backend_matches_its_oracle(dtype, fast_hash, oracles):
    """Forward and the eq. 11/13–14 backward through the op, v kept in fp16/bf16 by the CUDA
    kernels. The rotation codes equal hash_codes_ref bit for bit, so the dense oracle
    yoso_attention_ref has the same codes; the Gaussian codes are one GEMM on either backend."""
    q, k, v = (t.cuda().to(dtype) for t in oracles.random_qkv(2, 3, 137, 48, seed=8))
    mask = oracles.lengths_mask([137, 100], 137).cuda()
    args = dict(num_hashes=16, hash_bits=6, seed=2, fast_hash=fast_hash)
    grads = {}
    for name, op, backend in (("cuda", yoso_attention, "cuda"), ("oracle", yoso_attention_ref, "auto"),
                              ("torch", yoso_attention, "torch")):
        if name == "oracle" and not fast_hash or name == "torch" and fast_hash:
            continue
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = op(*leaves, mask, backend=backend, **args)
        out.float().square().sum().backward()
        assert out.dtype == dtype and all(t.grad.dtype == dtype for t in leaves)
        grads[name] = (out.detach(), *(t.grad for t in leaves))
    want = grads["oracle" if fast_hash else "torch"]
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for got, expected in zip(grads["cuda"], want):
        close(got.float(), expected.float(), rtol=tol)
    assert bool((grads["cuda"][0][1, :, 100:] == 0).all())  # padded queries are zero rows


SANITIZED = textwrap.dedent(
    """
    import torch
    from yoso_serve.kernels import _build, hashing
    ext = _build.cuda_extension()
    g = torch.Generator().manual_seed(0)
    for bits, n in ((3, 70), (13, 40)):
        qc = torch.randint(-1, 1 << bits, (2, 3, n), generator=g, dtype=torch.int32).cuda()
        kc = torch.randint(-1, 1 << bits, (2, 3, n + 9), generator=g, dtype=torch.int32).cuda()
        v = torch.randn(2, n + 9, 40, generator=g).cuda()
        for det in (False, True):
            ext.lsh_cumulate_cuda(qc, kc, v, bits, det)
        qw, kw = torch.randn(2, n, 24).cuda(), torch.randn(2, n + 9, 24).cuda()
        ext.lsh_weighted_cumulate_cuda(qc, kc, qw, kw, v, bits)
    # τ = 2 with 2,000 keys: buckets of ~500 keys, the Dw×Dv table scheme (Dv = 72: two column passes)
    qc = torch.randint(0, 4, (1, 1, 64), generator=g, dtype=torch.int32).cuda()
    kc = torch.randint(0, 4, (1, 1, 2000), generator=g, dtype=torch.int32).cuda()
    qw, kw = torch.randn(1, 64, 64).cuda(), torch.randn(1, 2000, 64).cuda()
    ext.lsh_weighted_cumulate_cuda(qc, kc, qw, kw, torch.randn(1, 2000, 72).cuda(), 2)
    x = torch.randn(6, 33, 20).cuda()
    signs = torch.stack([hashing.rotation_signs(0, h, 4, 8, 20) for h in range(3)]).cuda()
    ext.hash_rotate_cuda(x, signs, 8)
    ext.hash_pack_cuda(torch.randn(6, 33, 32).cuda(), 4, 8)
    for d, m, bits in ((20, 4, 8), (64, 9, 13), (3, 3, 3)):  # the int8 kernel's three instantiations
        planes = hashing.projection_planes(0, 3, m, bits, d, True, torch.device("cuda"), True)
        ext.hash_int8_cuda(torch.randn(6, 33, d).cuda(), planes, m, bits)
    torch.cuda.synchronize()
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_clean(ext, tool):
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(sanitizer):
        pytest.fail("compute-sanitizer not found: the CUDA toolkit on a GPU machine ships it")
    cmd = [sanitizer, f"--tool={tool}", "--error-exitcode=3", sys.executable, "-c", SANITIZED]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # memcheck and synccheck end "ERROR SUMMARY: 0 errors", racecheck "RACECHECK SUMMARY: 0 hazards displayed (0 errors, ..."
    # (seen on an H100 with CUDA 13.0's compute-sanitizer)
    assert re.search(r"ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors",
                     result.stdout + result.stderr), result.stdout[-2000:]
