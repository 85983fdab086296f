"""YOSO attention as a core (Zeng et al., 2021): the kernels' op plus N-YOSO's output norm.

The only core whose cost/accuracy is chosen per call: ``hashes`` = m LSH samples (O(N·m)) or 0
for the exact expectation YOSO-E (O(N²)). Hash projections are seeded per layer. The YOSO-C
convolution stays in the layer (``attention.self.conv``) so that state-dict keys match
transformers' ``YosoModel``.
"""

from __future__ import annotations

import torch

from yoso_serve.kernels import yoso_attention
from yoso_serve.kernels.finish import attention_finish

from .base import AttentionCore, register


@register
class YosoAttentionCore(AttentionCore):
    """yoso_attention(q, k, v), ℓ2-normalise each head's output row (N-YOSO, eq. 8), then add the
    layer's YOSO-C convolution of the masked values when it has one (one pass: kernels/finish.py)."""

    name = "yoso"
    uses_hashes = True

    def __init__(self, config, seed: int):
        super().__init__(config, seed)
        self.hash_bits = config.hash_code_len
        self.fast_hash = config.use_fast_hash
        self.int8_hash = bool(config.hash_int8)
        self.backend = config.attention_backend
        # training knob, not saved: "true" gives exact mode the derivative of its forward
        self.exact_backward = "bound"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                *, hashes: int, conv: torch.nn.Conv2d | None = None) -> torch.Tensor:
        context = yoso_attention(q, k, v, key_mask, num_hashes=hashes, hash_bits=self.hash_bits, seed=self.seed,
                                 exact=hashes == 0, fast_hash=self.fast_hash, backend=self.backend,
                                 exact_backward=self.exact_backward, int8_hash=self.int8_hash,
                                 out_dtype=torch.float32)
        # N-YOSO: the cumulation is not divided by its expected count; unit norm per head instead.
        # The sum stays fp32 until it is normalised: in fp16 it overflows at a few thousand tokens.
        out = attention_finish(context, v, None if conv is None else conv.weight, key_mask,
                               backend=self.backend)  # (B, H, N, D)
        return out.to(v.dtype)
