"""YOSO attention as a core (Zeng et al., 2021): the kernels' op plus N-YOSO's output norm.

The only core whose cost/accuracy is chosen per call: ``hashes`` = m LSH samples (O(N·m)) or 0
for the exact expectation YOSO-E (O(N²)). Hash projections are seeded per layer. The YOSO-C
convolution stays in the layer (``attention.self.conv``) so that state-dict keys match
transformers' ``YosoModel``.

Exact mode runs the kernels' op, or for inference with ``exact_kernel = "flex"``
(:func:`set_exact_kernel`) one fused FlexAttention kernel (kernels/flex.py): the same rows after
N-YOSO's norm. Should that kernel fail to compile, the core logs why, says so in
:func:`exact_kernel_info` and goes back to the op for the rest of the process.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from yoso_serve.kernels import cpu_kernels_built, flex, yoso_attention
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
        # inference knob, not saved: "flex" runs exact mode as one fused kernel (set_exact_kernel)
        self.exact_kernel = "op"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                *, hashes: int, conv: torch.nn.Conv2d | None = None) -> torch.Tensor:
        context = self._flex(q, k, v, key_mask) if hashes == 0 and self.exact_kernel == "flex" else None
        if context is None:
            context = yoso_attention(q, k, v, key_mask, num_hashes=hashes, hash_bits=self.hash_bits, seed=self.seed,
                                     exact=hashes == 0, fast_hash=self.fast_hash, backend=self.backend,
                                     exact_backward=self.exact_backward, int8_hash=self.int8_hash,
                                     out_dtype=torch.float32)
        # N-YOSO: the cumulation is not divided by its expected count; unit norm per head instead.
        # The sum stays fp32 until it is normalised: in fp16 it overflows at a few thousand tokens.
        return attention_finish(context, v, None if conv is None else conv.weight, key_mask, backend=self.backend,
                                out_dtype=v.dtype)  # (B, H, N, D)

    def reads_bf16(self) -> bool:
        """Whether bf16 q, k, v give the results of their exact fp32 values: the op widens them (the C++ kernels
        read them as they are); the fused kernel would compute in bf16, and the PyTorch finish would convolve in
        bf16. The output then comes back in bf16."""
        return self.exact_kernel == "op" and self.backend != "torch" and cpu_kernels_built()

    def _flex(self, q, k, v, key_mask) -> torch.Tensor | None:
        """Exact mode's rows up to a factor per row from the fused kernel, or None: gradients are
        wanted (the op has the backwards), or the kernel failed once in this process."""
        global _flex_failure
        if _flex_failure is not None or torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return None
        try:
            return flex.exact_attention_flex(q, k, v, key_mask, self.hash_bits)
        except Exception as exc:  # a compiler or driver failure: serve with the op rather than fail requests
            _flex_failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
            log.warning("exact_kernel flex failed, exact mode runs the op from now on: %s", _flex_failure)
            return None


EXACT_KERNELS = ("op", "flex")
log = logging.getLogger(__name__)
_flex_failure: str | None = None  # why the fused exact kernel stopped being used, once it failed


def set_exact_kernel(module: nn.Module, kernel: str) -> None:
    """Run exact mode (``hashes`` 0) of every YOSO core in ``module`` with ``kernel``: "op" (the kernels'
    op, the default) or "flex" (kernels/flex.py, inference only). ValueError naming why "flex" cannot run
    on the module's device."""
    if kernel not in EXACT_KERNELS:
        raise ValueError(f"exact kernel must be one of {EXACT_KERNELS}, got {kernel!r}")
    cores = [m for m in module.modules() if isinstance(m, YosoAttentionCore)]
    if kernel == "flex" and cores:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if (why := flex.unavailable(device)) is not None:
            raise ValueError(f"exact kernel flex cannot run on {device}: {why}")
    for core in cores:
        core.exact_kernel = kernel


def exact_kernel_info(module: nn.Module) -> dict:
    """What /info shows: the exact-mode kernel the YOSO cores run, and why flex stopped if it did."""
    kernels = {m.exact_kernel for m in module.modules() if isinstance(m, YosoAttentionCore)}
    info: dict = {"exact_kernel": "flex" if "flex" in kernels and _flex_failure is None else "op"}
    if "flex" in kernels and _flex_failure is not None:
        info["exact_kernel_failure"] = _flex_failure
    return info


def warm_exact_kernel(module: nn.Module, max_tokens: int) -> int:
    """Compile the fused exact kernel for every length bucket up to ``max_tokens``, for one input and for
    batches, so that no request waits on a compilation. Returns the buckets compiled: 0 when the cores
    run the op, or the kernel failed (logged; the op serves)."""
    core = next((m for m in module.modules() if isinstance(m, YosoAttentionCore) and m.exact_kernel == "flex"), None)
    param = next(module.parameters(), None)
    if core is None or param is None:
        return 0
    done = 0
    for n in flex.buckets(max_tokens):
        for batch in (1, 2):
            x = torch.randn(batch, core.heads, n, core.head_dim, device=param.device, dtype=param.dtype)
            with torch.inference_mode():
                if core._flex(x, x, x, None) is None:
                    return 0
        done += 1
    return done
