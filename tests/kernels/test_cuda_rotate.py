"""The fast-family hash kernel's per-thread body (``rotate_item`` in yoso_cuda_hash.cu), run on the
CPU against :func:`hash_codes_ref`, bit for bit: no GPU needed, since the body is
``__host__ __device__`` and a small driver calls it for every thread index a launch would.

The register kernel replaced one warp per (row, hash) on shared memory, which spent 87 ms of a
96 ms YOSO-32 forward at N = 65536 on an H100; the GPU side of this check is
test_cuda.py::test_hash_rotate_equals_hash_codes_ref_bit_for_bit.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from yoso_testkit import build_host_driver

from yoso_serve.kernels.hashing import hash_codes_ref, padded_dim, rotation_signs

REGISTER_DIMS = (1, 2, 4, 8, 16, 32, 64)  # the P the register kernel is instantiated for
DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "yoso_cuda_hash.cu"
// argv: bh heads n d m tau P extra, then files x (bh*n*d fp32), signs (heads*m*3*P fp32), codes out.
template <int P> int run(char** a) {
  const long long bh = atoll(a[1]), heads = atoll(a[2]), n = atoll(a[3]), d = atoll(a[4]), m = atoll(a[5]);
  const int tau = atoi(a[6]);
  const long long extra = atoll(a[8]);
  std::vector<float> x(bh * n * d), s(heads * m * 3 * P);
  std::vector<int32_t> codes(bh * m * n, -7);
  FILE* f = fopen(a[9], "rb"); if (!f || fread(x.data(), 4, x.size(), f) != x.size()) return 2; fclose(f);
  f = fopen(a[10], "rb"); if (!f || fread(s.data(), 4, s.size(), f) != s.size()) return 2; fclose(f);
  const long long groups = (m + kHashesPerThread - 1) / kHashesPerThread;
  for (long long item = 0; item < bh * groups * n + extra; ++item)  // + threads past the end of the grid
    rotate_item<P>(item, x.data(), s.data(), codes.data(), bh, heads, n, d, m, tau);
  f = fopen(a[11], "wb"); fwrite(codes.data(), 4, codes.size(), f); fclose(f);
  return 0;
}
int main(int argc, char** argv) {
  if (argc != 12) return 3;
  switch (atoi(argv[7])) {
    case 1: return run<1>(argv); case 2: return run<2>(argv); case 4: return run<4>(argv);
    case 8: return run<8>(argv); case 16: return run<16>(argv); case 32: return run<32>(argv);
    case 64: return run<64>(argv); default: return 4;
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build_host_driver(tmp_path_factory.mktemp("rotate"), DRIVER)  # it includes yoso_cuda_hash.cu


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
    x.numpy().tofile(tmp_path / "x.bin")
    signs.numpy().tofile(tmp_path / "s.bin")
    args = [batch * heads, heads, n, dim, m, tau, p, 300, tmp_path / "x.bin", tmp_path / "s.bin", tmp_path / "c.bin"]
    done = subprocess.run([str(driver), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = torch.from_numpy(np.fromfile(tmp_path / "c.bin", dtype=np.int32))
    want = hash_codes_ref(x, num_hashes=m, hash_bits=tau, seed=seed, fast_hash=True)  # (B, H, m, N)
    assert torch.equal(got.view(batch, heads, m, n), want.to(torch.int32))
