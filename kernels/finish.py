"""What a YOSO layer does to the attention output after the op: N-YOSO's row norm, then YOSO-C's
depthwise convolution of the masked values, added.

:func:`attention_finish` runs it as one C++ pass over the output, in place, for CPU fp32 inference
(the PyTorch ops it replaces made four passes and three temporaries and cost about a quarter of a
layer's self-attention on 2 cores); everywhere else, and whenever gradients are needed, it is
:func:`attention_finish_ref`, the same formula in PyTorch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORM_EPS = 1e-12  # F.normalize's default


def attention_finish_ref(context: torch.Tensor, v: torch.Tensor, conv_weight: torch.Tensor | None,
                         key_mask: torch.Tensor | None, *, normalize: bool = True,
                         eps: float = NORM_EPS) -> torch.Tensor:
    """context, v (B, H, N, D); conv_weight the (H, 1, W, 1) weight of a depthwise Conv2d over the
    sequence (W odd, zero padding W // 2) or None; key_mask (B, N) bool or 0/1 or None (1 = real).
    Returns context / max(|context|, eps) per row (if normalize) + conv(v masked by key_mask)."""
    out = F.normalize(context, p=2.0, dim=-1, eps=eps) if normalize else context
    if conv_weight is None:
        return out
    masked_v = v if key_mask is None else v * key_mask[:, None, :, None].to(v.dtype)
    heads, window = conv_weight.shape[0], conv_weight.shape[2]
    return out + F.conv2d(masked_v, conv_weight, padding=(window // 2, 0), groups=heads)


def _fast(context: torch.Tensor, v: torch.Tensor, conv_weight: torch.Tensor | None, backend: str) -> bool:
    if backend == "torch" or context.device.type != "cpu" or v.device.type != "cpu":
        return False
    if context.dtype != torch.float32 or v.dtype not in (torch.float32, torch.bfloat16) or context.shape != v.shape:
        return False
    tensors = [t for t in (context, v, conv_weight) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if context.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    return conv_weight is None or conv_weight.dim() == 4 and conv_weight.shape[1] == conv_weight.shape[3] == 1


def attention_finish(context: torch.Tensor, v: torch.Tensor, conv_weight: torch.Tensor | None,
                     key_mask: torch.Tensor | None, *, normalize: bool = True, eps: float = NORM_EPS,
                     backend: str = "auto", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`attention_finish_ref`'s result in ``out_dtype`` (None: ``context``'s). On the C++ path (CPU, fp32
    ``context``, ``v`` fp32 or bf16 (read as its exact fp32 values), no gradients, backend not "torch", the
    extension built) ``context`` is overwritten: pass a tensor you own, such as the attention op's fresh output.
    It is returned itself, or for ``out_dtype`` bf16 a copy with its strides that the same pass rounded as
    ``.to(torch.bfloat16)`` rounds."""
    if _fast(context, v, conv_weight, backend):
        from ._build import cpu_extension

        ext = cpu_extension()
        if ext is not None:
            weight = None if conv_weight is None else conv_weight.detach().reshape(conv_weight.shape[0], -1).contiguous()
            keep = None if key_mask is None else key_mask.to(torch.bool).contiguous()
            out16 = torch.empty_like(context, dtype=torch.bfloat16) if out_dtype == torch.bfloat16 else None
            ext.attention_finish(context, v, weight, keep, normalize, eps, out16)
            if out16 is not None:
                return out16
            return context if out_dtype is None else context.to(out_dtype)
    out = attention_finish_ref(context, v, conv_weight, key_mask, normalize=normalize, eps=eps)
    return out if out_dtype is None else out.to(out_dtype)
