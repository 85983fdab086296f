"""A ``yoso-train`` command (``eval``, for bench/paired_evals.py) with the dense layers' bf16 GEMMs emulated, so that
bf16's error can be measured on a CPU without bf16 GEMMs (AVX2 alone: oneDNN has none there and refuses). Each bf16
GEMM becomes the fp32 GEMM of its bf16 operands (the product of two bf16 values is exact in fp32 and the sums are
fp32, as bf16 dot-product instructions accumulate), its output rounded to bf16 as oneDNN's bf16 output is, with the
activation oneDNN would apply inside it (GELU, ReLU) in fp32 before that rounding. ``--k-block`` picks the CPU whose
bf16 path is emulated (model/linear.py's ``bf16_k_block``): ``none``, AVX512-BF16 without AMX (AMD Zen 4), FFN out as
one GEMM; ``384``, with AMX (Intel Xeon), FFN out in K-blocks of 384 whose bf16 outputs are summed in fp32. The sums
run in another order than oneDNN's, and exact mode's cosines are taken from widened rows rather than bf16 dot
products, so this gives bf16's error, not one CPU's bits.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bf16_emulated.py --k-block none eval --dense-dtype bf16 ... --out OUT
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
import torch.nn.functional as F

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k-block", choices=("none", str(linear.BF16_SAFE_K)), required=True,
                        help="none: Zen 4's bf16 path (FFN out one GEMM); 384: AMX's (K-blocks of 384)")
    args, rest = parser.parse_known_args(argv)
    from yoso_serve.model.train.cli import main as train

    with emulate_bf16(None if args.k_block == "none" else int(args.k_block)):
        return train(rest)


if __name__ == "__main__":
    raise SystemExit(main())
