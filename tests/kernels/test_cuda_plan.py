"""How the CUDA launchers cut a call into passes (yoso_cumulate_plan, yoso_weighted_cumulate_plan),
run on the CPU: no GPU needed, since planning is host code that touches no device.

A small driver linked with yoso_cuda.cu and yoso_cuda_weighted.cu prints the plan of each case.
What must hold: the hashes per pass (which decide how the forward's float sums are grouped)
never depend on batch*heads, so deterministic mode gives a row the same bits alone or in a
batch (the GPU side of this is test_cuda.py::test_batch_invariance_above_the_budget); the
scratch stays within its 256 MiB budget whenever one row fits it; and bucket tables have at
most min(2^tau, Nk) rows (at tau = 16, Dv = 64, 96 rows of 128 tokens the dense tables were
1.6 GB).
"""

from __future__ import annotations

import subprocess

import pytest
from yoso_testkit import build_host_driver

BUDGET = 256 << 20
DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include "yoso_cuda.h"
// argv: groups of 8 numbers (bh m nq nk dv dw hash_bits deterministic); one line per group.
int main(int argc, char** argv) {
  for (int i = 1; i + 8 <= argc; i += 8) {
    YosoCumulateParams p{};
    p.bh = atoll(argv[i]); p.m = atoll(argv[i + 1]); p.nq = atoll(argv[i + 2]); p.nk = atoll(argv[i + 3]);
    p.dv = atoll(argv[i + 4]); p.dw = atoll(argv[i + 5]); p.hash_bits = atoi(argv[i + 6]);
    p.deterministic = argv[i + 7][0] == '1';
    const YosoPlan f = yoso_cumulate_plan(p), w = yoso_weighted_cumulate_plan(p);
    printf("%lld %lld %lld %d %zu %lld %lld %zu\n", (long long)f.hashes_per_pass, (long long)f.rows_per_pass,
           (long long)f.table_rows, int(f.sorted), f.workspace_bytes, (long long)w.hashes_per_pass,
           (long long)w.rows_per_pass, w.workspace_bytes);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The plan driver, compiled once (host code and one device target: ~30 s)."""
    return build_host_driver(tmp_path_factory.mktemp("plan"), DRIVER, "yoso_cuda.cu", "yoso_cuda_weighted.cu")


def plans(driver, cases):
    """[(forward plan dict, weighted plan dict)] for cases of (bh, m, nq, nk, dv, dw, tau, det)."""
    args = [str(int(x)) for case in cases for x in case]
    done = subprocess.run([str(driver), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = []
    for line in done.stdout.split("\n")[: len(cases)]:
        g, r, t, s, ws, wg, wr, wws = (int(x) for x in line.split())
        rows.append(({"group": g, "rows": r, "table_rows": t, "sorted": bool(s), "bytes": ws},
                     {"group": wg, "rows": wr, "bytes": wws}))
    assert len(rows) == len(cases)
    return rows


BATCHES = [1, 4, 12, 128, 129, 300, 4096]
# (m, nq, nk, dv, tau, deterministic): the default τ = 8, D = 64 (where bh > 128 split the hashes
# before), a shape whose hashes need several passes even for one row, and τ = 16.
SHAPES = [(32, 4096, 4096, 64, 8, True), (32, 333, 333, 64, 8, False), (32, 65536, 65536, 64, 16, True),
          (64, 8192, 8192, 128, 12, False), (9, 50, 70, 64, 16, True)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "m{}-nq{}-nk{}-dv{}-tau{}-det{}".format(*s))
def test_hashes_per_pass_do_not_depend_on_batch_heads(driver, shape):
    m, nq, nk, dv, tau, det = shape
    result = plans(driver, [(bh, m, nq, nk, dv, dv, tau, det) for bh in BATCHES])
    assert len({fwd["group"] for fwd, _ in result}) == 1, result
    assert len({w["group"] for _, w in result}) == 1, result
    for bh, (fwd, w) in zip(BATCHES, result):
        assert 1 <= fwd["rows"] <= bh and 1 <= w["rows"] <= bh
        assert 1 <= fwd["group"] <= m
    # the budget is met by rows per pass: more rows than fit are never taken at once
    big = result[-1][0]
    assert big["bytes"] <= BUDGET or big["rows"] == 1, big


def test_the_default_shape_runs_all_hashes_in_one_pass_and_few_row_passes(driver):
    (fwd, w), (fwd_det, _) = plans(driver, [(12, 32, 4096, 4096, 64, 64, 8, 0), (12, 32, 4096, 4096, 64, 64, 8, 1)])
    assert fwd == {"group": 32, "rows": 12, "table_rows": 256, "sorted": False, "bytes": 12 * 32 * 256 * 64 * 4}
    assert fwd_det["group"] == 32 and fwd_det["rows"] == 12 and fwd_det["sorted"]
    assert w["group"] == 32 and w["rows"] == 12


def test_a_shape_too_big_for_one_pass_splits_hashes_the_same_way_for_any_batch(driver):
    """τ = 16 at N = 65536: a (row, hash) needs ~18 MB of scratch, so one row's 32 hashes need
    several passes; the split is the same for 1 row and for 300."""
    (one, _), (many, _) = plans(driver, [(1, 32, 65536, 65536, 64, 64, 16, 1), (300, 32, 65536, 65536, 64, 64, 16, 1)])
    assert 1 < one["group"] < 32 and one["group"] == many["group"]
    assert one["rows"] == many["rows"] == 1
    assert one["bytes"] <= BUDGET and many["bytes"] == one["bytes"]


@pytest.mark.parametrize("tau,nk,expected", [(16, 128, 128), (13, 8191, 8191), (13, 8192, 8192), (13, 20000, 8192),
                                             (10, 100, 1024), (8, 37, 256)])
def test_tables_have_at_most_min_buckets_and_keys_rows(driver, tau, nk, expected):
    """Sorted tables (τ ≥ 11, or deterministic) are packed to Nk rows when Nk < 2^τ; the
    shared-memory build (τ ≤ 10) keeps 2^τ rows (they live in shared memory, then L2)."""
    (fwd, _), (det, _) = plans(driver, [(96, 32, 128, nk, 64, 64, tau, 0), (96, 32, 128, nk, 64, 64, tau, 1)])
    assert fwd["sorted"] == (tau >= 11) and det["sorted"]
    assert fwd["table_rows"] == expected
    assert det["table_rows"] == min(1 << tau, nk)


def test_the_issue_case_no_longer_needs_gigabytes(driver):
    """τ = 16, Dv = 64, bh = 96 at N = 128: 1.6 GB of zeroed dense tables before; now tables of
    128 rows and scratch within the budget."""
    (fwd, w), = plans(driver, [(96, 32, 128, 128, 64, 64, 16, 0)])
    assert fwd["table_rows"] == 128 and fwd["sorted"]
    assert fwd["bytes"] <= BUDGET and w["bytes"] <= BUDGET


def test_an_empty_batch_needs_no_scratch(driver):
    (fwd, w), = plans(driver, [(0, 32, 4096, 4096, 64, 64, 8, 1)])
    assert fwd["rows"] == 0 and fwd["bytes"] == 0 and w["bytes"] == 0
