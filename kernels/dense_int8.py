"""The int8 dense layers' arithmetic on CPU (``--dense-dtype int8``): each row of the input quantized on its own
(optionally divided per channel by a smoothing vector first), oneDNN's int8 GEMM (``torch._int_mm``, exact int32
sums), and the int32 sums scaled back, with the bias and a residual added.

:func:`int8_linear` runs the two passes around the GEMM in C++ (csrc/yoso_cpu_quant.cpp), one pass each, where
the extension is built; :func:`int8_linear_ref` is the same formula in PyTorch ops and the same bits (the C++
makes the same IEEE operations in the same order). In PyTorch ops the passes took longer than the GEMM itself.

Why per row: a per-tensor activation scale would depend on the other texts of the batch. With one scale per
row and exact int32 sums, a row's bits never depend on the row count or on how the library blocks the GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ABS_MAX = 1e-12


def _check(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise ValueError(f"weight_q must be (out, in) int8, got {tuple(weight_q.shape)} {weight_q.dtype}")
    if x.shape[-1] != weight_q.shape[1]:
        raise ValueError(f"x's last dimension must be the weight's in = {weight_q.shape[1]}, got {x.shape[-1]}")
    if weight_scale.shape != (weight_q.shape[0],):
        raise ValueError(f"weight_scale must be ({weight_q.shape[0]},), got {tuple(weight_scale.shape)}")


def int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (R, K) fp32 → (int8 (R, K), scale (R, 1) fp32): symmetric, each row on its own (scale max|row| / 127,
    round half to even); a zero row keeps the scale MIN_ABS_MAX / 127. Weights (one row per output channel) and
    activations are quantized alike."""
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(MIN_ABS_MAX) / 127
    return torch.round(rows / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_linear_ref(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    *, smooth: torch.Tensor | None = None, start: torch.Tensor | None = None,
                    gelu: bool = False) -> torch.Tensor:
    """x (..., in) fp32 → (..., out) fp32 ≈ ``F.linear(x, W, bias) + start``, where ``weight_q`` (out, in) int8 and
    ``weight_scale`` (out,) hold ``W · smooth`` quantized per output channel: the rows of ``x / smooth`` are
    quantized each on its own (scale max|row| / 127, round half to even), multiplied in int32, and scaled back;
    ``gelu``: then GELU (erf form)."""
    _check(x, weight_q, weight_scale)
    rows = x.reshape(-1, x.shape[-1]).float()
    if smooth is not None:
        rows = rows / smooth
    q, scale = int8_rows(rows)
    out = torch._int_mm(q, weight_q.t()).float().mul_(scale).mul_(weight_scale)  # (R, out)
    if bias is not None:
        out.add_(bias)
    if start is not None:
        out.add_(start.reshape(out.shape))
    if gelu:
        out = F.gelu(out)
    return out.view(*x.shape[:-1], weight_q.shape[0])


def _fast(x: torch.Tensor, start: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
            and (start is None or (start.dtype == torch.float32 and start.device.type == "cpu")))


def int8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                *, smooth: torch.Tensor | None = None, start: torch.Tensor | None = None, gelu: bool = False,
                backend: str = "auto") -> torch.Tensor:
    """:func:`int8_linear_ref`'s result, bit for bit without ``gelu``; the passes around the GEMM in C++ on CPU (fp32
    ``x``, the extension built, ``backend`` not "torch"). ``gelu`` there is fused into the last pass, within about
    1e-7 · |x| of aten's (erf from Abramowitz and Stegun 7.1.26, exp by a polynomial): the same bits on every run
    and at any row count, not aten's bits."""
    if backend != "torch" and _fast(x, start):
        from ._build import cpu_extension

        ext = cpu_extension()
        if ext is not None:
            _check(x, weight_q, weight_scale)
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            q, scale = ext.quantize_rows(rows, None if smooth is None else smooth.float().contiguous())
            acc = torch._int_mm(q, weight_q.t())
            out = ext.dequantize_rows(acc, scale, weight_scale.float().contiguous(),
                                      None if bias is None else bias.detach().float().contiguous(),
                                      None if start is None else start.reshape(acc.shape).contiguous(), gelu)
            return out.view(*x.shape[:-1], weight_q.shape[0])
    return int8_linear_ref(x, weight_q, weight_scale, None if bias is None else bias.detach(), smooth=smooth,
                           start=start, gelu=gelu)
