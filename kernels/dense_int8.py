"""The int8 dense layers' arithmetic on CPU (``--dense-dtype int8``): each row of the input quantized on its own
(optionally divided per channel by a smoothing vector first), oneDNN's int8 GEMM (:func:`int8_sums`, exact integer
sums), and the sums scaled back, with the bias and a residual added.

The GEMM (:func:`int8_mm`) takes one of two routes, :data:`INT8_GEMM`: ``torch._int_mm`` where the CPU has
AVX-512 VNNI (oneDNN's s8 × s8 kernels; without VNNI torch runs it as plain loops, about 20x slower than fp32),
else oneDNN's u8 × s8 quantized linear (``onednn::qlinear_pointwise``, the AVX2 kernels): the rows shifted to
u8 by 128 and the weights quantized to ±63 (:func:`weight_levels`), so no pair of u8 × s8 products overflows the
16-bit sums those kernels make without VNNI. Either way the sums are exact integers.

A layer whose input stays above a known floor (FFN out: GELU's output is above -0.17) can take it shifted
(``shift``): each row plus the shift quantized to [0, 127] on its own, a step of (max + shift) / 127 against the
symmetric max / 127. On the u8 route those rows go in as u8 without the 128 offset, so the layer's weights keep
±127 (2 · 127 · 127 < 2^15). The product is then that of ``x + shift``: the caller folds ``-shift · W.sum(1)`` into
the bias (model/dense_int8.py, which shifts on the u8 route only).

:func:`int8_linear` runs the two passes around the GEMM in C++ (csrc/yoso_cpu_quant.cpp), one pass each, where
the extension is built; :func:`int8_linear_ref` is the same formula in PyTorch ops and the same bits (the C++
makes the same IEEE operations in the same order). In PyTorch ops the passes took longer than the GEMM itself.

Why per row: a per-tensor activation scale would depend on the other texts of the batch. With one scale per
row and exact int32 sums, a row's bits never depend on the row count or on how the library blocks the GEMM.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

MIN_ABS_MAX = 1e-12
U8S8_WEIGHT_LEVELS = 63  # 2 · 255 · 63 < 2^15: a pair of u8 × s8 products fits the 16-bit sums of AVX2's kernels


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's flags as ``cpuinfo`` lists them ([] where there is none: not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])


def int8_gemm_route(flags: list[str] | None = None) -> str:
    """"u8s8" on x86 CPUs with AVX2 and without AVX-512 VNNI (Zen 2 and 3, Haswell to Skylake), where
    ``torch._int_mm`` runs as plain loops; "int_mm" elsewhere: with AVX-512 VNNI (Zen 4, Cascade Lake and later
    Xeons: oneDNN's VNNI kernels), on CPUs whose flags are unknown, or where torch lacks the u8 route."""
    flags = cpu_flags() if flags is None else flags
    if "avx2" in flags and "avx512_vnni" not in flags and hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return "u8s8"
    return "int_mm"


INT8_GEMM = int8_gemm_route()


def int8_gemm() -> str:
    """The int8 GEMM's route in this process, :data:`INT8_GEMM` ("int_mm" or "u8s8"): what /info shows."""
    return INT8_GEMM


def weight_levels() -> int:
    """The largest |int8| a weight is quantized to on this route: 127, or 63 on the u8 route."""
    return 127 if INT8_GEMM == "int_mm" else U8S8_WEIGHT_LEVELS


def tensor_key(t: torch.Tensor) -> tuple[int, int]:
    """What tells a tensor's data apart over time, for caches of tensors made from it: its version and address.
    An inference tensor (made under inference_mode, which cannot change in place outside it) has no version
    counter and counts as 0."""
    return 0 if t.is_inference() else t._version, t.data_ptr()


def _u8s8_weight(weight_q: torch.Tensor, shifted: bool = False) -> tuple | None:
    """oneDNN's packed copy of ``weight_q`` (out, in) with unit scales and zero points, kept while the tensor lives;
    None where a weight exceeds ±63, or ±127 for ``shifted`` rows (those sums could overflow: :func:`int8_mm` takes
    ``_int_mm`` then). Kept on the tensor itself until its data change."""
    key = tensor_key(weight_q)
    hit = getattr(weight_q, "_u8s8", None)
    if hit is None or hit[0] != key:
        # not abs(): int8's -128 has none; it is past ±127 too
        lo, hi = (int(v) for v in weight_q.aminmax()) if weight_q.numel() else (0, 0)
        n = weight_q.shape[0]
        packed = (torch.ops.onednn.qlinear_prepack(weight_q, None), torch.ones(n),
                  torch.zeros(n, dtype=torch.long)) if -127 <= lo else None
        hit = weight_q._u8s8 = (key, packed, max(-lo, hi))
    limit = 127 if shifted else U8S8_WEIGHT_LEVELS
    return hit[1] if hit[2] <= limit else None


def int8_mm(q: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    """q (R, K) int8 times weight_q (out, K) int8 transposed → (R, out) int32, exact (:func:`int8_sums`, cast)."""
    return int8_sums(q, weight_q).to(torch.int32)


def int8_sums(q: torch.Tensor, weight_q: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """:func:`int8_mm`'s exact sums as the route gives them: int32, or on the u8 route fp32 holding the integers
    (|sum| ≤ 128 · 63 · K < 2^24 for K ≤ 2080), which the C++ passes read as they are (no pass to cast them).
    ``shifted``: q holds rows quantized to [0, 127] (``int8_rows(shift=...)``), which the u8 route takes as they are
    with ±127 weights; their sums are exact below 2^24 (127 · 127 · K: every sum for K ≤ 1040, and FFN out's real
    ones: at most 3.2e5 in the bundled model on 64 texts of 128 tokens and two of 2000) and past it rounded once to
    fp32, the same at any row count."""
    packed = None
    fits = shifted or q.shape[-1] * 128 * U8S8_WEIGHT_LEVELS < 2 ** 24
    if INT8_GEMM == "u8s8" and q.device.type == "cpu" and fits and len(q) > 0:
        packed = _u8s8_weight(weight_q, shifted)
    if packed is None:
        return torch._int_mm(q, weight_q.t())
    if shifted:  # 0..127 as they are: zero point 0
        return torch.ops.onednn.qlinear_pointwise(q.contiguous().view(torch.uint8), 1.0, 0, *packed, None, 1.0, 0,
                                                  torch.float32, "none", [], "")
    u8 = q.contiguous().view(torch.uint8).bitwise_xor(128)  # s8 + 128 as u8, undone by the zero point
    return torch.ops.onednn.qlinear_pointwise(u8, 1.0, 128, *packed, None, 1.0, 0, torch.float32, "none", [], "")


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
    fp32 as :func:`int8_rows` gives them (``shifted``: with a shift, q in [0, 127]), for an input of ``shape``
    (..., K)."""

    q: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    shifted: bool = False


def _check(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise ValueError(f"weight_q must be (out, in) int8, got {tuple(weight_q.shape)} {weight_q.dtype}")
    if x.shape[-1] != weight_q.shape[1]:
        raise ValueError(f"x's last dimension must be the weight's in = {weight_q.shape[1]}, got {x.shape[-1]}")
    if weight_scale.shape != (weight_q.shape[0],):
        raise ValueError(f"weight_scale must be ({weight_q.shape[0]},), got {tuple(weight_scale.shape)}")


def int8_rows(rows: torch.Tensor, levels: int = 127, shift: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (R, K) fp32 → (int8 (R, K), scale (R, 1) fp32): symmetric, each row on its own (scale max|row| /
    ``levels``, round half to even); a zero row keeps the scale MIN_ABS_MAX / ``levels``. Weights (one row per output
    channel; ``levels`` :func:`weight_levels`) and activations (127) are quantized alike. With ``shift``: the rows
    plus ``shift`` to [0, ``levels``] (scale max(row + shift) / ``levels``; what falls below -shift becomes 0)."""
    if shift is not None:
        rows = rows + shift
        scale = rows.amax(dim=1, keepdim=True).clamp_min(MIN_ABS_MAX) / levels
        return torch.round(rows / scale).clamp_(0, levels).to(torch.int8), scale
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(MIN_ABS_MAX) / levels
    return torch.round(rows / scale).clamp_(-levels, levels).to(torch.int8), scale


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
                    out_dtype: torch.dtype = torch.float32, shift: float | None = None) -> torch.Tensor:
    """x (..., in) fp32 → (..., out) fp32 ≈ ``F.linear(x, W, bias) + start``, where ``weight_q`` (out, in) int8 and
    ``weight_scale`` (out,) hold ``W · smooth`` quantized per output channel: the rows of ``x / smooth`` are
    quantized each on its own (scale max|row| / 127, round half to even), multiplied in int32, and scaled back;
    ``gelu``: then GELU (erf form); ``norm``: then that LayerNorm; ``out_dtype`` bf16: that fp32 result rounded
    to bf16; ``shift``: the rows of ``x / smooth + shift`` quantized to [0, 127] instead, ≈ ``F.linear(x + shift, W,
    bias)`` (:func:`int8_rows`)."""
    _check(x, weight_q, weight_scale)
    rows = x.reshape(-1, x.shape[-1]).float()
    if smooth is not None:
        rows = rows / smooth
    q, scale = int8_rows(rows, shift=shift)
    out = _scaled_back(int8_sums(q, weight_q, shift is not None), scale, weight_scale, bias, start, gelu, norm)
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


def _sums(ext, x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, smooth: torch.Tensor | None,
          shift: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The C++ quantizing pass and the int8 GEMM: (exact sums (R, out) as :func:`int8_sums` gives them, row scales
    (R, 1))."""
    _check(x, weight_q, weight_scale)
    q, scale = ext.quantize_rows(x.reshape(-1, x.shape[-1]).contiguous(), _vector(smooth), shift)
    return int8_sums(q, weight_q, shift is not None), scale


def _extension(x: torch.Tensor, start: torch.Tensor | None, backend: str):
    """The C++ extension where the passes around the GEMM run in it, else None."""
    if backend == "torch" or not _fast(x, start):
        return None
    from ._build import cpu_extension

    return cpu_extension()


def int8_linear(x: torch.Tensor | Int8Rows, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, *, smooth: torch.Tensor | None = None, start: torch.Tensor | None = None,
                gelu: bool = False, norm: LayerNormArgs | None = None, out_dtype: torch.dtype = torch.float32,
                backend: str = "auto", shift: float | None = None) -> torch.Tensor:
    """:func:`int8_linear_ref`'s result, bit for bit without ``gelu``; the passes around the GEMM in C++ on CPU (fp32
    ``x``, the extension built, ``backend`` not "torch"). ``gelu`` there is fused into the last pass, within about
    2e-7 · max(|x|, 1) of aten's (erf by a fitted rational, yoso_cpu_quant.cpp): the same bits on every run
    and at any row count, not aten's bits. ``x`` may come quantized (:class:`Int8Rows`; no smoothing then).
    ``norm`` (the layer's LayerNorm, :class:`LayerNormArgs`) is applied in that pass too, as ``nn.LayerNorm``
    computes it but not its bits (within a few 1e-7; a row's bits at any row count). ``out_dtype`` bf16: the fp32
    result rounded to bf16 in the last pass (half the bytes written). ``shift``: as :func:`int8_linear_ref`'s (an
    :class:`Int8Rows` input carries its own)."""
    _out_dtype(out_dtype)
    if isinstance(x, Int8Rows):
        if smooth is not None or shift is not None:
            raise ValueError("an Int8Rows input is quantized already: it takes no smoothing vector or shift")
        _check(x.q, weight_q, weight_scale)
        acc, scale = int8_sums(x.q, weight_q, x.shifted), x.scale
        ext = _extension(x.scale, start, backend)
    else:
        ext = _extension(x, start, backend)
        if ext is None:
            return int8_linear_ref(x, weight_q, weight_scale, _vector(bias), smooth=smooth, start=start, gelu=gelu,
                                   norm=norm, out_dtype=out_dtype, shift=shift)
        acc, scale = _sums(ext, x, weight_q, weight_scale, smooth, shift)
    start = None if start is None else start.reshape(acc.shape).contiguous()
    if ext is None:
        out = _scaled_back(acc, scale, weight_scale, _vector(bias), start, gelu, norm).to(out_dtype)
    else:
        nw, nb, eps = (None, None, 1e-12) if norm is None else (_vector(norm.weight), _vector(norm.bias), norm.eps)
        out = ext.dequantize_rows(acc, scale, _vector(weight_scale), _vector(bias), start, gelu,
                                  out_dtype == torch.bfloat16, nw, nb, eps)
    return out.view(*x.shape[:-1], weight_q.shape[0])


def int8_linear_rows(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     *, smooth: torch.Tensor | None = None, gelu: bool = False,
                     shift: float | None = None) -> Int8Rows | None:
    """:func:`int8_linear`'s output quantized per row for the next int8 layer in the pass that scales the sums back
    (C++ ``requantize_rows``): the bits of ``int8_rows`` of that output (with ``shift``, shifted as the next layer
    takes it), without the fp32 (R, out) tensor between (a pass written and a pass read). None where the C++
    passes do not run."""
    ext = _extension(x, None, "auto")
    if ext is None:
        return None
    acc, scale = _sums(ext, x, weight_q, weight_scale, smooth)
    q, row_scale = ext.requantize_rows(acc, scale, _vector(weight_scale), _vector(bias), gelu, shift)
    return Int8Rows(q, row_scale, (*x.shape[:-1], weight_q.shape[0]), shift is not None)
