"""The CUDA kernels as :func:`yoso_serve.kernels.yoso_attention` calls them: no host sync.

A host sync (reading a GPU value back: ``codes.max().item()``, a finiteness check) stalls the
pipeline on every call and makes a forward impossible to capture in a CUDA graph, so none is
made here. The binding's code-range check is skipped (``check_codes=False``): these codes
come from the op's own hashing, in range by construction, and the kernels treat any code
≥ 2^τ as masked rather than index out of bounds.

The forward's bucket tables (and grad V's, the same kernel with the roles swapped) are built by
the stable sort and in-order sums, no float atomics, so a text's output has the same bits alone
or in any batch and from run to run. ``YOSO_CUDA_TABLES=atomic`` opts in to the shared-memory
build with float atomics (order of the adds varies), kept only so bench/attention_cuda.py can time
it against the sorted build; ``torch.use_deterministic_algorithms(True)`` overrides it. Design
notes: docs/cuda.md.
"""

from __future__ import annotations

import functools
import os

import torch

from .hashing import projection_planes, check_int8_dim, padded_dim, quantize_rows, rotation_signs

MAX_ROTATE_DIM = 2048  # kYosoMaxRotateDim in csrc/yoso_cuda.h: the rotation kernel's P limit
MAX_INT8_KERNEL_DIM = 64  # kYosoMaxInt8KernelDim in csrc/yoso_cuda.h: the int8 hash kernel's D limit
TABLES_ENV = "YOSO_CUDA_TABLES"
TABLE_BUILDS = ("sorted", "atomic")


def table_build() -> str:
    """How the CUDA cumulation builds its bucket tables: "sorted" (the default: no float atomics,
    bit-identical alone or in a batch) or "atomic" (opted in with YOSO_CUDA_TABLES=atomic, for the
    GPU bench's comparison); ValueError naming the choices for anything else."""
    chosen = os.environ.get(TABLES_ENV, "").strip().lower() or "sorted"
    if chosen not in TABLE_BUILDS:
        raise ValueError(f"{TABLES_ENV} must be one of {TABLE_BUILDS}, got {os.environ[TABLES_ENV]!r}")
    return chosen


@functools.lru_cache(maxsize=64)
def _rotation_signs(seed: int, heads: int, num_hashes: int, hash_bits: int, dim: int, device: torch.device):
    """(H, m, 3, P) fp32 ±1 diagonals of every head on device, for ``hash_rotate_cuda``."""
    return torch.stack([rotation_signs(seed, h, num_hashes, hash_bits, dim) for h in range(heads)]).to(device)


def cuda_ops(ext, gemm_codes):
    """(codes, cumulate, weighted) for :class:`yoso.Kernels` over the CUDA extension ``ext``.

    codes: the fast family runs the fused rotation (equal to ``hash_codes_ref`` bit for bit,
    and no (BH, N, m·τ) fp32 scores in memory) up to P = 2048; the Gaussian family, and the
    rotation past that, is ``gemm_codes`` (one GEMM, then bit packing); int8 hashing runs
    ``hash_int8_cuda`` up to D = 64 (rows quantized, projected on the int8 planes and packed in one
    kernel) and past that quantizes the rows and sends them to the same GEMM and packing, giving
    ``hash_codes(int8=True)``'s codes either way. cumulate reads v in its own dtype (fp16/bf16 kernels, fp32 sums) and
    builds sorted tables unless :func:`table_build` (read here, once per set of ops) says "atomic" and
    ``torch.use_deterministic_algorithms`` is off; weighted (always sorted, no atomics) needs one dtype
    for its three inputs, and the backward mixes fp32 gradients with v, so mixed inputs go to fp32.
    """
    atomic = table_build() == "atomic"

    def codes(x, num_hashes, hash_bits, seed, fast_hash, int8=False):
        if int8:
            # hash_codes(int8=True)'s arithmetic: sums of integers below 2^24, exact in any order, so
            # the kernel's per-row sums and the GEMM's give the same codes
            batch, heads, length, dim = x.shape
            check_int8_dim(dim)
            proj = projection_planes(seed, heads, num_hashes, hash_bits, dim, bool(fast_hash), x.device, True)
            if dim <= MAX_INT8_KERNEL_DIM:  # no (BH, N, m·τ) scores in memory, no PyTorch passes
                rows = x.float().reshape(batch * heads, length, dim).contiguous()
                return ext.hash_int8_cuda(rows, proj, num_hashes, hash_bits).view(batch, heads, num_hashes, length)
            # wider heads: rows quantized in PyTorch, the binding's fp32 GEMM and hash_pack_cuda
            return ext.fast_hash_codes(quantize_rows(x.float()).contiguous(), proj, num_hashes, hash_bits, False)
        if not fast_hash or padded_dim(x.shape[-1], hash_bits) > MAX_ROTATE_DIM:
            return gemm_codes(x, num_hashes, hash_bits, seed, fast_hash)
        batch, heads, length, dim = x.shape
        signs = _rotation_signs(seed, heads, num_hashes, hash_bits, dim, x.device)
        rows = x.float().reshape(batch * heads, length, dim).contiguous()  # (BH, N, D)
        return ext.hash_rotate_cuda(rows, signs, hash_bits).view(batch, heads, num_hashes, length)

    def cumulate(q_codes, k_codes, v, hash_bits):
        deterministic = not atomic or torch.are_deterministic_algorithms_enabled()
        return ext.lsh_cumulate_cuda(q_codes, k_codes, v, hash_bits, deterministic, False)

    def weighted(q_codes, k_codes, q_w, k_w, v, hash_bits):
        if not q_w.dtype == k_w.dtype == v.dtype:
            q_w, k_w, v = (t.float() for t in (q_w, k_w, v))
        return ext.lsh_weighted_cumulate_cuda(q_codes, k_codes, q_w, k_w, v, hash_bits, False)

    return codes, cumulate, weighted
