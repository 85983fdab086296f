"""What the K-blocked bf16 GEMM costs: the bundled model's forward with its dense layers in bf16, every GEMM over
K-blocks of ``BF16_SAFE_K`` (as served on CPUs with AMX, so that a row's bits do not depend on the batch), against
one bf16 GEMM per layer (as served on AVX512-BF16 without AMX, where it keeps a row's bits; with AMX a few rows in a
hundred were rounded by the batch's row count) and against fp32, interleaved inside every repeat. Prints one markdown row per shape: median milliseconds of
each mode over all repeats, and the blocked / one-GEMM time ratio of each run with their median.

    PYTHONSAFEPATH=1 .venv/bin/python bench/bf16_block.py [--shapes 8x128 1x512 1x4096] [--runs 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median

import torch

from yoso_serve.model import linear, load_pretrained

BUNDLED = Path(__file__).resolve().parent.parent / "model" / "bundled" / "yoso-minilm-l6-4096"
MODES = {"fp32": ("fp32", None), "bf16, one GEMM": ("bf16", None), "bf16, K-blocked": ("bf16", linear.BF16_SAFE_K)}


def set_mode(model, dense: str, block: int | None) -> None:
    """Dense layers in ``dense``, bf16 GEMMs blocked at ``block`` (None: one GEMM), the weights' bf16 copies remade
    for that blocking here, so that no timed forward pays for them."""
    linear.BF16_K_BLOCK = block
    linear.set_dense_dtype(model, dense)
    for m in model.modules():
        if isinstance(m, linear.Linear):
            m.__dict__.pop("_bf16_key", None)
            if dense == "bf16":
                m._operands(torch.empty(0, m.in_features))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8x128", "1x512", "1x4096"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hashes", type=int, default=32)
    args = parser.parse_args()
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("this CPU has no oneDNN bf16 GEMM: nothing to compare")
    served = "K-blocked" if linear.bf16_k_block() else "one GEMM"
    model = load_pretrained(BUNDLED)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, served on this CPU: bf16 {served}, "
          f"YOSO-{args.hashes}, {args.runs} runs x {args.repeats} interleaved repeats")
    print("| batch × N | " + " | ".join(f"{m} (ms)" for m in MODES) + " | blocked / one GEMM, per run | median |")
    print("|---|" + "---:|" * (len(MODES) + 2))
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety
        def tqdm(x, **_):
            return x
    for shape in args.shapes:
        batch, n = map(int, shape.split("x"))
        ids = torch.randint(1000, 20000, (batch, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones_like(ids)
        times = {mode: [] for mode in MODES}
        ratios = []
        with torch.inference_mode():
            for _ in tqdm(range(args.runs), desc=shape, leave=False):
                run = {mode: [] for mode in MODES}
                for rep in range(args.repeats + 1):  # the first round warms up
                    for mode, (dense, block) in MODES.items():
                        set_mode(model, dense, block)
                        start = time.perf_counter()
                        model.last_hidden(ids, mask, hashes=args.hashes)
                        if rep:
                            run[mode].append(time.perf_counter() - start)
                for mode in MODES:
                    times[mode] += run[mode]
                ratios.append(median(run["bf16, K-blocked"]) / median(run["bf16, one GEMM"]))
        set_mode(model, "fp32", linear.bf16_k_block())
        cells = " | ".join(f"{1e3 * median(t):.0f}" for t in times.values())
        print(f"| {batch} × {n} | {cells} | {', '.join(f'{r:.3f}' for r in ratios)} | {median(ratios):.3f} |")


if __name__ == "__main__":
    main()
