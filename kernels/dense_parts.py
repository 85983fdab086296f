"""The fp32 sum of a dense layer's bf16 GEMM outputs (``--dense-dtype bf16``), plus the residual stream.

A bf16 GEMM over a long K runs as one GEMM per K-block (model/linear.py's ``BF16_K_BLOCK``), each giving bf16,
summed in fp32 in a fixed order after the residual ``start``: :func:`sum_parts_ref` in PyTorch ops made one pass
over memory per part, with the fp32 sum read and written each time (about 1.9 ms of a (4096 × 1536) → 384 layer
on 2 cores, AMD EPYC). :func:`sum_parts` makes it one pass in C++ (csrc/yoso_cpu_parts.cpp) where the extension
is built: the same fp32 additions in the same order, so the same bits.
"""

from __future__ import annotations

import torch


def sum_parts_ref(parts: list[torch.Tensor], start: torch.Tensor | None = None) -> torch.Tensor:
    """``((start + parts[0]) + parts[1]) + ...`` in fp32 (no ``start``: ``parts[0] + parts[1] + ...``), the parts
    (bf16 or fp32, one shape) widened to fp32, ``start`` (fp32) shaped like them."""
    # a new tensor either way: neither ``start`` nor an fp32 first part is written to
    out = parts[0].to(torch.float32, copy=True) if start is None else start + parts[0]
    for part in parts[1:]:
        out.add_(part)
    return out


def _fast(parts: list[torch.Tensor], start: torch.Tensor | None) -> bool:
    first = parts[0]
    return (first.device.type == "cpu" and first.dtype in (torch.bfloat16, torch.float32)
            and all(p.dtype == first.dtype and p.shape == first.shape and p.device == first.device for p in parts)
            and not any(p.requires_grad for p in parts)
            and (start is None or (start.dtype == torch.float32 and start.device.type == "cpu"
                                   and start.shape == first.shape and not start.requires_grad)))


def sum_parts(parts: list[torch.Tensor], start: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """:func:`sum_parts_ref`'s result, bit for bit; one C++ pass on CPU (the extension built, ``backend`` not
    "torch", no gradients)."""
    if not parts:
        raise ValueError("sum_parts needs at least one part")
    if backend != "torch" and _fast(parts, start):
        from ._build import cpu_extension

        ext = cpu_extension()
        if ext is not None:
            width = parts[0].shape[-1]
            flat = [p.reshape(-1, width).contiguous() for p in parts]
            out = ext.sum_parts(flat, None if start is None else start.reshape(-1, width).contiguous())
            return out.view(parts[0].shape)
    return sum_parts_ref(parts, start)
