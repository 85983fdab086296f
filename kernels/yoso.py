"""YOSO attention (Zeng et al., 2021, §3.1–3.3): op, autograd Functions and readable twin.

Three faces with one signature:

* :func:`yoso_attention` — dispatching op. LSH mode hashes q̂ and k̂ with one seeded set of
  projections and runs the bucket cumulation (C++ extension or the pure-PyTorch
  :func:`~.cumulate.lsh_cumulate`) inside :class:`YosoLSHFn` (without autograd, the extension's fused
  ``lsh_attention``); exact mode (YOSO-E) runs the extension's blockwise kernels
  (:class:`~.exact.YosoExactCppFn`) or :class:`~.exact.YosoExactFn`, chunked over queries.
* :class:`YosoLSHFn` / :class:`YosoExactFn` — autograd. Both use the paper's backward:
  grad V = B(K, Q)·dO (eq. 11) and the lower bound of eq. 13–14 for grad q̂ and grad k̂,
  ``grad q̂_i = τ/2 · Σ_j B_ij (dO_i·V_j) k̂_j``. In LSH mode B is the sampled collision
  matrix (for fixed q̂, k̂, v an unbiased estimator of the exact mode's gradient with the
  Gaussian family, nearly so with the fast rotation); in exact
  mode B is replaced by its expectation ``(1 − arccos(q̂·k̂)/π)^τ``. The lower bound is not
  the derivative of the forward (eq. 12 is), so only grad V is a true gradient.
  ``exact_backward="true"`` makes exact mode return the derivative of its forward instead,
  ``τ(1 − θ/π)^(τ−1) / (π·sinθ)`` per pair (sinθ floored at 1e-3): what training in exact
  mode should follow when the aim is to fit a target (distillation), not to match the
  gradient LSH training sees.
* :func:`yoso_attention_ref` — pure PyTorch, dense (N×N) weights, same backward formula
  written plainly; the oracle for the op.

q and k are ℓ2-normalised inside (the normalisation is differentiated by autograd); the
output is the un-normalised cumulation ``B·V`` — the model applies N-YOSO's ℓ2 norm.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .cumulate import lsh_cumulate, lsh_weighted_cumulate
from .exact import EXACT_BACKWARDS, YosoExactFn, collision_probability, cpp_exact_fn
from .hashing import MAX_HASH_BITS, projection_planes, check_input, check_int8_dim, hash_codes, hash_codes_ref

BACKENDS = ("auto", "torch", "cpp", "cuda")


class Kernels(NamedTuple):
    """One backend's implementations: ``codes(x, num_hashes, hash_bits, seed, fast_hash, int8)``
    → (B, H, m, N) int32 equal to :func:`hash_codes`, plus the two cumulations; where the
    backend has them, ``fused(q, k, v, key_mask, num_hashes, hash_bits, seed, fast_hash, int8)`` (LSH
    forward without autograd, hashing and cumulation in one pass; num_hashes = 0: YOSO-E) and ``exact`` (a
    :class:`~.exact.YosoExactFn`-compatible ``apply``). ``half_values``: the cumulations read
    fp16/bf16 v as they are (summing in fp32)."""

    codes: Callable
    cumulate: Callable
    weighted: Callable
    half_values: bool = False
    fused: Callable | None = None
    exact: Callable | None = None


def _torch_codes(x, num_hashes, hash_bits, seed, fast_hash, int8=False):
    return hash_codes(x, num_hashes=num_hashes, hash_bits=hash_bits, seed=seed, fast_hash=fast_hash, int8=int8)


@functools.lru_cache(maxsize=64)
def _int8_packed(ext, seed: int, heads: int, num_hashes: int, hash_bits: int, dim: int, fast_hash: bool):
    """The int8 planes (on CPU) and their packing for the extension's hashing body, made once per projection:
    validating and packing them costs about 0.3 ms, more than the hashing of a 512-token input."""
    proj = projection_planes(seed, heads, num_hashes, hash_bits, dim, fast_hash, torch.device("cpu"), True)
    return proj, ext.pack_int8_planes(proj)


def _cpp_codes(ext):
    # The projection GEMM and the bit packing in one pass: the PyTorch path materialises
    # (B, H, N, m·τ) fp32 scores, which dominated time and memory at long N.
    def codes(x, num_hashes, hash_bits, seed, fast_hash, int8=False):
        if int8:
            check_int8_dim(x.shape[-1])
            if x.device.type == "cpu":
                proj, packed = _int8_packed(ext, seed, x.shape[1], num_hashes, hash_bits, x.shape[-1], bool(fast_hash))
                return ext.fast_hash_codes(x.float().contiguous(), proj, num_hashes, hash_bits, True, packed)
        proj = projection_planes(seed, x.shape[1], num_hashes, hash_bits, x.shape[-1], bool(fast_hash), x.device, int8)
        return ext.fast_hash_codes(x.float().contiguous(), proj, num_hashes, hash_bits, int8)

    return codes


def _cpp_fused(ext):
    # Strided (B, H, N, D) views go in as they are, and the output comes back as a view of
    # (B, N, H, D) memory: a model's head split and merge cost no copies.
    def fused(q, k, v, key_mask, num_hashes, hash_bits, seed, fast_hash, int8=False):
        keep = None if key_mask is None else key_mask.to(torch.bool).contiguous()
        as_is = q.dtype == k.dtype == v.dtype == torch.bfloat16  # read as their fp32 values: no fp32 copies
        q, k, v = (t if as_is else t.float() for t in (q, k, v))
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if num_hashes == 0:
            return ext.exact_attention(q, k, v, keep, hash_bits)
        if int8:
            check_int8_dim(q.shape[-1])
            proj, packed = _int8_packed(ext, seed, q.shape[1], num_hashes, hash_bits, q.shape[-1], bool(fast_hash))
            return ext.lsh_attention(q, k, v, proj, keep, num_hashes, hash_bits, True, packed)
        proj = projection_planes(seed, q.shape[1], num_hashes, hash_bits, q.shape[-1], bool(fast_hash), q.device)
        return ext.lsh_attention(q, k, v, proj, keep, num_hashes, hash_bits)

    return fused


def _kernels(backend: str, device: torch.device) -> Kernels:
    """The :class:`Kernels` implementing backend on device; ValueError if unavailable."""
    from . import _build

    torch_kernels = Kernels(_torch_codes, lsh_cumulate, lsh_weighted_cumulate)
    if backend == "cuda" or (backend == "auto" and device.type == "cuda"):
        ext = _build.cuda_extension()
        if ext is None:
            if backend == "cuda":
                raise ValueError(f"backend 'cuda' is not available: {_build.backend_info().get('cuda_reason', 'no CUDA extension')}")
            return torch_kernels
        if device.type != "cuda":
            raise ValueError(f"backend 'cuda' needs CUDA tensors, got device {device}")
        from ._cuda import cuda_ops

        return Kernels(*cuda_ops(ext, _cpp_codes(ext)), half_values=True)
    if backend == "torch" or device.type != "cpu" and backend == "auto":
        return torch_kernels
    ext = _build.cpu_extension()
    if ext is None:
        if backend == "cpp":
            raise ValueError(f"backend 'cpp' is not available: {_build.backend_info().get('reason', 'not built')}")
        return torch_kernels
    if device.type != "cpu":
        raise ValueError(f"backend 'cpp' needs CPU tensors, got device {device}")
    return Kernels(_cpp_codes(ext), ext.lsh_cumulate, ext.lsh_weighted_cumulate, fused=_cpp_fused(ext),
                   exact=cpp_exact_fn(ext))


class YosoLSHFn(torch.autograd.Function):
    """B(q̂, k̂)·V from fixed hash codes, with the paper's LSH-estimated backward.

    forward(q, k, v, q_codes, k_codes, hash_bits, kernels): q, k: (BH, N, D) fp32 unit rows,
    v: (BH, N, Dv) fp32 contiguous (fp16/bf16 too with ``kernels.half_values``), codes: (BH, m, N)
    int32 (negative = masked), kernels: the :class:`Kernels` from :func:`_kernels` → (BH, N, Dv) fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_codes, k_codes, hash_bits, kernels):
        ctx.save_for_backward(q, k, v, q_codes, k_codes)
        ctx.hash_bits, ctx.kernels = hash_bits, kernels
        return kernels.cumulate(q_codes, k_codes, v, hash_bits)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_codes, k_codes = ctx.saved_tensors
        cumulate, weighted = ctx.kernels.cumulate, ctx.kernels.weighted
        grad_out = grad_out.float().contiguous()
        half_tau = ctx.hash_bits / 2
        grad_q = grad_k = grad_v = None
        if ctx.needs_input_grad[2]:  # eq. 11: the role-swapped cumulation B(K, Q)·dO
            grad_v = cumulate(k_codes, q_codes, grad_out, ctx.hash_bits)
        if ctx.needs_input_grad[0]:  # eq. 14: Σ_j B_ij (dO_i·V_j) k̂_j
            grad_q = weighted(q_codes, k_codes, grad_out, v, k, ctx.hash_bits).mul_(half_tau)
        if ctx.needs_input_grad[1]:  # the same with the roles of queries and keys swapped
            grad_k = weighted(k_codes, q_codes, v, grad_out, q, ctx.hash_bits).mul_(half_tau)
        return grad_q, grad_k, grad_v, None, None, None, None


