"""Seeded LSH hash codes for YOSO attention (§3.2 of the paper).

Two hash families, both "concatenate ``hash_bits`` sign bits" (Charikar, 2002):

* Gaussian hyperplanes: ``code = Σ_t 2^t · [x·w_t > 0]`` with ``w_t ~ N(0, I)``.
* Fast approximate rotation (Andoni et al., 2015): ``R = H·D3·H·D2·H·D1`` where ``H`` is
  the Walsh–Hadamard matrix and ``Di`` random ±1 diagonals, applied to ``x`` zero-padded
  to ``P`` = the next power of two ≥ max(D, hash_bits); the code is the signs of the first
  ``hash_bits`` coordinates of ``R·x``. Every hash has its own three diagonals.

Projections depend only on (seed, head, num_hashes, hash_bits, D, fast_hash): each head
draws them from its own ``torch.Generator`` seeded from (seed, head), never the global RNG,
so a sequence gets the same codes alone or inside any batch, and q and k share them.

``hash_codes`` applies the first ``hash_bits`` rows of the rotation as one cached (D, m·τ)
matrix: ``R`` is linear, so this is the same hash family as ``hash_codes_ref`` (which runs
the three Walsh–Hadamard rounds plainly) at the cost of one GEMM: the O(τ·log D) butterfly
pays off in a fused kernel, not as 3·log2(P) PyTorch passes per hash (x of (1, 12, 4096, 64),
m = 32, τ = 8, one thread of a shared 2-core CPU: 0.19 s here, 3.4 s in hash_codes_ref).
The two agree exactly except where a projection lies within rounding of zero.

Int8 hashing (``int8=True``, what a model with ``hash_int8`` runs): every projection column is
scaled to 127 at its largest |entry| and rounded (a fixed, slightly different plane: still a seeded
hash, no approximation), and every row x is hashed as ``x8 = round((x / max|x|) · 127)`` (round half
to even; a zero row stays zero), the sums taken exactly in integers. Only a row's own rounding moves a
bit, and only where its projection is within about 1 % of zero, where the bit is a coin flip anyway:
about 0.2 % of bits move for Gaussian rows, and a hash code changes with them. On CPUs with AVX-512
VNNI the C++ kernel runs those sums as u8 × s8 dot products, about 3× the fp32 GEMM.

The fast family is only approximately random, and worst for small D: in P ≤ 8 dimensions
three Hadamard rounds mix poorly (collision rates off (1 − θ/π)^τ by many σ), and for
D < 8 some rotation rows vanish on the first D coordinates, so those bits are always 0.
For D ≥ 32 the collision rates match the Gaussian family's within sampling error
(tests/kernels/test_yoso_stats.py).
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ._loaded import loaded_cpu_extension

MAX_HASH_BITS = 16
# int8 hashing sums D products of |x8|, |w| <= 127 in fp32 (PyTorch and the C++ fallbacks): exact below 2^24.
MAX_INT8_DIM = 1024
# Rotations are built for this many hashes at a time, bounding the (c, D, P) float64 scratch.
_HASHES_PER_BUILD = 64
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_hash_args(num_hashes: int, hash_bits: int, seed: int) -> None:
    """Raise ValueError unless num_hashes ≥ 1, 1 ≤ hash_bits ≤ 16 and seed is an int."""
    if isinstance(num_hashes, bool) or not isinstance(num_hashes, int) or num_hashes < 1:
        raise ValueError(f"num_hashes must be an int ≥ 1 for hash codes, got {num_hashes!r}")
    if isinstance(hash_bits, bool) or not isinstance(hash_bits, int):
        raise ValueError(f"hash_bits must be an int in 1..{MAX_HASH_BITS}, got {hash_bits!r}")
    if not 1 <= hash_bits <= MAX_HASH_BITS:
        raise ValueError(f"hash_bits must be in 1..{MAX_HASH_BITS}, got {hash_bits}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def check_input(x: torch.Tensor, name: str) -> None:
    """Raise ValueError unless x is a finite (B, H, N, D) fp32/fp16/bf16 tensor with N, D ≥ 1
    (finiteness of CUDA tensors only under anomaly detection: the check is a host sync)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have rank 4 (B, H, N, D), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    batch, heads, length, dim = x.shape
    if batch == 0 or heads == 0:
        raise ValueError(f"{name} must have B ≥ 1 and H ≥ 1, got shape {tuple(x.shape)}")
    if length == 0:
        raise ValueError(f"{name} has sequence length N = 0; N must be ≥ 1")
    if dim == 0:
        raise ValueError(f"{name} has head dimension D = 0; D must be ≥ 1")
    # On CUDA, reading the answer back waits for the GPU on every call and makes the op
    # impossible to capture in a CUDA graph: there the check runs only under torch's NaN-hunting
    # debug mode (torch.autograd.set_detect_anomaly), and a NaN or inf otherwise flows on.
    if x.is_cuda and not torch.is_anomaly_enabled():
        return
    # A CPU (B, H, N, D) fp32 or bf16 view with unit stride along D, with the C++ module already loaded: its
    # all_finite reads the exponent bits once, no temporaries (the sum below converted a strided bf16 view to
    # fp32 first: about 1 % of an int8 forward).
    ext = loaded_cpu_extension() if x.device.type == "cpu" and x.dim() == 4 else None
    if ext is not None and x.dtype in (torch.float32, torch.bfloat16) and (x.stride(3) == 1 or x.shape[3] == 1):
        if not ext.all_finite(x):
            raise ValueError(f"{name} contains NaN or inf")
        return
    # Elsewhere: any NaN or ±inf makes the sum non-finite, so a finite sum proves the tensor finite in one
    # reduction; isfinite().all() builds a bool tensor and ran ~4 passes, ~7% of a serving
    # forward. Only a non-finite sum (possibly a finite overflow) pays for the exact check. bf16 sums
    # in its own dtype (fp32's range, fp32 accumulation): asking for an fp32 result made an fp32 copy first.
    total = x.sum() if x.dtype == torch.bfloat16 else x.sum(dtype=torch.float32)
    if not bool(torch.isfinite(total)) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf")


