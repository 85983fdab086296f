"""The forward's gather (``gather_row`` in yoso_cuda.cu) run on the CPU: no GPU needed.

``gather_row<VEC>`` is the body one lane runs on the GPU: a few lanes per query row, VEC adjacent
columns each (float4 / float2 loads on the device, a plain loop on the host), the group's table rows
resolved a batch of hashes ahead of their loads. A driver compiled from yoso_cuda.cu runs it for every
(row, lane) a launch would make, over random tables, codes (some masked, some past 2^tau) and bucket
bounds, in the three table layouts (dense 2^tau rows; sorted, empty buckets skipped; packed, a bucket's
row its start in the sorted keys), and compares it bit for bit with one scalar loop over the hashes in
increasing order: the kernel's contract, which the deterministic mode's bit-identity rests on.

What this cannot see: the GPU's code generation and memory system; test_cuda.py runs the op there.
"""

from __future__ import annotations

import subprocess

import pytest
from yoso_testkit import HOST_RANDOM, build_host_driver

DRIVER = HOST_RANDOM + r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "yoso_cuda.cu"

static float next_f() { return float(next_u() % 2000001) / 1000000.f - 1.f; }

// The contract: per query row and column, the group's hashes in increasing order, one fp32 add each.
static void reference(const GatherArgs& a) {
  for (long long row = 0; row < a.bh * a.nq; ++row) {
    const long long bh = row / a.nq, i = row % a.nq;
    for (long long d = 0; d < a.dv; ++d) {
      float acc = 0.f;
      for (long long hs = 0; hs < a.group; ++hs) {
        long long c = a.q_codes[(bh * a.m + a.h0 + hs) * a.nq + i];
        if (c < 0 || c >= a.nb) continue;
        if (a.offsets) {
          const int32_t* off = a.offsets + (bh * a.group + hs) * (a.nb + 1);
          if (off[c] == off[c + 1]) continue;
          if (a.packed) c = off[c];
        }
        acc += a.tables[((bh * a.group + hs) * a.table_rows + c) * a.dv + d];
      }
      float* o = a.out + row * a.dv + d;
      *o = a.first ? a.scale * acc : *o + a.scale * acc;
    }
  }
}

template <int VEC> static void run(const GatherArgs& a, int lanes) {
  for (long long row = 0; row < a.bh * a.nq; ++row)
    for (int lane = 0; lane < lanes; ++lane) gather_row<VEC>(a, row, lane, lanes);
}

// argv: bh m nq dv tau group h0 layout(0 dense, 1 sorted, 2 packed) first seed
int main(int argc, char** argv) {
  if (argc != 11) return 2;
  const long long bh = atoll(argv[1]), m = atoll(argv[2]), nq = atoll(argv[3]), dv = atoll(argv[4]);
  const int nb = 1 << atoi(argv[5]);
  const long long group = atoll(argv[6]), h0 = atoll(argv[7]);
  const int layout = atoi(argv[8]);
  const bool first = argv[9][0] == '1';
  state = strtoull(argv[10], nullptr, 10);
  const long long nk = layout == 2 ? nb / 2 : 4 * nb, table_rows = layout == 2 ? nk : nb;
  std::vector<int32_t> codes(bh * m * nq), offsets;
  for (auto& c : codes) c = random_code(nb);
  if (layout) {
    offsets.resize(bh * group * (nb + 1));
    for (long long s = 0; s < bh * group; ++s) {
      int pos = 0;
      for (int b = 0; b < nb; ++b) {
        offsets[s * (nb + 1) + b] = pos;
        if (next_u() % 3 && pos < nk) pos += 1 + int(next_u() % 2);  // a third of the buckets empty
        if (pos > nk) pos = int(nk);
      }
      offsets[s * (nb + 1) + nb] = pos;
    }
  }
  std::vector<float> tables(bh * group * table_rows * dv), start(bh * nq * dv);
  for (auto& x : tables) x = next_f() * 1000.f;
  for (auto& x : start) x = next_f();
  std::vector<float> want = start;
  GatherArgs a{codes.data(), tables.data(), layout ? offsets.data() : nullptr, want.data(), bh, m, nq, dv, h0,
               group, table_rows, nb, layout == 2, 0.37f, first};
  reference(a);
  int failures = 0, cases = 0;
  for (int vec : {1, 2, 4}) {
    if (dv % vec) continue;
    for (int lanes : {1, 2, 8, 32, gather_lanes(dv, vec)}) {
      std::vector<float> got = start;
      a.out = got.data();
      if (vec == 4) run<4>(a, lanes); else if (vec == 2) run<2>(a, lanes); else run<1>(a, lanes);
      ++cases;
      if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) != 0) {
        ++failures;
        fprintf(stderr, "vec %d lanes %d differs\n", vec, lanes);
      }
    }
  }
  printf("%d %d\n", cases, failures);
  // The launch's choices: vector width from dv and the output's alignment, lanes per row.
  alignas(16) static float buf[8];
  printf("%d %d %d %d %d\n", gather_vec(64, buf), gather_vec(62, buf), gather_vec(63, buf), gather_vec(64, buf + 2),
         gather_vec(64, buf + 1));
  printf("%d %d %d %d %d %d\n", gather_lanes(64, 4), gather_lanes(32, 4), gather_lanes(128, 4), gather_lanes(130, 2),
         gather_lanes(1, 1), gather_lanes(3, 1));
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The gather driver, compiled once (host code and one device target)."""
    return build_host_driver(tmp_path_factory.mktemp("gather"), DRIVER)


def gather(driver, *args) -> list[list[int]]:
    done = subprocess.run([str(driver), *(str(int(a)) for a in args)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not done.stderr, done.stderr
    return [[int(x) for x in line.split()] for line in done.stdout.strip().split("\n")]


@pytest.mark.parametrize("layout", [0, 1, 2], ids=["dense", "sorted", "packed"])
@pytest.mark.parametrize("dv", [1, 3, 32, 62, 64, 96, 130])
@pytest.mark.parametrize("first", [1, 0], ids=["first-pass", "later-pass"])
def test_the_gather_equals_one_scalar_loop_bit_for_bit(driver, layout, dv, first):
    # 2 rows of 5 queries, 19 hashes of which a group of 11 from the third (more than one batch of
    # kGatherAhead, and a partial one), tau 4.
    cases, failures = gather(driver, 2, 19, 5, dv, 4, 11, 2, layout, first, 1000 + dv + layout)[0]
    assert cases >= 5
    assert failures == 0


def test_the_launch_picks_the_widest_aligned_vector_and_enough_lanes(driver):
    _, vec, lanes = gather(driver, 1, 1, 1, 4, 2, 1, 0, 0, 1, 7)
    # dv 64 / 62 / 63 on a 16-byte aligned output, then 64 on 8- and 4-byte aligned ones
    assert vec == [4, 2, 1, 2, 1]
    # dv 64, 32 and 128 at 4 columns a lane; 130 at 2; 1 and 3 at 1
    assert lanes == [16, 8, 32, 32, 1, 4]