def _check_args(q, k, v, key_mask, num_hashes, hash_bits, seed, backend) -> None:
    """ValueError naming the first problem with the arguments of yoso_attention(_ref)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_input(x, name)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k and v must have the same shape (B, H, N, D), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if isinstance(num_hashes, bool) or not isinstance(num_hashes, int) or num_hashes < 0:
        raise ValueError(f"num_hashes must be an int ≥ 0 (0 = exact YOSO-E), got {num_hashes!r}")
    if isinstance(hash_bits, bool) or not isinstance(hash_bits, int) or not 1 <= hash_bits <= MAX_HASH_BITS:
        raise ValueError(f"hash_bits must be an int in 1..{MAX_HASH_BITS}, got {hash_bits!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if key_mask is None:
        return
    if not isinstance(key_mask, torch.Tensor):
        raise ValueError(f"key_mask must be a torch.Tensor or None, got {type(key_mask).__name__}")
    if tuple(key_mask.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"key_mask must have shape (B, N) = {(q.shape[0], q.shape[2])}, got {tuple(key_mask.shape)}")
    if key_mask.device != q.device:
        raise ValueError(f"key_mask must be on {q.device}, got {key_mask.device}")
    if key_mask.dtype != torch.bool and not bool(((key_mask == 0) | (key_mask == 1)).all()):
        raise ValueError("key_mask must be bool or hold only 0 and 1")


def _prepare(q, k, v, key_mask, half_values=False, normalize=True):
    """Unit q̂, k̂ (q, k as given without normalize) and fp32 v (in its dtype with half_values),
    and keep (BH, N) fp32 0/1."""
    batch, heads, length, _ = q.shape
    keep = torch.ones(batch, length, dtype=torch.float32, device=q.device)
    if key_mask is not None:
        keep = key_mask.to(torch.float32)
    keep = keep[:, None, :].expand(batch, heads, length).reshape(batch * heads, length)
    if normalize:
        q, k = F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1)
    return q, k, v if half_values else v.float(), keep


def yoso_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    num_hashes: int = 32,
    hash_bits: int = 8,
    seed: int = 0,
    exact: bool = False,
    fast_hash: bool = True,
    backend: str = "auto",
    exact_backward: str = "bound",
    int8_hash: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """YOSO attention, un-normalised: B(q̂, k̂)·V.

    q, k, v: (B, H, N, D) fp32|fp16|bf16, one dtype and device; key_mask: (B, N) bool or 0/1,
    1 = real token (also masks queries: padded query rows are zero). Returns (B, H, N, D) in
    out_dtype (default q's dtype), computed in fp32. exact=True or num_hashes=0 → YOSO-E
    (O(N²), chunked); otherwise the mean over num_hashes LSH samples of hash_bits bits (O(N·m)),
    with projections seeded from (seed, head). backend: "auto" (C++ if built, else PyTorch),
    "torch", "cpp" (both modes; without autograd LSH mode runs one fused kernel). exact_backward:
    "bound" (the paper's eq. 13–14, as transformers) or "true" (the derivative of exact mode's
    forward; LSH mode always uses the bound). int8_hash: hash q and k quantized to int8 with int8
    planes (:mod:`.hashing`; about 3× faster hashing on CPUs with AVX-512 VNNI). out_dtype: B·V
    sums the values of every colliding key, so at a few thousand tokens it can pass fp16's
    65504; a caller that normalises the rows afterwards (N-YOSO) asks for torch.float32 and
    casts after the norm. Bad input → ValueError.
    """
    _check_args(q, k, v, key_mask, num_hashes, hash_bits, seed, backend)
    if exact_backward not in EXACT_BACKWARDS:
        raise ValueError(f"exact_backward must be one of {EXACT_BACKWARDS}, got {exact_backward!r}")
    batch, heads, length, dim = q.shape
    if out_dtype is None:
        out_dtype = q.dtype
    elif out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got {out_dtype!r}")
    kernels = _kernels(backend, q.device)  # an unavailable backend fails in every mode, before any work
    lsh = not (exact or num_hashes == 0)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kernels.fused is not None and not grads:
        # A code is the sign pattern of x·w, the same for q and q̂: LSH inference needs no normalising.
        hashes = num_hashes if lsh else 0
        return kernels.fused(q, k, v, key_mask, hashes, hash_bits, seed, fast_hash, int8_hash).to(out_dtype)
    # q̂ and k̂ serve exact mode and LSH mode's backward: an LSH forward without gradients needs the codes alone
    needs_hats = grads or not lsh
    q_hat, k_hat, values, keep = _prepare(q, k, v, key_mask, half_values=lsh and kernels.half_values,
                                          normalize=needs_hats)
    flat = (batch * heads, length, dim)
    # the C++ kernels take contiguous (BH, N, D) rows; a transposed (B, N, H, D) input is not
    v_flat = values.reshape(flat).contiguous()
    if needs_hats:
        q_flat, k_flat = (t.reshape(flat).contiguous() for t in (q_hat, k_hat))
    if not lsh:
        exact_fn = kernels.exact or YosoExactFn.apply
        out = exact_fn(q_flat, k_flat, v_flat, keep, hash_bits, exact_backward == "true")
    else:
        masked = (keep == 0)[:, None, :]  # (BH, 1, N)
        q_codes, k_codes = (
            # the raw q, k as the fused path hashes them, so that training and inference agree bit for bit
            kernels.codes(x.detach().float(), num_hashes, hash_bits, seed, fast_hash, int8_hash)
            .view(batch * heads, num_hashes, length)  # (B, H, m, N) codes
            .masked_fill(masked, -1)
            for x in (q, k)
        )
        if grads:
            out = YosoLSHFn.apply(q_flat, k_flat, v_flat, q_codes, k_codes, hash_bits, kernels)
        else:
            out = kernels.cumulate(q_codes, k_codes, v_flat, hash_bits)
    return out.view(batch, heads, length, dim).to(out_dtype)


class YosoReferenceFn(torch.autograd.Function):
    """weights·V for dense weights (BH, N, N), with the eq. 11/13 backward written densely.

    forward(q, k, v, weights, hash_bits): q, k, v (BH, N, D) fp32, weights (BH, N, N) fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, weights, hash_bits):
        ctx.save_for_backward(q, k, v, weights)
        ctx.hash_bits = hash_bits
        return weights @ v

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, weights = ctx.saved_tensors
        grad_v = weights.transpose(1, 2) @ grad_out
        scaled = (grad_out @ v.transpose(1, 2)) * weights * (ctx.hash_bits / 2)
        return scaled @ k, scaled.transpose(1, 2) @ q, grad_v, None, None


