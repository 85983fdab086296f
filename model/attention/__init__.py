"""Attention cores behind one interface: ``forward(q, k, v, key_mask) -> (B, H, N, D)``.

One module per type — ``yoso`` (the project's), ``softmax``, ``linformer``, ``reformer``,
``linear``, ``sparse``, ``nystrom`` — each registering its class under its
``EncoderConfig.attention_type`` name; :func:`build_attention` picks one for a layer. See
:mod:`.base` for the padding contract every core honours.
"""

from . import linear, linformer, nystrom, reformer, softmax, sparse, yoso  # noqa: F401  (register the cores)
from .base import REGISTRY, AttentionCore, register


def build_attention(config, seed: int) -> AttentionCore:
    """The core of ``config.attention_type`` for one layer; ``seed`` is that layer's (hash) seed."""
    if config.attention_type not in REGISTRY:
        raise ValueError(f"attention_type must be one of {sorted(REGISTRY)}, got {config.attention_type!r}")
    return REGISTRY[config.attention_type](config, seed)


__all__ = ["REGISTRY", "AttentionCore", "build_attention", "register"]
