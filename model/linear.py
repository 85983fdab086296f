"""The encoder's dense layers: :class:`Linear` (``nn.Linear`` whose CPU inference GEMMs run on oneDNN, in fp32, bf16
or int8 as :func:`set_dense_dtype` sets), the activations ``hidden_act`` names, and whether the CPU has bf16
instructions (:func:`native_bf16`)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.kernels import LayerNormArgs, cpu_flags, sum_parts

from .dense_int8 import int8_linear, int8_weights, shift_int8, shift_of, smooth_int8
from .derived import derived


def activation(name: str):
    """The activation function named by ``hidden_act`` (transformers' names)."""
    tanh_gelu = functools.partial(F.gelu, approximate="tanh")  # a partial, not a lambda: picklable
    table = {"gelu": F.gelu, "gelu_new": tanh_gelu, "gelu_pytorch_tanh": tanh_gelu, "gelu_fast": tanh_gelu,
             "relu": F.relu, "silu": F.silu, "swish": F.silu, "tanh": torch.tanh}
    if name not in table:
        raise ValueError(f"hidden_act must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _onednn_linear():
    """oneDNN's fp32 linear (the op torch's own CPU compiler emits), or None where this torch lacks it."""
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = _onednn_linear()


# The longest K one bf16 GEMM takes on every CPU: measured on a Xeon with AMX (torch 2.13.0, 2 threads), K 384
# gave every row the same bits at any row count from 1 to 1100, while K 768 and 1536 gave three or four different
# roundings by row count.
BF16_SAFE_K = 384


def _cpu_flags() -> list[str]:
    """/proc/cpuinfo's flags ([] where there is none: not Linux)."""
    return cpu_flags(Path("/proc/cpuinfo"))


def bf16_k_block() -> int | None:
    """The K-block a bf16 GEMM over a longer K runs in (:data:`BF16_SAFE_K`), or None where one GEMM gives a row
    the same bits at any row count: CPUs with AVX512-BF16 and without AMX (AMD Zen 4, Intel Cooper Lake). There,
    measured on AMD EPYC (Zen 4; torch 2.13.0; K 768 to 3072, with bias; 1 to 32 threads), every row had the same
    bits at any row count from 2 to 12,000; one row alone took another kernel, so it goes in twice."""
    flags = _cpu_flags()
    return None if "avx512_bf16" in flags and not {"amx_bf16", "amx_tile"} & set(flags) else BF16_SAFE_K


BF16_K_BLOCK = bf16_k_block()


def fp32_packed() -> bool:
    """Whether fp32 inference GEMMs take oneDNN's packed copy of the weights (reordered once into the blocked layout
    its kernels read, :data:`PACK_ROWS` as the row hint) and a GELU after them runs as aten's own pass rather than in
    the GEMM's epilogue: on x86 CPUs with AVX2 and without AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP). There,
    measured on an AMD EPYC Zen 3 (torch 2.13.0, 2 threads), plain weights were reordered on every call (the model's
    shapes 5-15 % slower) and oneDNN's erf GELU post-op made FFN in 1.2x slower than the GEMM and aten's GELU
    (33.4 against 27.6 ms at 2176 rows); the bits are the same either way, and a row's bits did not depend on the
    row count, one row alone included. Elsewhere (AVX-512) the plain path is kept: measured there as it is."""
    flags = _cpu_flags()
    return "avx2" in flags and "avx512f" not in flags


FP32_PACKED = fp32_packed()
PACK_ROWS = 128  # the row count oneDNN's reorder is told to expect: 128 and 2048 ran alike at 128 to 2176 rows


def k_blocked(in_features: int) -> bool:
    """Whether a bf16 GEMM over ``in_features`` runs per K-block on this CPU (:func:`bf16_k_block`)."""
    return BF16_K_BLOCK is not None and in_features > BF16_K_BLOCK


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, attr: str = "none",
                 algorithm: str = "") -> torch.Tensor:
    """One oneDNN bf16 GEMM; over a K longer than :data:`BF16_SAFE_K` a single row goes in as the first of two
    (alone it took another kernel, with other roundings, than any two rows or more)."""
    if x.shape[-1] > BF16_SAFE_K and x.numel() == x.shape[-1]:
        rows = x.reshape(1, -1)
        out = ONEDNN_LINEAR(torch.cat([rows, rows]), weight, bias, attr, [], algorithm)[:1]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return ONEDNN_LINEAR(x, weight, bias, attr, [], algorithm)


# Activations oneDNN applies inside the GEMM with aten's exact formula (bit-identical outputs; its tanh
# GELU differs from aten's by up to 1.5e-4 relative, so those stay a separate pass).
FUSED_ACTIVATIONS = {"gelu": ("gelu", "none"), "relu": ("relu", "")}


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16: Zen 4, Cooper Lake, Sapphire
    Rapids and later), where oneDNN's bf16 GEMM runs about twice as fast as fp32 (bench/linear.py). Read
    from /proc/cpuinfo's flags; False where there is none (not Linux)."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_gemms() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU, natively or not (it needs AVX-512; on AVX2 alone it refuses the
    GEMM): what ``--dense-dtype bf16`` needs. bench/emulated.py emulates the GEMMs where it does not."""
    return ONEDNN_LINEAR is not None and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose inference forward on CPU in fp32
    runs oneDNN's GEMM instead of aten's BLAS call, optionally with the activation or the residual
    add applied in the GEMM's epilogue. Same precision (fp32 products and sums, no reduced-precision
    mode), results within fp32 rounding of aten's, and row-independent as aten's (a text's rows give
    the same bits alone or in a batch). Why: on an AMD EPYC (Zen 4, 2 cores) the MKL sgemm behind aten
    ran the model's shapes at 87–154 GFLOP/s and oneDNN at 120–185 (bench/linear.py); these GEMMs are
    ~75 % of a short-text forward, and the separate GELU pass over the (rows, 1536) output another ~20 %. Anything
    with a gradient, another device or dtype, and tracing or export (ONNX) take the plain ``F.linear``.

    With ``bf16`` set (:func:`set_dense_dtype`; the server's ``--dense-dtype``), that same inference path
    multiplies in bf16 (oneDNN, fp32 accumulation) with a bf16 copy of the weights: inputs and outputs are
    rounded to bf16, outputs come back as fp32 (the residual add of :meth:`plus` in fp32), except those of
    :meth:`activated` and :meth:`bf16_product`, which stay bf16 for readers that take bf16. About 1.7x the GEMM
    speed where the CPU has bf16 instructions (:func:`native_bf16`); the model's outputs move by about
    1e-3 relative (docs/benchmarks.md, "bf16 GEMMs"). With ``int8`` set (model/dense_int8.py) a bf16 input (the
    YOSO core's context) is widened and quantized like an fp32 one.

    On CPUs that need it (:func:`bf16_k_block`: with AMX, oneDNN blocks a longer K by the number of rows, so a
    row's bits depended on what else was in the batch) a bf16 GEMM whose inputs are longer than
    :data:`BF16_K_BLOCK` runs as GEMMs over K-blocks of that length, their bf16 outputs summed in fp32 in a fixed
    order; over one block they do not."""

    bf16 = False  # per instance: set_dense_dtype
    int8 = False  # per instance: set_dense_dtype (model/dense_int8.py)
    int8_smooth: torch.Tensor | None = None  # per instance: dense_int8.smooth_int8 (x / smooth, W · smooth)
    int8_shift: float | None = None  # per instance: dense_int8.shift_int8 (its input's floor: dense_int8.shift_of)

    def _fast(self, x: torch.Tensor) -> bool:
        return (ONEDNN_LINEAR is not None and x.device.type == "cpu"
                and (x.dtype == torch.float32 or ((self.bf16 or self.int8) and x.dtype == torch.bfloat16))
                and self.weight.dtype == torch.float32 and x.dim() >= 2
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()
                and not torch.compiler.is_compiling())

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, weight, bias) for oneDNN: as they are, or in bf16 with the weights' bf16 copy (made again
        whenever the fp32 weights changed)."""
        if not self.bf16:
            return x, self._packed() if FP32_PACKED else self.weight, self.bias

        def make():
            weight = self.weight.detach().bfloat16()
            if k_blocked(self.in_features):  # one contiguous weight block per K-block
                weight = [w.contiguous() for w in weight.split(BF16_K_BLOCK, dim=1)]
            return weight, None if self.bias is None else self.bias.detach().bfloat16()

        return x.bfloat16(), *derived(self, "_bf16", [self.weight, self.bias], make, BF16_K_BLOCK)

    def _packed(self) -> torch.Tensor:
        """oneDNN's packed copy of the fp32 weights (:func:`fp32_packed`), made again whenever they changed."""
        return derived(self, "_packed_weight", [self.weight],
                       lambda: torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS))

    def _int8(self, x: torch.Tensor, start: torch.Tensor | None = None, gelu: bool = False,
              norm: LayerNormArgs | None = None) -> torch.Tensor:
        """The int8 product, weights quantized again whenever they, the smoothing vector or the shift changed."""
        return int8_linear(x.float(), *int8_weights(self), smooth=self.int8_smooth, start=start, gelu=gelu, norm=norm,
                           shift=shift_of(self))

    def _gemm(self, x: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """``self(x)`` on oneDNN, fp32 out, plus ``start`` (fp32) if given: one GEMM, or in bf16 K-blocked
        (:func:`k_blocked`) one GEMM per K-block, their bf16 outputs summed in fp32 in order after ``start``."""
        if self.int8:
            return self._int8(x, start)
        x, weight, bias = self._operands(x)
        if not isinstance(weight, list):
            out = _bf16_linear(x, weight, bias) if self.bf16 else ONEDNN_LINEAR(x, weight, bias, "none", [], "")
            return out.float() if start is None else sum_parts([out], start)
        return sum_parts([ONEDNN_LINEAR(xj, wj, bias if j == 0 else None, "none", [], "")
                          for j, (xj, wj) in enumerate(zip(x.split(BF16_K_BLOCK, dim=-1), weight))], start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            return self._gemm(x)
        return F.linear(x, self.weight, self.bias)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` in bf16 mode as the GEMM's own bf16 output (same values, half the bytes); fp32 if K-blocked."""
        x, weight, bias = self._operands(x)
        return self._gemm(x) if isinstance(weight, list) else _bf16_linear(x, weight, bias)

    def activated(self, x: torch.Tensor, name: str, act) -> torch.Tensor:
        """``act(self(x))``, where ``act`` is the activation ``hidden_act`` = ``name`` names (bf16 in bf16 mode)."""
        if self.int8 and self._fast(x):  # exact GELU fused into the int8 epilogue; others after it
            return self._int8(x, gelu=True) if name == "gelu" else act(self._gemm(x))
        if name in FUSED_ACTIVATIONS and self._fast(x):
            if self.bf16 and k_blocked(self.in_features):  # the sum first, then the activation
                return act(self._gemm(x)).bfloat16()
            if name == "gelu" and FP32_PACKED and not self.bf16:  # aten's pass: the same bits, faster there
                return act(self._gemm(x))
            attr, algorithm = FUSED_ACTIVATIONS[name]
            if self.bf16:
                return _bf16_linear(*self._operands(x), attr, algorithm)
            return ONEDNN_LINEAR(*self._operands(x), attr, [], algorithm)
        return act(self(x))

    def plus(self, x: torch.Tensor, other: torch.Tensor, norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """``self(x) + other`` (``other`` shaped like the output; fp32 out), through ``norm`` if given (in int8 in
        the pass that scales the sums back: :func:`yoso_serve.kernels.int8_linear`)."""
        fast = self._fast(x) and other.shape == (*x.shape[:-1], self.out_features) and other.dtype == torch.float32
        grads = norm is not None and torch.is_grad_enabled() and any(p.requires_grad for p in norm.parameters())
        args = None if norm is None or grads else LayerNormArgs.of(norm)
        if fast and self.int8 and args is not None:
            return self._int8(x, start=other, norm=args)
        if fast and (self.bf16 or self.int8):  # the residual stream stays fp32: only the GEMM's output is rounded
            out = self._gemm(x, start=other)
        elif fast:
            out = ONEDNN_LINEAR.binary(x, other, *self._operands(x)[1:], "add")
        else:
            out = F.linear(x, self.weight, self.bias) + other
        return out if norm is None else norm(out)


def _hooked(m: nn.Module) -> bool:
    """Whether a forward hook would see ``m``'s own call (its own hooks or global ones)."""
    from torch.nn.modules import module as torch_module

    return bool(m._forward_hooks or m._forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks)


def packed_side_by_side(linears: list[Linear], x: torch.Tensor) -> list[torch.Tensor] | None:
    """``[lin(x) for lin in linears]`` as one fp32 GEMM over their packed weights side by side (Q, K, V), the outputs
    views of it, where :data:`FP32_PACKED` applies and each would take the packed fp32 path; None elsewhere. The same
    bits as one at a time (measured, AMD EPYC Zen 3: 1 to 2176 rows); at 128 rows 1.1x, at 1 or 2 rows 2x faster.
    Not where a forward hook waits on one of them (their own calls then run, as the hook expects)."""
    first = linears[0]
    if not (FP32_PACKED and x.dtype == torch.float32
            and all(lin._fast(x) and not (lin.bf16 or lin.int8 or _hooked(lin)) and lin.in_features == first.in_features
                    for lin in linears)
            and len({lin.bias is None for lin in linears}) == 1):
        return None

    def make():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        bias = None if first.bias is None else torch.cat([lin.bias.detach() for lin in linears])
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS), bias

    side = derived(first, "_side", [t for lin in linears for t in (lin.weight, lin.bias)], make)
    out = ONEDNN_LINEAR(x, *side, "none", [], "")
    return list(out.split([lin.out_features for lin in linears], dim=-1))


DENSE_DTYPES = ("fp32", "bf16", "int8")


def set_dense_dtype(module: nn.Module, dtype: str) -> None:
    """Run the CPU inference GEMMs of every :class:`Linear` in ``module`` in ``dtype`` ("fp32", "bf16" or "int8")."""
    if dtype not in DENSE_DTYPES:
        raise ValueError(f"dense dtype must be one of {DENSE_DTYPES}, got {dtype!r}")
    for m in module.modules():
        if isinstance(m, Linear):
            m.bf16, m.int8 = dtype == "bf16", dtype == "int8"
    if dtype == "int8":
        smooth_int8(module)
        shift_int8(module)