def yoso_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    *,
    num_hashes: int = 32,
    hash_bits: int = 8,
    seed: int = 0,
    exact: bool = False,
    fast_hash: bool = True,
    backend: str = "auto",
    int8_hash: bool = False,
) -> torch.Tensor:
    """Readable twin of :func:`yoso_attention` (same signature, shapes, dtypes and codes).

    Builds the dense (N×N) weight matrix — E[B] in exact mode, the mean collision matrix
    of :func:`hash_codes_ref` otherwise — zeroes padded keys and queries, and multiplies by
    V. Backward: :class:`YosoReferenceFn` (eq. 11 and the eq. 13 lower bound, densely).
    backend is checked but unused: this is always pure PyTorch.
    """
    _check_args(q, k, v, key_mask, num_hashes, hash_bits, seed, backend)
    batch, heads, length, dim = q.shape
    q_hat, k_hat, values, keep = _prepare(q, k, v, key_mask)
    q_hat, k_hat, values = (t.reshape(batch * heads, length, dim) for t in (q_hat, k_hat, values))
    if exact or num_hashes == 0:
        weights = collision_probability(q_hat.detach(), k_hat.detach(), hash_bits)
    else:
        args = dict(num_hashes=num_hashes, hash_bits=hash_bits, seed=seed, fast_hash=fast_hash, int8=int8_hash)
        # the raw rows, as yoso_attention hashes them (a code is a sign pattern; int8 rounding is per row)
        q_codes = hash_codes_ref(q.detach(), **args).view(batch * heads, num_hashes, length)
        k_codes = hash_codes_ref(k.detach(), **args).view(batch * heads, num_hashes, length)
        weights = torch.zeros(batch * heads, length, length, device=q.device)
        for h in range(num_hashes):
            weights += (q_codes[:, h, :, None] == k_codes[:, h, None, :]).float()
        weights /= num_hashes
    weights = weights * keep[:, :, None] * keep[:, None, :]
    out = YosoReferenceFn.apply(q_hat, k_hat, values, weights, hash_bits)
    return out.view(batch, heads, length, dim).to(q.dtype)