def padded_dim(dim: int, hash_bits: int) -> int:
    """P: the power of two ≥ max(dim, hash_bits) the fast rotation works in."""
    need = max(dim, hash_bits)
    return 1 << (need - 1).bit_length()


def head_generator(seed: int, head: int) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, head), stable across processes."""
    digest = hashlib.blake2b(f"yoso-lsh:{seed}:{head}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def gaussian_planes(seed: int, head: int, num_hashes: int, hash_bits: int, dim: int) -> torch.Tensor:
    """(m, D, τ) fp32 hyperplane normals for one head."""
    gen = head_generator(seed, head)
    return torch.randn(num_hashes, dim, hash_bits, generator=gen, dtype=torch.float32)


def rotation_signs(seed: int, head: int, num_hashes: int, hash_bits: int, dim: int) -> torch.Tensor:
    """(m, 3, P) fp32 ±1 diagonals D1, D2, D3 of the fast rotation, per hash, for one head."""
    gen = head_generator(seed, head)
    size = padded_dim(dim, hash_bits)
    bits = torch.randint(0, 2, (num_hashes, 3, size), generator=gen)
    return (bits * 2 - 1).to(torch.float32)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh–Hadamard transform over the last dim (a power of two)."""
    size = x.shape[-1]
    lead = x.shape[:-1]
    half = 1
    while half < size:
        pairs = x.reshape(*lead, size // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((low + high, low - high), dim=-2).reshape(*lead, size)
        half *= 2
    return x


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """H·D3·H·D2·H·D1 · x for x (..., P) and signs (3, P)."""
    for diagonal in signs:
        x = walsh_hadamard(x * diagonal)
    return x


@functools.lru_cache(maxsize=512)
def _head_matrix(seed: int, head: int, num_hashes: int, hash_bits: int, dim: int, fast_hash: bool) -> torch.Tensor:
    """(D, m·τ) fp32 matrix whose column h·τ + t projects onto bit t of hash h."""
    if not fast_hash:
        planes = gaussian_planes(seed, head, num_hashes, hash_bits, dim)  # (m, D, τ)
        return planes.permute(1, 0, 2).reshape(dim, num_hashes * hash_bits).contiguous()
    signs = rotation_signs(seed, head, num_hashes, hash_bits, dim).double()  # (m, 3, P)
    basis = torch.eye(signs.shape[-1], dtype=torch.float64)[:dim]  # rows e_j, j < D
    columns = []
    for start in range(0, num_hashes, _HASHES_PER_BUILD):
        part = signs[start : start + _HASHES_PER_BUILD]  # (c, 3, P)
        rotated = basis.expand(part.shape[0], *basis.shape)  # (c, D, P): R·e_j per hash
        for diagonal in part.unbind(1):  # D1, D2, D3, each (c, P)
            rotated = walsh_hadamard(rotated * diagonal[:, None, :])
        columns.append(rotated[..., :hash_bits].permute(1, 0, 2).reshape(dim, -1))  # (D, c·τ)
    # R·e_j has integer entries of magnitude ≤ P^1.5, so float64 → float32 is exact here.
    return torch.cat(columns, dim=1).to(torch.float32).contiguous()


def _to_int8_levels(t: torch.Tensor, dim: int) -> torch.Tensor:
    """round((t / max|t|) · 127) along ``dim``, as floats (round half to even); all-zero slices stay zero."""
    top = t.abs().amax(dim=dim, keepdim=True)
    return torch.round(t / torch.where(top > 0, top, torch.ones_like(top)) * 127.0)


def int8_planes(proj: torch.Tensor) -> torch.Tensor:
    """(..., D, C) projection → its int8 planes as floats: each column scaled to 127 at its largest |entry|
    and rounded (an all-zero column stays zero)."""
    return _to_int8_levels(proj, -2)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) fp32 → x8 = round((x / max|x|) · 127) per row, as floats; a zero row stays zero.
    The C++ kernels compute the same fp32 division, product and round-half-to-even."""
    return _to_int8_levels(x, -1)


def check_int8_dim(dim: int) -> None:
    if dim > MAX_INT8_DIM:
        raise ValueError(f"int8 hashing takes head dimensions D <= {MAX_INT8_DIM}, got D = {dim}")


@functools.lru_cache(maxsize=64)
def projection_planes(
    seed: int, heads: int, num_hashes: int, hash_bits: int, dim: int, fast_hash: bool, device: torch.device,
    int8: bool = False,
) -> torch.Tensor:
    """(H, D, m·τ) fp32 on device (int8: the int8 planes); cached so repeated forward passes do no host work."""
    mats = torch.stack([_head_matrix(seed, h, num_hashes, hash_bits, dim, fast_hash) for h in range(heads)])
    return (int8_planes(mats) if int8 else mats).to(device)


def _codes_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bits (..., τ) bool → (...) int32 code Σ_t 2^t·bit_t."""
    weights = 1 << torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int32)
    return (bits.to(torch.int32) * weights).sum(-1, dtype=torch.int32)


