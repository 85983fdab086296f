"""YOSO-E (exact expectation) autograd Functions: the chunked PyTorch twin and the C++ fast path.

Both compute ``out = (E[B] ⊙ keep_k)·V ⊙ keep_q`` with ``E[B] = (1 − arccos(q̂·k̂)/π)^τ`` (eq. 6)
and share one signature: ``apply(q, k, v, keep, hash_bits, true_grad)`` with q, k: (BH, N, D)
fp32 unit rows, v: (BH, N, Dv) fp32, keep: (BH, N) fp32 0/1 (0 = padded key and query) →
(BH, N, Dv) fp32. Backward: the paper's lower bound (eq. 13–14, ``true_grad=False``) or the
derivative of the forward, ``τ(1 − θ/π)^(τ−1) / (π·sinθ)`` per pair with sinθ floored at 1e-3.

:class:`YosoExactFn` is the readable PyTorch version (query chunks of a bounded budget).
:class:`YosoExactCppFn` runs the extension's blockwise kernels (kernels/csrc/yoso_cpu_exact.cpp):
query × key tiles that stay in cache, arccos as a polynomial of max error
``ARCCOS_MAX_ERROR`` radians, the power by squaring, never an N×N matrix in memory.
"""

from __future__ import annotations

import math

import torch

EXACT_BACKWARDS = ("bound", "true")
# Scratch (probability chunks) of the PyTorch version is cut to about this many fp32 values.
_CHUNK_BUDGET = 1 << 24
# sinθ floor in the true exact-mode gradient: dE[B]/dcosθ grows like 1/sinθ as θ → 0
MIN_SINE = 1e-3
# |arccos error| of the C++ kernels' polynomial (Abramowitz & Stegun 4.4.46), in radians
ARCCOS_MAX_ERROR = 2e-8


def collision_probability(q: torch.Tensor, k: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """E[B] (eq. 6): q (..., Nq, D), k (..., Nk, D) fp32 unit rows → (..., Nq, Nk) fp32."""
    cosine = torch.matmul(q, k.transpose(-1, -2)).clamp_(-1.0, 1.0)
    return (1.0 - torch.arccos(cosine) / math.pi) ** hash_bits


class YosoExactFn(torch.autograd.Function):
    """YOSO-E in PyTorch, chunked over queries (the reference for :class:`YosoExactCppFn`)."""

    @staticmethod
    def _chunks(q: torch.Tensor, k: torch.Tensor):
        step = max(1, _CHUNK_BUDGET // (q.shape[0] * k.shape[1]))
        return [slice(s, min(s + step, q.shape[1])) for s in range(0, q.shape[1], step)]

    @staticmethod
    def forward(ctx, q, k, v, keep, hash_bits, true_grad=False):
        ctx.save_for_backward(q, k, v, keep)
        ctx.hash_bits, ctx.true_grad = hash_bits, true_grad
        out = torch.empty(v.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
        for rows in YosoExactFn._chunks(q, k):
            weights = collision_probability(q[:, rows], k, hash_bits) * keep[:, None, :]
            out[:, rows] = torch.matmul(weights, v)
        return out.mul_(keep[..., None])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep = ctx.saved_tensors
        grad_out = grad_out.float() * keep[..., None]  # padded queries' outputs are constant zeros
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        tau = ctx.hash_bits
        for rows in YosoExactFn._chunks(q, k):
            cosine = torch.matmul(q[:, rows], k.transpose(-1, -2)).clamp_(-1.0, 1.0)  # (BH, c, N)
            base = 1.0 - torch.arccos(cosine) / math.pi  # 1 − θ/π
            weights = base**tau * keep[:, None, :]
            g = grad_out[:, rows]  # (BH, c, Dv)
            grad_v += torch.matmul(weights.transpose(1, 2), g)
            if ctx.true_grad:  # d/dcosθ (1 − θ/π)^τ = τ(1 − θ/π)^(τ−1) / (π sinθ)
                sine = (1.0 - cosine * cosine).clamp_(min=MIN_SINE**2).sqrt_()
                slope = base ** (tau - 1) * keep[:, None, :] * (tau / math.pi) / sine
            else:  # eq. 13–14: τ/2 · E[B]
                slope = weights * (tau / 2)
            scaled = torch.matmul(g, v.transpose(1, 2)).mul_(slope)  # (BH, c, N)
            grad_q[:, rows] = torch.matmul(scaled, k)
            grad_k += torch.matmul(scaled.transpose(1, 2), q[:, rows])
        return grad_q, grad_k, grad_v, None, None, None


def cpp_exact_fn(ext):
    """The :class:`YosoExactCppFn` ``apply`` bound to the loaded extension ``ext``."""

    def apply(q, k, v, keep, hash_bits, true_grad=False):
        return YosoExactCppFn.apply(q, k, v, keep.contiguous(), hash_bits, true_grad, ext)

    return apply


class YosoExactCppFn(torch.autograd.Function):
    """YOSO-E through the C++ blockwise kernels; same contract as :class:`YosoExactFn` (+ ext)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, hash_bits, true_grad, ext):
        ctx.save_for_backward(q, k, v, keep)
        ctx.hash_bits, ctx.true_grad, ctx.ext = hash_bits, true_grad, ext
        return ext.exact_forward(q, k, v, keep, hash_bits)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, keep = ctx.saved_tensors
        grad = grad_out.float().contiguous()
        grad_q, grad_k, grad_v = ctx.ext.exact_backward(q, k, v, keep, grad, ctx.hash_bits, ctx.true_grad, MIN_SINE)
        return grad_q, grad_k, grad_v, None, None, None, None
