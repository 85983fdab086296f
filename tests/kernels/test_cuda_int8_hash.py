"""The int8 hash kernel's per-thread body (``int8_hash_item`` in yoso_cuda_hash.cu), run on the CPU
against :func:`hash_codes` with ``int8=True``, bit for bit: the body is ``__host__ __device__`` and a
small driver, built with AddressSanitizer, calls it for every thread index a launch would (and some
past the grid's end), with the rows and planes in buffers of exactly their size.

The kernel replaces, up to D = 64, the PyTorch quantization passes, the (BH, N, m·τ) fp32 scores of
one GEMM and the packing pass that int8 hashing (the bundled model's) ran on CUDA. Its sums are sums
of integers below 2^24, exact in any order, so the codes must equal the GEMM's exactly; the
quantization must round as ``quantize_rows`` does (fp32 division, product, half to even). The GPU
side of this check is test_cuda.py::test_int8_codes_of_the_cuda_op_equal_the_cpu_kernels_bit_for_bit.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from yoso_testkit import ASAN_FLAGS, HASH_GROUPS_DRIVER, build_host_driver, run_hash_groups

from yoso_serve.kernels.hashing import projection_planes, hash_codes


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    # it includes yoso_cuda_hash.cu; AddressSanitizer: a read past the planes or the rows fails the run
    return build_host_driver(tmp_path_factory.mktemp("int8"), HASH_GROUPS_DRIVER, flags=ASAN_FLAGS)


def instantiation(dim: int) -> int:
    """The P yoso_hash_int8 launches for D (16, 32 or 64)."""
    return 16 if dim <= 16 else 32 if dim <= 32 else 64


# (B, H, N, D, m, tau, fast_hash): the bundled model's D = 32 and the bench's 64 at τ = 8, a D between
# instantiations, D = 1, τ = 16 and τ = 3, m not a multiple of the hashes per thread, both plane families.
CASES = [(2, 3, 37, 32, 32, 8, True), (1, 2, 41, 64, 16, 8, False), (2, 2, 23, 20, 9, 8, True),
         (1, 3, 19, 48, 5, 16, False), (1, 1, 11, 1, 4, 3, True), (2, 1, 13, 16, 13, 8, False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}N{}D{}m{}tau{}-{}".format(*c[:6], "fast" if c[6] else "gauss"))
def test_int8_kernel_codes_equal_hash_codes_int8_bit_for_bit(driver, case, tmp_path):
    batch, heads, n, dim, m, tau, fast_hash = case
    seed = sum(case[:6])
    x = torch.randn(batch, heads, n, dim, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 0, 0] = 0  # a zero row: every x8 zero, every sum zero, every bit clear
    x[-1, -1, 1] = 0
    x[-1, -1, 1, 0] = -2.0  # x / s · 127 = -127 exactly, and with D > 1 ties at ± 63.5 (half to even)
    if dim > 2:
        x[-1, -1, 1, 1:3] = torch.tensor([1.0, -1.0])
    x[0, -1, 2] *= 1e-30  # a tiny row quantizes like its scaled-up self
    planes = projection_planes(seed, heads, m, tau, dim, fast_hash, torch.device("cpu"), True)  # (H, D, m·τ) levels
    got = run_hash_groups(driver, "int8", x, planes, m, tau, instantiation(dim), tmp_path)
    want = hash_codes(x, num_hashes=m, hash_bits=tau, seed=seed, fast_hash=fast_hash, int8=True)  # (B, H, m, N)
    assert torch.equal(got, want.to(torch.int32))
    assert (got[0, 0, :, 0] == 0).all()
    if dim >= 8:  # the codes spread over buckets (at D = 1 a code is the sign of x alone)
        assert len(got.unique()) > min(2 ** tau, 8) // 2


QUANTIZE = r"""
#include <cstdio>
#include <vector>
#include "yoso_cuda_hash.cu"
// stdin: rows d, then rows * d floats as text (%a); stdout: x8 of each row, %a, one row a line.
int main() {
  long long rows, d;
  if (scanf("%lld %lld", &rows, &d) != 2 || d > 64) return 2;
  std::vector<float> x(rows * d);
  for (auto& v : x) if (scanf("%a", &v) != 1) return 2;
  for (long long r = 0; r < rows; ++r) {
    float x8[64];
    quantize_row<64>(x.data() + r * d, d, x8);
    for (long long c = 0; c < d; ++c) printf("%a ", x8[c]);
    printf("\n");
  }
  return 0;
}
"""


def test_quantize_row_rounds_as_quantize_rows(tmp_path):
    """x8 of the kernel's quantize_row against hashing.quantize_rows, exactly: ties go to the even
    level (62.5 → 62, 2.5 → 2, 1.5 → 2, −0.5 → −0), a zero row stays zero, the largest entry maps to ±127,
    and random rows of every scale agree (the fp32 division, then the product, then the rounding)."""
    from yoso_serve.kernels.hashing import quantize_rows

    gen = torch.Generator().manual_seed(3)
    rows = [torch.tensor([127.0, 62.5, -62.5, 0.5, 1.5, 2.5, -0.5, -126.5]), torch.zeros(8),
            torch.tensor([-3.0, 1.5, 0.75, 2.0, -2.99, 0.0, 1e-3, 3.0])]
    rows += [torch.randn(8, generator=gen) * scale for scale in (1e-20, 1e-3, 1.0, 7.0, 1e20) for _ in range(20)]
    x = torch.stack(rows)
    exe = build_host_driver(tmp_path, QUANTIZE)
    text = f"{x.shape[0]} {x.shape[1]}\n" + " ".join(float(v).hex() for v in x.flatten().tolist())
    done = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = torch.tensor([[float.fromhex(v) for v in line.split()] for line in done.stdout.splitlines()])
    want = quantize_rows(x)
    assert torch.equal(got, want), (got - want).abs().max()
    assert got[0].tolist()[:7] == [127.0, 62.0, -62.0, 0.0, 2.0, 2.0, -0.0] and not got[1].any()


def test_the_launcher_refuses_what_the_kernel_cannot_take(tmp_path):
    """D past 64, a τ outside 1..16 and rows that are no multiple of the planes' heads each return a
    message naming the limit (the binding raises it), before any launch."""
    source = r"""
#include <cstdio>
#include "yoso_cuda_hash.cu"
int main() {
  const char* wide = yoso_hash_int8(nullptr, nullptr, nullptr, 2, 1, 4, 65, 8, 8, 0);
  const char* bits = yoso_hash_int8(nullptr, nullptr, nullptr, 2, 1, 4, 32, 8, 17, 0);
  const char* heads = yoso_hash_int8(nullptr, nullptr, nullptr, 3, 2, 4, 32, 8, 8, 0);
  const char* empty = yoso_hash_int8(nullptr, nullptr, nullptr, 2, 1, 0, 32, 8, 8, 0);
  std::printf("%s\n%s\n%s\n%s\n", wide, bits, heads, empty ? empty : "ok");
  return 0;
}
"""
    done = subprocess.run([str(build_host_driver(tmp_path, source))], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["the int8 hash kernel takes head dimensions D in 1..64",
                                        "hash_bits must be in 1..16",
                                        "batch*heads must be a multiple of the heads in planes", "ok"]
