"""The interface every attention core implements, the registry, and the padding-mask helpers.

An attention core is the part of a self-attention layer between the layer's own Q/K/V linears
and its output projection: ``forward(q, k, v, key_mask) -> (B, H, N, D)``. It is built from the
model config and a seed (distinct per layer, fixed per model) by :func:`build_attention`; a
core whose math draws random numbers (YOSO's hyperplanes, Reformer's rotations) draws them
from that seed only, so outputs are deterministic.

Padding contract, shared by all cores: ``key_mask`` (B, N) bool, True = real token, or None
(no padding). Padded keys contribute nothing; padded query rows are zero. Inputs are right
padded, so a text's output is the same alone or padded inside a batch.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

REGISTRY: dict[str, type["AttentionCore"]] = {}

# Additive logit of a disallowed (masked) pair: finite so that a row with no allowed key gives
# a uniform distribution instead of NaN (such rows are padded queries, zeroed afterwards).
MASKED_LOGIT = -1e9


class AttentionCore(nn.Module):
    """Base class: ``forward(q, k, v, key_mask) -> (B, H, N, D)``.

    q, k, v: (B, H, N, D) fp32|fp16|bf16, the layer's projections split into heads;
    key_mask: (B, N) bool (True = real token) or None. Subclasses set ``name`` and register.
    ``uses_hashes`` is True only for YOSO, whose forward also takes ``hashes``.
    """

    name: ClassVar[str] = ""
    uses_hashes: ClassVar[bool] = False

    def __init__(self, config, seed: int):
        super().__init__()
        # YOSO reads it on every call (so it can be re-pointed); Reformer draws its rotations from it once.
        self.seed = int(seed)
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim

    def reads_bf16(self) -> bool:
        """Whether bf16 q, k, v from the layer's bf16 projections may come in as they are, giving the results of
        their fp32 values (the output then in bf16). None of the others computes in fp32 whatever it is given."""
        return False


def register(cls: type[AttentionCore]) -> type[AttentionCore]:
    """Class decorator: make ``cls`` the core of ``attention_type == cls.name``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"attention core {cls.__name__} needs a unique name, got {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> None:
    """ValueError naming the first way q, k, v, key_mask break the (B, H, N, D) contract."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"q, k, v must be (B, H, N, D) with one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if key_mask is not None and tuple(key_mask.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"key_mask must be (B, N) = {(q.shape[0], q.shape[2])}, got {tuple(key_mask.shape)}")


def real_tokens(key_mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """(B, N) bool, True = real token (all True when there is no mask)."""
    if key_mask is None:
        return torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
    return key_mask.to(device=q.device, dtype=torch.bool)


def zero_padded_queries(out: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """out (B, H, N, D) with the rows of padded queries set to zero (NaN included)."""
    if key_mask is None:
        return out
    return out.masked_fill(~key_mask.to(device=out.device, dtype=torch.bool)[:, None, :, None], 0.0)


def zero_padded_keys(x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """x (B, H, N, D) with padded positions zeroed, so that sums over positions skip them."""
    return zero_padded_queries(x, key_mask)
