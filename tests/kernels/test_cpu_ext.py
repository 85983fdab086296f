"""The C++ CPU extension (kernels/csrc/yoso_cpu.cpp) against dense oracles and the PyTorch ops.

The extension ships with the project, so a failed build FAILS these tests (never skips).
The first run compiles it (about 30 s on 2 cores); later runs load it from torch's cache.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from yoso_testkit import close, random_codes

from yoso_serve.kernels import _build, hash_codes, yoso_attention
from yoso_serve.kernels.cumulate import lsh_cumulate, lsh_weighted_cumulate
from yoso_serve.kernels.hashing import projection_planes


def collisions(q_codes, k_codes):
    """Dense oracle of the per-hash collision indicators: (BH, m, Nq, Nk) float64."""
    eq = q_codes[:, :, :, None] == k_codes[:, :, None, :]
    valid = (q_codes[:, :, :, None] >= 0) & (k_codes[:, :, None, :] >= 0)
    return (eq & valid).double()


def dense_cumulate(q_codes, k_codes, v):
    return (collisions(q_codes, k_codes).mean(1) @ v.double()).float()


def dense_weighted_cumulate(q_codes, k_codes, q_w, k_w, v):
    weights = collisions(q_codes, k_codes).mean(1) * (q_w.double() @ k_w.double().transpose(1, 2))
    return (weights @ v.double()).float()


# (BH, m, Nq, Nk, Dv, Dw, hash_bits, masked fraction): N=1, N=137, D=48, Nq≠Nk, m=1..7, τ=1..12.
CASES = [
    (1, 1, 1, 1, 1, 1, 1, 0.0),
    (2, 3, 137, 137, 48, 48, 8, 0.2),
    (3, 7, 137, 61, 48, 16, 4, 0.3),
    (2, 5, 61, 200, 64, 32, 12, 0.1),
    (1, 2, 200, 1, 8, 5, 6, 0.0),
    (4, 4, 90, 90, 33, 48, 1, 0.5),
    (2, 6, 150, 140, 17, 9, 2, 0.0),
    (1, 7, 5, 300, 48, 48, 3, 0.9),
    # Dv = 32 and 64 take the kernels' fixed-width bodies: all 256 buckets in use, and compact (τ=9, Nk=50)
    (3, 32, 300, 257, 32, 32, 8, 0.2),
    (2, 4, 100, 50, 32, 8, 9, 0.1),
    (2, 3, 80, 120, 64, 16, 8, 0.3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "bh{}-m{}-nq{}-nk{}-dv{}-dw{}-tau{}-mask{}".format(*c))
def test_cumulate_matches_dense_oracle_and_torch_op(ext, case):
    bh, m, nq, nk, dv, dw, bits, mask = case
    gen = torch.Generator().manual_seed(hash(case) & 0xFFFF)
    q_codes = random_codes(gen, bh, m, nq, bits, mask)
    k_codes = random_codes(gen, bh, m, nk, bits, mask)
    v = torch.randn(bh, nk, dv, generator=gen)
    out = ext.lsh_cumulate(q_codes, k_codes, v, bits)
    assert out.dtype == torch.float32 and out.shape == (bh, nq, dv)
    close(out, dense_cumulate(q_codes, k_codes, v))
    close(out, lsh_cumulate(q_codes, k_codes, v, bits))
    # Masked queries read zeros in every hash.
    assert bool((out[(q_codes < 0).all(1)] == 0).all())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "bh{}-m{}-nq{}-nk{}-dv{}-dw{}-tau{}-mask{}".format(*c))
def test_weighted_cumulate_matches_dense_oracle_and_torch_op(ext, case):
    bh, m, nq, nk, dv, dw, bits, mask = case
    gen = torch.Generator().manual_seed(hash(case) & 0xFFFF)
    q_codes = random_codes(gen, bh, m, nq, bits, mask)
    k_codes = random_codes(gen, bh, m, nk, bits, mask)
    q_w, k_w = torch.randn(bh, nq, dw, generator=gen), torch.randn(bh, nk, dw, generator=gen)
    v = torch.randn(bh, nk, dv, generator=gen)
    out = ext.lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits)
    assert out.dtype == torch.float32 and out.shape == (bh, nq, dv)
    close(out, dense_weighted_cumulate(q_codes, k_codes, q_w, k_w, v))
    close(out, lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits))


def test_weighted_cumulate_both_schemes_on_skewed_buckets(ext):
    """One hash puts every key in one bucket (table scheme), the others spread them (list walk)."""
    gen = torch.Generator().manual_seed(7)
    bh, m, n, d, bits = 2, 4, 300, 24, 12
    q_codes = random_codes(gen, bh, m, n, bits, 0.0)
    k_codes = random_codes(gen, bh, m, n, bits, 0.0)
    q_codes[:, 0], k_codes[:, 0] = 5, 5
    q_w, k_w, v = (torch.randn(bh, n, d, generator=gen) for _ in range(3))
    out = ext.lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits)
    close(out, dense_weighted_cumulate(q_codes, k_codes, q_w, k_w, v))


def test_large_tau_long_sequence_matches_torch_op(ext):
    """τ=16 with 8k keys: more table memory than one group holds, so hashes are processed in groups."""
    gen = torch.Generator().manual_seed(3)
    bh, m, n, dv, bits = 1, 9, 8192, 64, 16
    q_codes = random_codes(gen, bh, m, n, bits, 0.1)
    k_codes = q_codes.clone()
    k_codes[:, :, ::3] = random_codes(gen, bh, m, n, bits, 0.1)[:, :, ::3]
    v = torch.randn(bh, n, dv, generator=gen)
    close(ext.lsh_cumulate(q_codes, k_codes, v, bits), lsh_cumulate(q_codes, k_codes, v, bits))


def _determinism_inputs(bh):
    gen = torch.Generator().manual_seed(11)
    # Big enough (> 4 · 2^18 multiply-adds per call) that the kernels really use 4 threads.
    m, nq, nk, d, bits = 8, 2000, 1900, 48, 5
    q_codes = random_codes(gen, bh, m, nq, bits, 0.1)
    k_codes = random_codes(gen, bh, m, nk, bits, 0.1)
    q_w, k_w = torch.randn(bh, nq, d, generator=gen), torch.randn(bh, nk, d, generator=gen)
    v = torch.randn(bh, nk, d, generator=gen)
    k_codes[0, 0] = q_codes[0, 0, 0]  # one crowded bucket: the weighted op takes its table scheme there
    return q_codes, k_codes, q_w, k_w, v, bits


@pytest.mark.parametrize("bh", [1, 3])
def test_bit_identical_across_calls_and_thread_counts(ext, bh):
    """1 thread, threads sharing one (batch*head), and one thread per (batch*head): same bits."""
    q_codes, k_codes, q_w, k_w, v, bits = _determinism_inputs(bh)
    x = torch.randn(2, bh, 1333, 40, generator=torch.Generator().manual_seed(2))
    proj = torch.randn(bh, 40, 6 * bits, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 4, 2):
            torch.set_num_threads(threads)
            assert ext.openmp_max_threads() == threads
            results.append(
                (
                    ext.lsh_cumulate(q_codes, k_codes, v, bits),
                    ext.lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits),
                    ext.fast_hash_codes(x, proj, 6, bits),
                )
            )
    finally:
        torch.set_num_threads(before)
    for result in results[1:]:
        for got, first in zip(result, results[0]):
            assert torch.equal(got, first)


def _valid_args():
    codes = torch.zeros(2, 3, 5, dtype=torch.int32)
    return codes, codes.clone(), torch.zeros(2, 5, 4)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: (a[0].long(), a[1], a[2], 8), "q_codes must be Int"),
        (lambda a: (a[0], a[1], a[2].double(), 8), "v must be Float"),
        (lambda a: (a[0], a[1], a[2].to("meta"), 8), "v must be a CPU tensor"),
        (lambda a: (a[0], a[1][0], a[2], 8), "k_codes must have rank 3"),
        (lambda a: (a[0], a[1], a[2].transpose(1, 2).contiguous().transpose(1, 2), 8), "v must be contiguous"),
        (lambda a: (a[0][:1].contiguous(), a[1], a[2], 8), "batch*heads must match"),
        (lambda a: (a[0][:, :2].contiguous(), a[1], a[2], 8), "number of hashes m must match"),
        (lambda a: (a[0][:, :0].contiguous(), a[1][:, :0].contiguous(), a[2], 8), "m must be at least 1"),
        (lambda a: (a[0], a[1][:, :, :4].contiguous(), a[2], 8), "Nk must match"),
        (lambda a: (a[0], a[1], a[2], 0), "hash_bits must be in 1..16"),
        (lambda a: (a[0], a[1], a[2], 17), "hash_bits must be in 1..16"),
        (lambda a: (a[0] + 256, a[1], a[2], 8), "allows codes below 2^hash_bits = 256"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_input_raises_naming_the_limit(ext, mutate, message):
    args = mutate(_valid_args())
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ext.lsh_cumulate(*args)
    q_codes, k_codes, v, bits = args
    q_w = torch.zeros(q_codes.shape[0], q_codes.shape[-1], 3)
    k_w = torch.zeros(k_codes.shape[0], k_codes.shape[-1], 3)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ext.lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits)


def test_kernels_run_without_the_gil_and_checks_raise_with_it(ext):
    """The bindings validate and raise holding the GIL and give it up around the kernel itself:
    another Python thread keeps running while one long cumulation does, and a bad code still
    raises RuntimeError with the limit in its message (a number, formatted by yoso_check.h)."""
    gen = torch.Generator().manual_seed(5)
    q_codes, k_codes = random_codes(gen, 24, 32, 6000, 8, 0.0), random_codes(gen, 24, 32, 6000, 8, 0.0)
    v = torch.randn(24, 6000, 64, generator=gen)
    span, ticks = [], []

    def call():
        start = time.perf_counter()
        ext.lsh_cumulate(q_codes, k_codes, v, 8)
        span.extend([start, time.perf_counter()])

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        worker = threading.Thread(target=call)
        worker.start()
        while worker.is_alive():
            ticks.append(time.perf_counter())
            time.sleep(0)
        worker.join()
    finally:
        sys.setswitchinterval(switch)
    start, end = span
    assert end - start > 0.05, "the cumulation should last long enough to observe"
    inside = [t for t in ticks if start + 0.2 * (end - start) < t < end - 0.2 * (end - start)]
    assert inside, f"no Python thread ran during the {1e3 * (end - start):.0f} ms kernel: it held the GIL"
    with pytest.raises(RuntimeError, match="allows codes below 2\\^hash_bits = 256"):
        ext.lsh_cumulate(q_codes + 256, k_codes, v, 8)


@pytest.mark.parametrize("fast_hash", [True, False])
@pytest.mark.parametrize("shape, m, bits", [((2, 3, 137, 48), 7, 6), ((1, 2, 1, 5), 3, 16), ((1, 1, 64, 64), 32, 8)])
def test_fast_hash_codes_match_float64_oracle_and_torch_hash(ext, fast_hash, shape, m, bits):
    """Codes from the seeded projections; only bits within rounding of a hyperplane may differ."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + bits))
    proj = projection_planes(4, shape[1], m, bits, shape[-1], fast_hash, torch.device("cpu"))
    codes = ext.fast_hash_codes(x, proj, m, bits)
    assert codes.dtype == torch.int32 and codes.shape == (shape[0], shape[1], m, shape[2])
    scores = (x.double() @ proj.double()[None]).view(*shape[:3], m, bits)  # (B, H, N, m, τ)
    weights = 1 << torch.arange(bits)
    oracle = ((scores > 0).long() * weights).sum(-1).permute(0, 1, 3, 2)  # (B, H, m, N)
    margin = x.norm(dim=-1)[..., None, None] * proj.norm(dim=1).view(1, shape[1], 1, m, bits) * 1e-5
    safe = (scores.abs() > margin).all(-1).permute(0, 1, 3, 2)
    assert safe.float().mean() > 0.98
    assert torch.equal(codes[safe].long(), oracle[safe])
    public = hash_codes(x, num_hashes=m, hash_bits=bits, seed=4, fast_hash=fast_hash)
    assert torch.equal(codes[safe], public[safe])


