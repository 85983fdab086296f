"""Shared inputs and independent oracles for the YOSO operator tests (fixture ``oracles``).

The oracles here are written from the paper's formulas in float64, without calling
anything in yoso_serve.kernels, so a bug in the operators cannot hide in them. Test files
get them through the ``oracles`` fixture: with --import-mode=importlib a conftest is not
importable as a module.
"""

from __future__ import annotations

import math
import types

import pytest
import torch


def random_qkv(batch: int, heads: int, length: int, dim: int, seed: int = 0, dtype=torch.float32):
    """Three (B, H, N, D) tensors drawn from a local generator."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, length, dim, generator=gen).to(dtype) for _ in range(3))


def lengths_mask(lengths: list[int], length: int) -> torch.Tensor:
    """(B, N) bool mask, True for the first lengths[b] tokens of row b."""
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]


def naive_collision_weights(q: torch.Tensor, k: torch.Tensor, hash_bits: int) -> torch.Tensor:
    """float64 (…, N, N): (1 − arccos(q̂·k̂)/π)^τ, eq. 6, normalising explicitly."""
    q = q.double() / q.double().norm(dim=-1, keepdim=True)
    k = k.double() / k.double().norm(dim=-1, keepdim=True)
    cosine = torch.einsum("...id,...jd->...ij", q, k).clamp(-1.0, 1.0)
    return (1.0 - torch.acos(cosine) / math.pi) ** hash_bits


def naive_yoso_e(q, k, v, key_mask, hash_bits):
    """float64 YOSO-E output (B, H, N, D) with padded keys removed and padded queries zeroed."""
    weights = naive_collision_weights(q, k, hash_bits)  # (B, H, N, N)
    if key_mask is not None:
        keep = key_mask.double()
        weights = weights * keep[:, None, None, :] * keep[:, None, :, None]
    return weights @ v.double()


def naive_lower_bound_grads(q, k, v, key_mask, grad_out, hash_bits):
    """float64 gradients w.r.t. the un-normalised q, k and v of the exact op (eq. 11, 13–14).

    grad V = Pᵀ·dO; grad q̂_i = τ/2 Σ_j P_ij (dO_i·V_j) k̂_j and symmetrically for k̂; then the
    chain rule through x ↦ x/‖x‖, whose Jacobian is (I − x̂x̂ᵀ)/‖x‖.
    """
    q, k, v, grad_out = (t.double() for t in (q, k, v, grad_out))
    q_hat = q / q.norm(dim=-1, keepdim=True)
    k_hat = k / k.norm(dim=-1, keepdim=True)
    weights = naive_collision_weights(q, k, hash_bits)
    if key_mask is not None:
        keep = key_mask.double()
        weights = weights * keep[:, None, None, :] * keep[:, None, :, None]
    grad_v = weights.transpose(-1, -2) @ grad_out
    coupling = (grad_out @ v.transpose(-1, -2)) * weights * (hash_bits / 2)  # (B, H, N, N)
    grad_q_hat = coupling @ k_hat
    grad_k_hat = coupling.transpose(-1, -2) @ q_hat

    def through_norm(x, x_hat, g):
        return (g - x_hat * (x_hat * g).sum(-1, keepdim=True)) / x.norm(dim=-1, keepdim=True)

    return through_norm(q, q_hat, grad_q_hat), through_norm(k, k_hat, grad_k_hat), grad_v


def dense_collisions(q_codes: torch.Tensor, k_codes: torch.Tensor) -> torch.Tensor:
    """float64 (BH, Nq, Nk) B matrix averaged over hashes, from (BH, m, N) codes; negative = masked."""
    equal = q_codes[:, :, :, None] == k_codes[:, :, None, :]  # (BH, m, Nq, Nk)
    valid = (q_codes[:, :, :, None] >= 0) & (k_codes[:, :, None, :] >= 0)
    return (equal & valid).double().mean(dim=1)


@pytest.fixture(scope="session")
def oracles() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        random_qkv=random_qkv,
        lengths_mask=lengths_mask,
        naive_collision_weights=naive_collision_weights,
        naive_yoso_e=naive_yoso_e,
        naive_lower_bound_grads=naive_lower_bound_grads,
        dense_collisions=dense_collisions,
    )


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread.

    The pure-PyTorch ops loop over hashes with many small tensor ops; on a 2-core CI box
    shared with other jobs, OpenMP hand-offs for such small ops cost more than they save.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ext():
    """The built C++ extension; a build failure fails the test (the project must build it)."""
    from yoso_serve.kernels import _build

    module = _build.cpu_extension()
    if module is None:
        pytest.fail(f"the C++ extension must build in this project: {_build.backend_info()['reason']}")
    return module
