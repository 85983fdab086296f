"""kernels/_cuda.py, the op's CUDA wiring, against a stand-in extension that implements the
documented kernel contracts in PyTorch on the CPU (the real kernels: test_cuda.py, on a GPU).

Checked here without a GPU: the hot path asks the binding for no code-range check (that check
is a host sync), builds sorted tables (no float atomics) in the forward and in the backward unless
YOSO_CUDA_TABLES=atomic opts in, keeps v in fp16/bf16, sends mixed dtypes of
the backward's weighted op to fp32, and feeds hash_rotate_cuda the (H, m, 3, P) signs and
(BH, N, D) rows whose codes equal hash_codes_ref's.
"""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import _build, hash_codes_ref, hashing
from yoso_serve.kernels._cuda import TABLES_ENV, cuda_ops, table_build
from yoso_serve.kernels.cumulate import lsh_cumulate, lsh_weighted_cumulate
from yoso_serve.kernels.yoso import Kernels, YosoLSHFn


class StandIn:
    """The binding's *_cuda functions as their docstrings define them, recording each call."""

    def __init__(self):
        self.calls = []

    def lsh_cumulate_cuda(self, q_codes, k_codes, v, hash_bits, deterministic=True, check_codes=True):
        self.calls.append(("cumulate", v.dtype, deterministic, check_codes))
        return lsh_cumulate(q_codes, k_codes, v.float(), hash_bits)

    def lsh_weighted_cumulate_cuda(self, q_codes, k_codes, q_w, k_w, v, hash_bits, check_codes=True):
        assert q_w.dtype == k_w.dtype == v.dtype, "the binding requires one dtype"
        self.calls.append(("weighted", v.dtype, check_codes))
        return lsh_weighted_cumulate(q_codes, k_codes, q_w.float(), k_w.float(), v.float(), hash_bits)

    def hash_rotate_cuda(self, x, signs, hash_bits):
        """x (BH, N, D) fp32, signs (H, m, 3, P): codes (BH, m, N); row bh uses head bh % H."""
        assert x.dtype == signs.dtype == torch.float32 and x.is_contiguous() and x.dim() == 3
        self.calls.append(("rotate", tuple(x.shape), tuple(signs.shape)))
        heads, hashes, _, size = signs.shape
        padded = torch.nn.functional.pad(x, (0, size - x.shape[-1]))
        codes = torch.empty(x.shape[0], hashes, x.shape[1], dtype=torch.int32)
        for row in range(x.shape[0]):
            for h in range(hashes):
                bits = hashing.rotate(padded[row], signs[row % heads, h])[..., :hash_bits] > 0
                codes[row, h] = hashing._codes_from_bits(bits)
        return codes

    def hash_int8_cuda(self, x, planes, num_hashes, hash_bits):
        """x (BH, N, D ≤ 64) fp32, planes (H, D, m·τ) int8 levels: hash_codes(int8=True)'s codes (BH, m, N)."""
        assert x.dtype == planes.dtype == torch.float32 and x.is_contiguous() and x.dim() == 3
        assert x.shape[-1] <= 64, "the kernel takes D <= 64"
        self.calls.append(("int8", tuple(x.shape), tuple(planes.shape)))
        rows, length = hashing.quantize_rows(x), x.shape[1]
        scores = torch.matmul(rows, planes.repeat(x.shape[0] // planes.shape[0], 1, 1))  # row bh: head bh % H
        bits = scores.view(x.shape[0], length, num_hashes, hash_bits) > 0
        return hashing._codes_from_bits(bits).permute(0, 2, 1).contiguous()

    def fast_hash_codes(self, x, proj, num_hashes, hash_bits, int8=False):
        """CUDA x (B, H, N, D) fp32 and proj (H, D, m·τ): one GEMM, then hash_pack_cuda's bits."""
        assert not int8, "the binding refuses int8 for CUDA tensors: rows come quantized instead"
        assert x.dtype == proj.dtype == torch.float32 and x.is_contiguous() and proj.is_contiguous()
        self.calls.append(("gemm", tuple(x.shape), tuple(proj.shape)))
        batch, heads, length, _ = x.shape
        bits = torch.matmul(x, proj).view(batch, heads, length, num_hashes, hash_bits) > 0
        return hashing._codes_from_bits(bits).permute(0, 1, 3, 2).contiguous()


def gemm_codes(x, num_hashes, hash_bits, seed, fast_hash):
    raise AssertionError("the GEMM codes are for the Gaussian family only")


def test_the_rotation_kernel_gets_rows_and_signs_whose_codes_equal_the_reference():
    ext = StandIn()
    codes, _, _ = cuda_ops(ext, gemm_codes)
    x = torch.nn.functional.normalize(torch.randn(2, 3, 37, 20, generator=torch.Generator().manual_seed(0)), dim=-1)
    got = codes(x, 5, 6, 11, True)
    assert got.shape == (2, 3, 5, 37)
    assert torch.equal(got, hash_codes_ref(x, num_hashes=5, hash_bits=6, seed=11, fast_hash=True))
    assert ext.calls == [("rotate", (6, 37, 20), (3, 5, 3, 32))]


def test_the_gaussian_family_and_wide_rotations_go_to_the_gemm():
    seen = []
    codes, _, _ = cuda_ops(StandIn(), lambda *args: seen.append(args) or "gemm")
    x, wide = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 2, 2049)  # P = 4096 > the kernel's 2048
    assert codes(x, 3, 4, 0, False) == "gemm" and codes(wide, 3, 4, 0, True) == "gemm"
    assert seen == [(x, 3, 4, 0, False), (wide, 3, 4, 0, True)]


@pytest.mark.parametrize("fast_hash", [True, False])
def test_int8_hashing_runs_the_int8_kernel_up_to_d64_and_the_gemm_past_it(fast_hash):
    """Up to D = 64 the raw rows and the int8 planes go to hash_int8_cuda (quantize, project and pack
    in one kernel); wider heads send quantized rows to the binding's GEMM + pack. Either way the
    codes are hash_codes(int8=True)'s, which the CPU kernels also give."""
    ext = StandIn()
    codes, _, _ = cuda_ops(ext, gemm_codes)
    gen = torch.Generator().manual_seed(5)
    for dim, call in ((24, ("int8", (6, 29, 24), (3, 24, 32))), (64, ("int8", (6, 29, 64), (3, 64, 32))),
                      (65, ("gemm", (2, 3, 29, 65), (3, 65, 32)))):
        ext.calls.clear()
        x = torch.randn(2, 3, 29, dim, generator=gen)
        got = codes(x, 4, 8, 7, fast_hash, True)
        assert ext.calls == [call]
        assert torch.equal(got, hashing.hash_codes(x, num_hashes=4, hash_bits=8, seed=7, fast_hash=fast_hash,
                                                   int8=True))
    with pytest.raises(ValueError, match="D <= "):
        codes(torch.randn(1, 1, 2, hashing.MAX_INT8_DIM + 1), 4, 8, 7, fast_hash, True)


def _codes_and_half_v(seed):
    gen = torch.Generator().manual_seed(seed)
    q_codes = torch.randint(-1, 8, (2, 3, 10), generator=gen, dtype=torch.int32)
    k_codes = torch.randint(-1, 8, (2, 3, 12), generator=gen, dtype=torch.int32)
    return q_codes, k_codes, torch.randn(2, 12, 4, generator=gen).half()


@pytest.mark.parametrize("torch_flag", [False, True])
@pytest.mark.parametrize("tables", [None, "sorted", "atomic"])
def test_cumulate_builds_sorted_tables_unless_atomic_is_opted_in(monkeypatch, tables, torch_flag):
    """The default (no YOSO_CUDA_TABLES) is the sorted build, whatever torch's deterministic flag
    says; the atomic build only with YOSO_CUDA_TABLES=atomic and the flag off. Always no host sync
    and v kept in fp16."""
    if tables is None:
        monkeypatch.delenv(TABLES_ENV, raising=False)
    else:
        monkeypatch.setenv(TABLES_ENV, tables)
    ext = StandIn()
    _, cumulate, _ = cuda_ops(ext, gemm_codes)
    q_codes, k_codes, v = _codes_and_half_v(1)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_flag)
    try:
        out = cumulate(q_codes, k_codes, v, 3)
    finally:
        torch.use_deterministic_algorithms(before)
    sorted_tables = tables != "atomic" or torch_flag
    assert ext.calls == [("cumulate", torch.float16, sorted_tables, False)]
    torch.testing.assert_close(out, lsh_cumulate(q_codes, k_codes, v.float(), 3))


