"""Int8 hashing as one integer GEMM (``torch._int_mm``, exact int32 sums) plus a sign-pack: its codes
equal :func:`hash_codes` with ``int8=True`` bit for bit, on the CPU here and on a GPU where one exists
(the shapes include ones ``torch._int_mm``'s CUDA constraints force to be padded: N·B ≤ 16, D and m·τ
not multiples of 8)."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels.hashing import hash_codes, int8_codes_gemm

# (B, H, N, D, m, tau, fast_hash)
CASES = [(2, 3, 37, 32, 32, 8, True), (1, 2, 41, 64, 16, 8, False), (2, 2, 5, 20, 9, 8, True),
         (1, 3, 3, 17, 5, 5, False), (1, 1, 11, 1, 4, 3, True)]


def _rows(case, device):
    b, h, n, d = case[:4]
    x = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(sum(case[:6])))
    x[0, 0, 0] = 0.0  # a zero row stays zero: every bit 0
    return x.to(device)


def _check(case, device):
    x = _rows(case, device)
    kw = dict(num_hashes=case[4], hash_bits=case[5], seed=3, fast_hash=case[6])
    want = hash_codes(x.cpu(), int8=True, **kw)
    got = int8_codes_gemm(x, **kw)
    assert got.dtype == torch.int32 and got.device.type == device
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("case", CASES)
def test_int8_gemm_codes_equal_the_cpu_codes(case):
    _check(case, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("case", CASES)
def test_int8_gemm_codes_on_the_gpu_equal_the_cpu_codes(case):
    _check(case, "cuda")