def test_fast_hash_codes_bad_input_raises(ext):
    x, proj = torch.zeros(1, 2, 5, 8), torch.zeros(2, 8, 12)
    with pytest.raises(RuntimeError, match=re.escape("proj must be (H, D, num_hashes*hash_bits) = (2, 8, 12)")):
        ext.fast_hash_codes(x, proj[:1].contiguous(), 3, 4)
    with pytest.raises(RuntimeError, match=re.escape("proj must be (H, D, num_hashes*hash_bits) = (2, 8, 15)")):
        ext.fast_hash_codes(x, proj, 3, 5)
    with pytest.raises(RuntimeError, match=re.escape("hash_bits must be in 1..16")):
        ext.fast_hash_codes(x, torch.zeros(2, 8, 51), 3, 17)
    with pytest.raises(RuntimeError, match="num_hashes must be at least 1"):
        ext.fast_hash_codes(x, torch.zeros(2, 8, 0), 0, 4)
    with pytest.raises(RuntimeError, match="x must have rank 4"):
        ext.fast_hash_codes(x[0], proj, 3, 4)
    with pytest.raises(RuntimeError, match="x must be Float"):
        ext.fast_hash_codes(x.half(), proj, 3, 4)
    with pytest.raises(RuntimeError, match="x must be contiguous"):
        ext.fast_hash_codes(x.transpose(2, 3), torch.zeros(2, 5, 12), 3, 4)


