"""The fast-family hash kernel's per-thread body (``rotate_item`` in yoso_cuda_hash.cu), run on the
CPU against :func:`hash_codes_ref`, bit for bit: no GPU needed, since the body is
``__host__ __device__`` and a small driver (yoso_testkit's HASH_GROUPS_DRIVER, built with AddressSanitizer)
calls it for every thread index a launch would.

The register kernel replaced one warp per (row, hash) on shared memory, which spent 87 ms of a
96 ms YOSO-32 forward at N = 65536 on an H100; the GPU side of this check is
test_cuda.py::test_hash_rotate_equals_hash_codes_ref_bit_for_bit.
"""

from __future__ import annotations

import pytest
import torch
from yoso_testkit import ASAN_FLAGS, HASH_GROUPS_DRIVER, build_host_driver, run_hash_groups

from yoso_serve.kernels.hashing import hash_codes_ref, padded_dim, rotation_signs

REGISTER_DIMS = (1, 2, 4, 8, 16, 32, 64)  # the P the register kernel is instantiated for
@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    # it includes yoso_cuda_hash.cu; AddressSanitizer: a read past the signs or the rows fails the run
    return build_host_driver(tmp_path_factory.mktemp("rotate"), HASH_GROUPS_DRIVER, flags=ASAN_FLAGS)


# (B, H, N, D, m, tau): D = 64 and 32 (the bench's and the bundled model's heads), a D padded to
# P = 32, τ = 16 on a small D, τ = 3, P = 1, and m not a multiple of the hashes per thread.
CASES = [(2, 3, 37, 64, 32, 8), (1, 2, 50, 32, 13, 8), (1, 3, 21, 20, 9, 8), (2, 1, 17, 5, 4, 16),
         (1, 2, 9, 3, 8, 3), (1, 1, 5, 1, 3, 1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}N{}D{}m{}tau{}".format(*c))
def test_register_rotation_equals_hash_codes_ref_bit_for_bit(driver, case, tmp_path):
    batch, heads, n, dim, m, tau = case
    seed = sum(case)
    x = torch.randn(batch, heads, n, dim, generator=torch.Generator().manual_seed(seed))
    x[0, 0, 0] = 0  # a zero row: every sign is "not positive"
    p = padded_dim(dim, tau)
    assert p in REGISTER_DIMS
    signs = torch.stack([rotation_signs(seed, h, m, tau, dim) for h in range(heads)])  # (H, m, 3, P)
    got = run_hash_groups(driver, "rotate", x, signs, m, tau, p, tmp_path)
    want = hash_codes_ref(x, num_hashes=m, hash_bits=tau, seed=seed, fast_hash=True)  # (B, H, m, N)
    assert torch.equal(got, want.to(torch.int32))
