"""The forward's shared-memory table build (``table_smem_block`` in yoso_cuda.cu) run on the CPU: no GPU
needed.

The block routine is written as phases between ``block_sync()`` (yoso_cuda_common.cuh): compiled for the
host, each phase runs for every thread index in turn, and a shared-memory add is a plain add. A driver
runs every block a launch would make (one per (row, hash, column chunk), chunks as wide as the launcher
picks for 48 KiB) over random codes (some masked, some past 2^tau) and values in fp32, fp16 and bf16,
with shared memory NaN-filled, and compares each table with the sums in double precision.

What this cannot see: races between threads (the GPU's adds are atomics, in no fixed order), and the
GPU's code generation; test_cuda.py runs the op there.
"""

from __future__ import annotations

import subprocess

import pytest
from yoso_testkit import HOST_RANDOM, build_host_driver

DRIVER = HOST_RANDOM + r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "yoso_cuda.cu"


template <typename T> static int run(long long bh, long long m, long long nk, long long dv, int tau, long long group,
                                     long long h0) {
  const int nb = 1 << tau;
  const int chunk = smem_table_cols(dv, nb);
  if (chunk == 0) return -1;
  std::vector<int32_t> codes(bh * m * nk);
  for (auto& c : codes) c = random_code(nb);
  std::vector<T> v(bh * nk * dv);
  std::vector<float> vf(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = T(float(next_u() % 2001) / 1000.f - 1.f);
    vf[i] = float(v[i]);
  }
  const long long sets = bh * group, chunks = (dv + chunk - 1) / chunk;
  std::vector<float> tables(sets * nb * dv, NAN), smem(size_t(nb) * chunk);
  const TableArgs a{codes.data(), v.data(), tables.data(), nullptr, nullptr, m, nk, dv, h0, group, sets, nb, nb,
                    chunk, false};
  for (long long block = 0; block < sets * chunks; ++block) {
    for (auto& x : smem) x = NAN;
    table_smem_block<T>(a, block, smem.data());
  }
  int bad = 0;
  for (long long s = 0; s < sets; ++s) {
    const long long b = s / group, h = h0 + s % group;
    for (int c = 0; c < nb; ++c)
      for (long long d = 0; d < dv; ++d) {
        double want = 0, scale = 1;
        for (long long j = 0; j < nk; ++j)
          if (codes[(b * m + h) * nk + j] == c) {
            want += vf[(b * nk + j) * dv + d];
            scale += std::fabs(vf[(b * nk + j) * dv + d]);
          }
        const float got = tables[(s * nb + c) * dv + d];
        if (!(std::fabs(got - want) <= 1e-6 * scale)) ++bad;
      }
  }
  return bad;
}

// argv: dtype(0 fp32, 1 fp16, 2 bf16) bh m nk dv tau group h0 seed; prints the chunk width and the
// count of table entries that differ from the double-precision sums (-1: no shared-memory build).
int main(int argc, char** argv) {
  if (argc != 10) return 2;
  const int dtype = atoi(argv[1]);
  const long long bh = atoll(argv[2]), m = atoll(argv[3]), nk = atoll(argv[4]), dv = atoll(argv[5]);
  const int tau = atoi(argv[6]);
  const long long group = atoll(argv[7]), h0 = atoll(argv[8]);
  state = strtoull(argv[9], nullptr, 10);
  const int bad = dtype == 0 ? run<float>(bh, m, nk, dv, tau, group, h0)
                : dtype == 1 ? run<__half>(bh, m, nk, dv, tau, group, h0)
                             : run<__nv_bfloat16>(bh, m, nk, dv, tau, group, h0);
  printf("%d %d\n", smem_table_cols(dv, 1 << tau), bad);
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The table driver, compiled once (host code and one device target)."""
    return build_host_driver(tmp_path_factory.mktemp("tables"), DRIVER)


@pytest.mark.parametrize("dtype", [0, 1, 2], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("dv", "tau", "chunk"), [
    (64, 8, 32),    # the bundled model's heads at 64: two chunks of 32 columns, a lane each
    (32, 8, 32),    # one chunk
    (64, 6, 64),    # a chunk of 64: two columns a lane
    (130, 5, 128),  # a chunk of 128 and one of 2
    (20, 9, 20),    # a chunk narrower than a warp: lanes past it idle
    (64, 10, 12),   # six chunks, the last of 4 columns
])
@pytest.mark.parametrize("nk", [77, 300])
def test_the_shared_memory_tables_are_the_sums_of_the_values_by_code(driver, dtype, dv, tau, chunk, nk):
    # 2 rows, 5 hashes of which 3 from the second: keys not a multiple of a run (8) or of a block's runs
    done = subprocess.run([str(driver), *(str(x) for x in (dtype, 2, 5, nk, dv, tau, 3, 1, 17 + nk + dv))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    width, bad = (int(x) for x in done.stdout.split())
    assert width == chunk
    assert bad == 0