def hash_codes(
    x: torch.Tensor, *, num_hashes: int, hash_bits: int, seed: int = 0, fast_hash: bool = True, int8: bool = False
) -> torch.Tensor:
    """LSH codes of x.

    x: (B, H, N, D) fp32|fp16|bf16 (projected in fp32; only the direction matters).
    int8: hash with the int8 planes and rows (module docstring); the fp32 sums of integers are exact.
    Returns (B, H, m, N) int32 codes in [0, 2**hash_bits), m = num_hashes.
    """
    check_input(x, "x")
    check_hash_args(num_hashes, hash_bits, seed)
    batch, heads, length, dim = x.shape
    if int8:
        check_int8_dim(dim)
    proj = projection_planes(seed, heads, num_hashes, hash_bits, dim, bool(fast_hash), x.device, bool(int8))
    rows = quantize_rows(x.float()) if int8 else x.float()
    scores = torch.matmul(rows, proj)  # (B, H, N, m·τ)
    bits = scores.view(batch, heads, length, num_hashes, hash_bits) > 0
    return _codes_from_bits(bits).permute(0, 1, 3, 2).contiguous()  # (B, H, m, N)


def hash_codes_ref(
    x: torch.Tensor, *, num_hashes: int, hash_bits: int, seed: int = 0, fast_hash: bool = True, int8: bool = False
) -> torch.Tensor:
    """Readable twin of :func:`hash_codes`: same signature, shapes and projections.

    The fast family runs the three Walsh–Hadamard rounds on the padded input per hash. With int8, each
    hash's planes (the rotation applied to the basis vectors, for the fast family) are quantized per
    column and the quantized rows projected in float64, one hash at a time.
    """
    check_input(x, "x")
    check_hash_args(num_hashes, hash_bits, seed)
    batch, heads, length, dim = x.shape
    device = x.device
    x = x.float().cpu()
    codes = torch.empty(batch, heads, num_hashes, length, dtype=torch.int32)
    for head in range(heads):
        xh = x[:, head]  # (B, N, D)
        if int8:
            check_int8_dim(dim)
            if fast_hash:
                signs = rotation_signs(seed, head, num_hashes, hash_bits, dim).double()
                basis = torch.nn.functional.pad(torch.eye(dim, dtype=torch.float64), (0, signs.shape[-1] - dim))
                planes = torch.stack([rotate(basis, signs[h])[:, :hash_bits] for h in range(num_hashes)])
            else:
                planes = gaussian_planes(seed, head, num_hashes, hash_bits, dim)  # (m, D, τ)
            x8 = quantize_rows(xh).double()
            for h in range(num_hashes):
                plane = int8_planes(planes[h].float()).double()  # (D, τ): each column on its own
                codes[:, head, h] = _codes_from_bits(x8 @ plane > 0)
            continue
        if fast_hash:
            signs = rotation_signs(seed, head, num_hashes, hash_bits, dim)  # (m, 3, P)
            padded = torch.nn.functional.pad(xh, (0, signs.shape[-1] - dim))  # (B, N, P)
            for h in range(num_hashes):
                codes[:, head, h] = _codes_from_bits(rotate(padded, signs[h])[..., :hash_bits] > 0)
        else:
            planes = gaussian_planes(seed, head, num_hashes, hash_bits, dim)  # (m, D, τ)
            for h in range(num_hashes):
                codes[:, head, h] = _codes_from_bits(xh @ planes[h] > 0)
    return codes.to(device)


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad ``t`` along ``dim`` up to ``size`` (zero rows/columns add nothing to an integer sum)."""
    extra = size - t.shape[dim]
    if extra <= 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def int8_codes_gemm(
    x: torch.Tensor, *, num_hashes: int, hash_bits: int, seed: int = 0, fast_hash: bool = True
) -> torch.Tensor:
    """The int8 codes of :func:`hash_codes` (``int8=True``) from one int8×int8→int32 GEMM per head
    (``torch._int_mm``: exact int32 sums) and a sign-pack, so the codes equal the CPU's bit for bit.

    ``torch._int_mm`` on CUDA wants more than 16 rows and K, N multiples of 8; the rows, D and m·τ are
    zero-padded to fit (zeros add nothing to an integer sum; padded rows are dropped).
    """
    check_input(x, "x")
    check_hash_args(num_hashes, hash_bits, seed)
    batch, heads, length, dim = x.shape
    check_int8_dim(dim)
    proj = projection_planes(seed, heads, num_hashes, hash_bits, dim, bool(fast_hash), x.device, True)
    cols = num_hashes * hash_bits
    rows = quantize_rows(x.float()).to(torch.int8).transpose(0, 1).reshape(heads, batch * length, dim)
    k, n_out, m_rows = -(-dim // 8) * 8, -(-cols // 8) * 8, max(batch * length, 17)
    planes = _pad_to(_pad_to(proj.to(torch.int8), 1, k), 2, n_out)
    rows = _pad_to(_pad_to(rows, 2, k), 1, m_rows)
    scores = torch.stack([torch._int_mm(rows[h], planes[h]) for h in range(heads)])  # (H, M, n_out) int32
    scores = scores[:, : batch * length, :cols].reshape(heads, batch, length, num_hashes, hash_bits)
    return _codes_from_bits(scores > 0).permute(1, 0, 3, 2).contiguous()  # (B, H, m, N)
