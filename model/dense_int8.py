"""Int8 dense layers on CPU (``--dense-dtype int8``): per-output-channel int8 weights, activations quantized
per row as they come, products through torch's ``_int_mm`` (oneDNN's int8 GEMM, int32 sums).

Why per row: a per-tensor activation scale would depend on the other texts of the batch. With one scale per
row and exact int32 sums, a row's bits never depend on the row count or on how the library blocks the GEMM."""

from __future__ import annotations

import torch


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) fp32 → (int8 (out, in), scale (out,) fp32): symmetric, one scale per output channel."""
    scale = weight.detach().abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(weight.detach() / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) fp32 → (..., out) fp32 ≈ F.linear(x, weight, bias), each row quantized on its own."""
    rows = x.reshape(-1, x.shape[-1])  # (R, in)
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127  # (R, 1)
    q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
    out = torch._int_mm(q, weight_q.t()).float().mul_(scale).mul_(weight_scale)  # (R, out)
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], weight_q.shape[0])
