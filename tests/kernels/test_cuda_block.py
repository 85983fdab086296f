"""The weighted cumulation's block code (``weighted_bucket`` in yoso_cuda_weighted.cu: the staged
pairwise and table schemes), run on the CPU against :func:`lsh_weighted_cumulate`: no GPU needed.

The block routines are written as phases between ``block_sync()`` (yoso_cuda_common.cuh): compiled
for the host, each phase runs for every thread index in turn, which computes what a race-free block
computes on the GPU. A small driver sorts the codes into buckets on the host (the layout the bucket
sort writes: per (row, hash) the live indices bucket by bucket in increasing index, and the bucket
offsets), then calls ``weighted_bucket`` for every (row, bucket) of every hash, as the grid would.
Shared memory starts as NaN, so a read of anything not staged shows in the result.

What this cannot see: races inside a phase, and the GPU's own code generation; the GPU side is
test_cuda.py (the weighted cases, and racecheck / memcheck).
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from yoso_testkit import build_host_driver, close, random_codes

from yoso_serve.kernels.cumulate import lsh_weighted_cumulate

DRIVER = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "yoso_cuda_weighted.cu"
template <typename T> std::vector<T> read(const char* path, size_t n) {
  std::vector<float> x(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(x.data(), 4, n, f) != n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
  fclose(f);
  std::vector<T> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = T(x[i]);
  return out;
}
// Per (row, hash): live indices bucket by bucket in increasing index, and nb + 1 offsets.
void sort_codes_host(const std::vector<int32_t>& codes, long long bh, long long m, long long n, int nb,
                     std::vector<int32_t>& perm, std::vector<int32_t>& off) {
  perm.assign(bh * m * n, -1);
  off.assign(bh * m * (nb + 1), 0);
  for (long long s = 0; s < bh * m; ++s) {
    int pos = 0;
    for (int b = 0; b < nb; ++b) {
      off[s * (nb + 1) + b] = pos;
      for (long long j = 0; j < n; ++j)
        if (codes[s * n + j] == b) perm[s * n + pos++] = static_cast<int32_t>(j);
    }
    off[s * (nb + 1) + nb] = pos;
  }
}
template <typename T> int run(char** a) {
  const long long bh = atoll(a[1]), m = atoll(a[2]), nq = atoll(a[3]), nk = atoll(a[4]), dw = atoll(a[5]),
                  dv = atoll(a[6]);
  const int bits = atoi(a[7]), nb = 1 << bits;
  std::vector<int32_t> qc(bh * m * nq), kc(bh * m * nk);
  FILE* f = fopen(a[9], "rb"); if (!f || fread(qc.data(), 4, qc.size(), f) != qc.size()) return 2; fclose(f);
  f = fopen(a[10], "rb"); if (!f || fread(kc.data(), 4, kc.size(), f) != kc.size()) return 2; fclose(f);
  const std::vector<T> qw = read<T>(a[11], bh * nq * dw), kw = read<T>(a[12], bh * nk * dw),
                       v = read<T>(a[13], bh * nk * dv);
  std::vector<int32_t> qp, qo, kp, ko;
  sort_codes_host(qc, bh, m, nq, nb, qp, qo);
  sort_codes_host(kc, bh, m, nk, nb, kp, ko);
  const int cols = weighted_table_cols(dw, dv);
  if (cols == 0) return 5;  // the wide pairwise form is GPU-only (warp shuffles)
  std::vector<float> smem(weighted_smem(dw, cols) / sizeof(float), NAN), out(bh * nq * dv, 0.f);
  long long pairwise = 0, table = 0;
  for (long long hs = 0; hs < m; ++hs) {
    const WeightedArgs w{qw.data(), kw.data(), v.data(), out.data(), qp.data(), qo.data(), kp.data(), ko.data(),
                         nq, nk, dw, dv, m, hs, nb, cols, 1.f / float(m)};
    for (long long item = 0; item < bh * nb; ++item) {
      const long long r = item / nb, b = item % nb, s = r * m + hs;
      const long long q = qo[s * (nb + 1) + b + 1] - qo[s * (nb + 1) + b], k = ko[s * (nb + 1) + b + 1] - ko[s * (nb + 1) + b];
      if (q && k) (pairwise_is_cheaper(q, k, dw, dv) ? pairwise : table) += 1;
      weighted_bucket<T>(w, item, smem.data());
    }
  }
  f = fopen(a[14], "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f);
  printf("%d %lld %lld\n", cols, pairwise, table);
  return 0;
}
int main(int argc, char** argv) {
  if (argc != 15) return 3;
  switch (atoi(argv[8])) {
    case 0: return run<float>(argv);
    case 1: return run<__half>(argv);
    case 2: return run<__nv_bfloat16>(argv);
    default: return 4;
  }
}
"""

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build_host_driver(tmp_path_factory.mktemp("block"), DRIVER)  # it includes yoso_cuda_weighted.cu


