"""One cache for tensors made from a module's parameters (a bf16 copy, packed or quantized weights)."""

from __future__ import annotations

import torch
from torch import nn

from yoso_serve.kernels import tensor_key


def derived(owner: nn.Module, slot: str, sources: list[torch.Tensor | None], make, *extra):
    """``make()``, kept on ``owner`` as ``slot`` (its key as ``slot + "_key"``) and made again whenever a tensor of
    ``sources`` (None ones left out) changed in place or was replaced, or ``extra`` changed. A source is known by its
    version and address (``kernels.tensor_key``). The cache holds its sources, so that no new tensor takes one's
    address while it is kept."""
    held = [t for t in sources if t is not None]
    key = (*(tensor_key(t) for t in held), *extra)
    if getattr(owner, slot + "_key", None) != key:
        setattr(owner, slot, (make(), [t.detach() for t in held]))
        setattr(owner, slot + "_key", key)
    return getattr(owner, slot)[0]