def test_forward_and_backward_of_the_op_build_sorted_tables_by_default(monkeypatch):
    """YosoLSHFn over the CUDA ops, as yoso_attention(backend="cuda") runs it with gradients: the
    forward's cumulation and grad V's (the role-swapped one) ask for sorted tables; grad q̂ and
    grad k̂ run the weighted op, which has no atomic build at all."""
    monkeypatch.delenv(TABLES_ENV, raising=False)
    ext = StandIn()
    kernels = Kernels(*cuda_ops(ext, gemm_codes), half_values=True)
    q_codes, k_codes, v = _codes_and_half_v(3)
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.nn.functional.normalize(torch.randn(2, n, 4, generator=gen), dim=-1).requires_grad_()
            for n in (10, 12))
    v = v.float().requires_grad_()
    YosoLSHFn.apply(q, k, v, q_codes, k_codes, 3, kernels).sum().backward()
    assert [c for c in ext.calls if c[0] == "cumulate"] == [("cumulate", torch.float32, True, False)] * 2
    assert [c[0] for c in ext.calls].count("weighted") == 2


def test_table_build_refuses_an_unknown_value_and_backend_info_reports_it(monkeypatch):
    for loader in ("cpu_extension", "cuda_extension"):  # the report without building anything
        monkeypatch.setattr(_build, loader, lambda: None)
    monkeypatch.delenv(TABLES_ENV, raising=False)
    assert table_build() == "sorted" and _build.backend_info()["cuda_tables"] == "sorted"
    monkeypatch.setenv(TABLES_ENV, " Atomic ")
    assert table_build() == "atomic"
    monkeypatch.setenv(TABLES_ENV, "deterministic")
    with pytest.raises(ValueError, match="YOSO_CUDA_TABLES must be one of \\('sorted', 'atomic'\\)"):
        cuda_ops(StandIn(), gemm_codes)


def test_weighted_sends_mixed_dtypes_to_fp32_and_one_dtype_as_it_is():
    ext = StandIn()
    _, _, weighted = cuda_ops(ext, gemm_codes)
    gen = torch.Generator().manual_seed(2)
    q_codes = torch.randint(0, 4, (1, 2, 6), generator=gen, dtype=torch.int32)
    k_codes = torch.randint(0, 4, (1, 2, 7), generator=gen, dtype=torch.int32)
    grad_out, k = torch.randn(1, 6, 5, generator=gen), torch.randn(1, 7, 5, generator=gen)
    v = torch.randn(1, 7, 5, generator=gen).bfloat16()
    weighted(q_codes, k_codes, grad_out, v, k, 2)  # the backward's mix: fp32 dO, bf16 V, fp32 k̂
    weighted(q_codes, k_codes, v[:, :6], v, v, 2)
    assert ext.calls == [("weighted", torch.float32, False), ("weighted", torch.bfloat16, False)]
