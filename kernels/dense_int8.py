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

from typing import NamedTuple

import torch
import torch.nn.functional as F

MIN_ABS_MAX = 1e-12


class LayerNormArgs(NamedTuple):
    """A LayerNorm applied to an int8 layer's result in the pass that scales its sums back: ``weight`` (out,),
    ``bias`` (out,) or None, ``eps``, as ``nn.LayerNorm``'s (:meth:`of` reads them off one)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, norm: torch.nn.LayerNorm) -> LayerNormArgs | None:
        """``norm``'s arguments, or None where it does not fuse (no weight, more than the last dimension)."""
        if norm.weight is None or len(norm.normalized_shape) != 1:
            return None
        return cls(norm.weight, norm.bias, float(norm.eps))


class Int8Rows(NamedTuple):
    """An int8 layer's input already quantized per row (:func:`int8_linear_rows`): q (R, K) int8 and scale (R, 1)
    fp32 as :func:`int8_rows` gives them, for an input of ``shape`` (..., K)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]


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


def _scaled_back(acc: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 start: torch.Tensor | None, gelu: bool, norm: LayerNormArgs | None = None) -> torch.Tensor:
    """int32 sums (R, out) → fp32: times the row and column scales, plus bias and start, then GELU if asked, then
    ``norm``'s LayerNorm if given."""
    out = acc.float().mul_(scale).mul_(weight_scale)
    if bias is not None:
        out.add_(bias)
    if start is not None:
        out.add_(start.reshape(out.shape))
    out = F.gelu(out) if gelu else out
    if norm is None:
        return out
    return F.layer_norm(out, (out.shape[-1],), _vector(norm.weight), _vector(norm.bias), norm.eps)


def int8_linear_ref(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    *, smooth: torch.Tensor | None = None, start: torch.Tensor | None = None,
                    gelu: bool = False, norm: LayerNormArgs | None = None,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x (..., in) fp32 → (..., out) fp32 ≈ ``F.linear(x, W, bias) + start``, where ``weight_q`` (out, in) int8 and
    ``weight_scale`` (out,) hold ``W · smooth`` quantized per output channel: the rows of ``x / smooth`` are
    quantized each on its own (scale max|row| / 127, round half to even), multiplied in int32, and scaled back;
    ``gelu``: then GELU (erf form); ``norm``: then that LayerNorm; ``out_dtype`` bf16: that fp32 result rounded
    to bf16."""
    _check(x, weight_q, weight_scale)
    rows = x.reshape(-1, x.shape[-1]).float()
    if smooth is not None:
        rows = rows / smooth
    q, scale = int8_rows(rows)
    out = _scaled_back(torch._int_mm(q, weight_q.t()), scale, weight_scale, bias, start, gelu, norm)
    return out.to(_out_dtype(out_dtype)).view(*x.shape[:-1], weight_q.shape[0])


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


def _fast(x: torch.Tensor, start: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad
            and (start is None or (start.dtype == torch.float32 and start.device.type == "cpu")))


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


def _sums(ext, x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
          smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ quantizing pass and the int8 GEMM: (int32 sums (R, out), row scales (R, 1))."""
    _check(x, weight_q, weight_scale)
    q, scale = ext.quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), _vector(smooth))
    return torch._int_mm(q, weight_q.t()), scale


def _extension(x: torch.Tensor, start: torch.Tensor | None, backend: str):
    """The C++ extension where the passes around the GEMM run in it, else None."""
    if backend == "torch" or not _fast(x, start):
        return None
    from ._build import cpu_extension

    return cpu_extension()


def int8_linear(x: torch.Tensor | Int8Rows, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, *, smooth: torch.Tensor | None = None, start: torch.Tensor | None = None,
                gelu: bool = False, norm: LayerNormArgs | None = None, out_dtype: torch.dtype = torch.float32,
                backend: str = "auto") -> torch.Tensor:
    """:func:`int8_linear_ref`'s result, bit for bit without ``gelu``; the passes around the GEMM in C++ on CPU (fp32
    ``x``, the extension built, ``backend`` not "torch"). ``gelu`` there is fused into the last pass, within about
    2e-7 · max(|x|, 1) of aten's (erf by a fitted rational, yoso_cpu_quant.cpp): the same bits on every run
    and at any row count, not aten's bits. ``x`` may come quantized (:class:`Int8Rows`; no smoothing then).
    ``norm`` (the layer's LayerNorm, :class:`LayerNormArgs`) is applied in that pass too, as ``nn.LayerNorm``
    computes it but not its bits (within a few 1e-7; a row's bits at any row count). ``out_dtype`` bf16: the fp32
    result rounded to bf16 in the last pass (half the bytes written)."""
    _out_dtype(out_dtype)
    if isinstance(x, Int8Rows):
        if smooth is not None:
            raise ValueError("an Int8Rows input is quantized already: it takes no smoothing vector")
        _check(x.q, weight_q, weight_scale)
        acc, scale = torch._int_mm(x.q, weight_q.t()), x.scale
        ext = _extension(x.scale, start, backend)
    else:
        ext = _extension(x, start, backend)
        if ext is None:
            return int8_linear_ref(x, weight_q, weight_scale, _vector(bias), smooth=smooth, start=start, gelu=gelu,
                                   norm=norm, out_dtype=out_dtype)
        acc, scale = _sums(ext, x, weight_q, weight_scale, smooth)
    start = None if start is None else start.reshape(acc.shape).contiguous()
    if ext is None:
        out = _scaled_back(acc, scale, weight_scale, _vector(bias), start, gelu, norm).to(out_dtype)
    else:
        nw, nb, eps = (None, None, 1e-12) if norm is None else (_vector(norm.weight), _vector(norm.bias), norm.eps)
        out = ext.dequantize_rows(acc, scale, _vector(weight_scale), _vector(bias), start, gelu,
                                  out_dtype == torch.bfloat16, nw, nb, eps)
    return out.view(*x.shape[:-1], weight_q.shape[0])


def int8_linear_rows(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     *, smooth: torch.Tensor | None = None, gelu: bool = False) -> Int8Rows | None:
    """:func:`int8_linear`'s output quantized per row for the next int8 layer in the pass that scales the sums back
    (C++ ``requantize_rows``): the bits of ``int8_rows`` of that output, without the fp32 (R, out) tensor between
    (a pass written and a pass read). None where the C++ passes do not run."""
    ext = _extension(x, None, "auto")
    if ext is None:
        return None
    acc, scale = _sums(ext, x, weight_q, weight_scale, smooth)
    q, row_scale = ext.requantize_rows(acc, scale, _vector(weight_scale), _vector(bias), gelu)
    return Int8Rows(q, row_scale, (*x.shape[:-1], weight_q.shape[0]))
