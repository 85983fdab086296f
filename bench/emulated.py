"""A ``yoso-train`` command (``eval``, for bench/paired_evals.py) with another CPU's dense path emulated, so that its
error can be measured on this one. ``--as`` picks the path:

* ``zen4-bf16`` and ``amx-bf16``: the bf16 GEMMs (oneDNN has none on AVX2 alone and refuses them). Each becomes the
  fp32 GEMM of its bf16 operands (the product of two bf16 values is exact in fp32 and the sums are fp32, as bf16
  dot-product instructions accumulate), its output rounded to bf16 as oneDNN's bf16 output is, with the activation
  oneDNN would apply inside it (GELU, ReLU) in fp32 before that rounding. FFN out as one GEMM, as on CPUs with
  AVX512-BF16 and without AMX (AMD Zen 4), or in K-blocks of 384 whose bf16 outputs are summed in fp32, as with AMX
  (model/linear.py's ``bf16_k_block``). The sums run in another order than oneDNN's, so this gives bf16's error, not
  one CPU's bits.
* ``vnni-int8``: int8 on the ``_int_mm`` route that CPUs with AVX-512 VNNI take (weights at ±127, rows not shifted)
  instead of this CPU's u8 route. Its int32 sums are exact integers, which a float64 GEMM of the same int8 values
  gives bit for bit (|sum| ≤ 128 · 128 · K < 2^53), fast where ``torch._int_mm`` runs as plain loops (AVX2).

Exact mode's cosines come from widened rows here, not bf16 dot products as on AVX-512 BF16.

    PYTHONSAFEPATH=1 .venv/bin/python bench/emulated.py --as zen4-bf16 eval --dense-dtype bf16 ... --out OUT
    PYTHONSAFEPATH=1 .venv/bin/python bench/emulated.py --as vnni-int8 eval --dense-dtype int8 ... --out OUT
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from yoso_serve.kernels import dense_int8
from yoso_serve.model import linear

# oneDNN's post-op attributes the model's bf16 GEMMs use (model/linear.py's FUSED_ACTIVATIONS): applied in fp32
EPILOGUES = {"none": lambda t: t, "gelu": F.gelu, "relu": F.relu}


def emulated_gemm(real):
    """``linear.ONEDNN_LINEAR``'s call for bf16 inputs as the fp32 GEMM of the bf16 operands, rounded to bf16;
    fp32 inputs and ``.binary`` go to ``real`` as they are."""

    def gemm(x, weight, bias, attr, scalars, algorithm):
        if x.dtype != torch.bfloat16:
            return real(x, weight, bias, attr, scalars, algorithm)
        if attr not in EPILOGUES:
            raise ValueError(f"no emulation of oneDNN's {attr!r} post-op (known: {sorted(EPILOGUES)})")
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return EPILOGUES[attr](out).bfloat16()

    gemm.binary = getattr(real, "binary", None)
    return gemm


@contextmanager
def emulate_bf16(k_block: int | None):
    """Inside: every :class:`~yoso_serve.model.linear.Linear` in bf16 mode runs the emulated GEMM, with
    ``k_block`` (None or :data:`~yoso_serve.model.linear.BF16_SAFE_K`) as its K-block, and ``bf16_gemms()`` says
    yes (``yoso-train eval --dense-dtype bf16`` asks it); all put back after."""
    saved = linear.ONEDNN_LINEAR, linear.BF16_K_BLOCK, linear.bf16_gemms
    if saved[0] is None:
        raise RuntimeError("this torch has no oneDNN linear: its Linear layers never take the bf16 path")
    linear.ONEDNN_LINEAR, linear.BF16_K_BLOCK, linear.bf16_gemms = emulated_gemm(saved[0]), k_block, lambda: True
    try:
        yield
    finally:
        linear.ONEDNN_LINEAR, linear.BF16_K_BLOCK, linear.bf16_gemms = saved


def exact_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``'s result (int8 (R, K) times int8 (K, N), int32 sums) through a float64 GEMM: exact."""
    return torch.mm(a.double(), b.double()).to(torch.int32)


@contextmanager
def emulate_vnni_int8():
    """Inside: int8 layers take the ``_int_mm`` route (:data:`yoso_serve.kernels.dense_int8.INT8_GEMM`) with
    :func:`exact_int_mm` as ``torch._int_mm``; both put back after. Switch int8 on inside (``set_dense_dtype``
    quantizes the weights to the route's levels then)."""
    saved = dense_int8.INT8_GEMM, torch._int_mm
    dense_int8.INT8_GEMM, torch._int_mm = "int_mm", exact_int_mm
    try:
        yield
    finally:
        dense_int8.INT8_GEMM, torch._int_mm = saved


PATHS = {"zen4-bf16": lambda: emulate_bf16(None), "amx-bf16": lambda: emulate_bf16(linear.BF16_SAFE_K),
         "vnni-int8": emulate_vnni_int8}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--as", dest="path", choices=sorted(PATHS), required=True,
                        help="zen4-bf16: FFN out one bf16 GEMM; amx-bf16: K-blocks of 384; vnni-int8: the _int_mm route")
    args, rest = parser.parse_known_args(argv)
    from yoso_serve.model.train.cli import main as train

    with PATHS[args.path]():
        return train(rest)


if __name__ == "__main__":
    raise SystemExit(main())