def run_driver(driver, tmp_path, case, dtype=torch.float32):
    bh, m, nq, nk, dw, dv, bits, mask = case
    gen = torch.Generator().manual_seed(sum(case[:7]))
    q_codes, k_codes = random_codes(gen, bh, m, nq, bits, mask), random_codes(gen, bh, m, nk, bits, mask)
    q_w, k_w = torch.randn(bh, nq, dw, generator=gen), torch.randn(bh, nk, dw, generator=gen)
    v = torch.randn(bh, nk, dv, generator=gen)
    q_w, k_w, v = (t.to(dtype).float() for t in (q_w, k_w, v))  # the values the driver's conversion keeps
    files = {}
    for name, t in (("qc", q_codes), ("kc", k_codes), ("qw", q_w), ("kw", k_w), ("v", v)):
        files[name] = tmp_path / f"{name}.bin"
        t.contiguous().numpy().tofile(files[name])
    args = [bh, m, nq, nk, dw, dv, bits, DTYPES[dtype], *files.values(), tmp_path / "out.bin"]
    done = subprocess.run([str(driver), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr)
    cols, pairwise, table = map(int, done.stdout.split())
    got = torch.from_numpy(np.fromfile(tmp_path / "out.bin", dtype=np.float32)).view(bh, nq, dv)
    return got, lsh_weighted_cumulate(q_codes, k_codes, q_w, k_w, v, bits), (cols, pairwise, table), q_codes


# (BH, m, Nq, Nk, Dw, Dv, hash_bits, masked fraction) and which schemes its buckets take.
# τ = 8, N ≈ 300: ~1 key per bucket, pairwise; τ = 2, N ≈ 2000: ~500 per bucket, tables; Dv = 72:
# two column passes (64 + 8); τ = 1 with 400 queries and 12 keys: pairwise buckets of ~200 queries
# (four query tiles) and Dw, Dv no multiple of 4; τ = 2 with ~60 per bucket at Dw = Dv = 64 (the
# benchmark's head size): both schemes in one call; τ = 16: no bucket holds a query and a key.
CASES = [
    ((1, 1, 1, 1, 1, 1, 1, 0.0), "pairwise"),
    ((2, 3, 137, 300, 48, 48, 8, 0.2), "pairwise"),
    ((2, 3, 2000, 1800, 64, 64, 2, 0.1), "table"),
    ((1, 2, 700, 900, 40, 72, 1, 0.0), "table"),
    ((1, 2, 400, 12, 30, 26, 1, 0.0), "pairwise"),
    ((2, 4, 300, 240, 64, 64, 2, 0.1), "both"),
    ((2, 9, 60, 80, 16, 16, 16, 0.3), "none"),
]
IDS = "bh{}-m{}-nq{}-nk{}-dw{}-dv{}-tau{}-mask{}".format


@pytest.mark.parametrize("case,schemes", CASES, ids=lambda c: IDS(*c) if isinstance(c, tuple) else c)
def test_block_code_equals_the_oracle(driver, tmp_path, case, schemes):
    got, want, (cols, pairwise, table), q_codes = run_driver(driver, tmp_path, case)
    assert cols > 0
    assert {"pairwise": (pairwise > 0, table == 0), "table": (pairwise == 0, table > 0),
            "both": (pairwise > 0, table > 0), "none": (pairwise == 0, table == 0)}[schemes] == (True, True), (pairwise, table)
    assert torch.isfinite(got).all()  # shared memory starts as NaN: nothing unstaged was read
    close(got, want, rtol=2e-5)
    assert bool((got[(q_codes < 0).all(1)] == 0).all())  # masked queries get nothing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_code_reads_half_inputs(driver, tmp_path, dtype):
    got, want, _, _ = run_driver(driver, tmp_path, (1, 3, 500, 400, 32, 32, 2, 0.1), dtype)
    close(got, want, rtol=2e-5)


def test_block_code_refuses_nothing_it_cannot_stage(driver, tmp_path):
    """Dw = 500 never fits shared memory: weighted_table_cols is 0 and the GPU runs the wide pairwise
    form (warp shuffles, not emulated here); the driver says so rather than computing nothing."""
    with pytest.raises(AssertionError, match=r"\(5, "):
        run_driver(driver, tmp_path, (1, 2, 30, 20, 500, 16, 2, 0.0))