def test_weighted_bad_weights_raise(ext):
    codes, k_codes, v = _valid_args()
    good = torch.zeros(2, 5, 3)
    with pytest.raises(RuntimeError, match=r"q_w must be \(BH, Nq, Dw\)"):
        ext.lsh_weighted_cumulate(codes, k_codes, torch.zeros(2, 4, 3), good, v, 8)
    with pytest.raises(RuntimeError, match="Dw must match"):
        ext.lsh_weighted_cumulate(codes, k_codes, good, torch.zeros(2, 5, 2), v, 8)
    with pytest.raises(RuntimeError, match="k_w must be Float"):
        ext.lsh_weighted_cumulate(codes, k_codes, good, good.double(), v, 8)


@pytest.mark.parametrize("masked", [False, True])
def test_yoso_attention_cpp_equals_torch_forward_and_gradients(ext, masked):
    gen = torch.Generator().manual_seed(5)
    b, h, n, d = 2, 3, 137, 48
    inputs = [torch.randn(b, h, n, d, generator=gen) for _ in range(3)]
    key_mask = None
    if masked:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[1, 100:] = False
    grad = torch.randn(b, h, n, d, generator=gen)
    results = {}
    for backend in ("cpp", "torch"):
        q, k, v = (x.clone().requires_grad_(True) for x in inputs)
        out = yoso_attention(q, k, v, key_mask, num_hashes=7, hash_bits=6, seed=3, backend=backend)
        out.backward(grad)
        results[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for cpp, torch_ in zip(results["cpp"], results["torch"]):
        close(cpp, torch_)
    assert results["cpp"][0].abs().sum() > 0 and results["cpp"][1].abs().sum() > 0


def test_backend_info_reports_the_extension(ext):
    info = _build.backend_info()
    assert info == {
        "backend": "cpp",
        "reason": info["reason"],
        "openmp_threads": torch.get_num_threads(),
        "cuda": False,
        "cuda_reason": "torch sees no CUDA device",
        "cuda_toolkit": info["cuda_toolkit"],  # tests/kernels/test_cuda_toolkit.py checks it
        "cuda_tables": "sorted",  # no float atomics unless YOSO_CUDA_TABLES=atomic (tests/kernels/test_cuda_ops.py)
    }
    assert "built and loaded" in info["reason"]


def test_env_forces_torch_backend_and_logs_why(ext, monkeypatch, caplog):
    for name in ("_resolved", "_module", "_reason"):
        monkeypatch.setattr(_build, name, getattr(_build, name))
    monkeypatch.setattr(_build, "_resolved", False)
    monkeypatch.setenv(_build.BACKEND_ENV, "torch")
    with caplog.at_level(logging.INFO, logger="yoso_serve.kernels"):
        assert _build.cpu_extension() is None
        info = _build.backend_info()
    assert info["backend"] == "torch" and "YOSO_KERNEL_BACKEND=torch" in info["reason"]
    lines = [r.getMessage() for r in caplog.records if r.name == "yoso_serve.kernels"]
    assert lines == ["yoso_serve.kernels backend: torch (YOSO_KERNEL_BACKEND=torch forces the pure-PyTorch ops)"]
    with pytest.raises(ValueError, match="'cpp' is not available"):
        yoso_attention(*(torch.randn(1, 1, 4, 8) for _ in range(3)), backend="cpp")


def test_unknown_backend_policy_is_a_value_error(monkeypatch):
    for name in ("_resolved", "_module", "_reason"):
        monkeypatch.setattr(_build, name, getattr(_build, name))
    monkeypatch.setattr(_build, "_resolved", False)
    monkeypatch.setenv(_build.BACKEND_ENV, "fortran")
    with pytest.raises(ValueError, match="'fortran' is not one of auto, torch, cpp"):
        _build.cpu_extension()


def test_import_does_not_build_or_load_the_extension():
    code = (
        "import sys, yoso_serve.kernels as k\n"
        "from yoso_serve.kernels import _build\n"
        "print(_build._resolved, 'torch.utils.cpp_extension' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
