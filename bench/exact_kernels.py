"""Exact mode (YOSO-E) of one attention layer: the op against the fused FlexAttention kernel (kernels/flex.py).

One input, the default model's head shape (12 heads of 32), τ = 8, random unit q, k and random v, no
padding. Each kernel gets a warm-up call first (the compilation, for flex). Then ``--repeats`` rounds
alternate op and flex so that both see the same machine load, and the median counts. ``--runs`` repeats
the whole measurement and reports the median of the runs' ratios. The row norm that follows in the model
is left out: it is the same for both. Prints a markdown table.

    PYTHONSAFEPATH=1 .venv/bin/python bench/exact_kernels.py [--device cpu|cuda] [--lengths 512 2048] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from yoso_serve.kernels import flex, yoso_attention

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import alternated_medians  # noqa: E402


def one_run(device: str, lengths: list[int], repeats: int, dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """N → (op seconds, flex seconds), medians of ``repeats`` alternated calls."""
    out = {}
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, 12, n, 32, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        calls = {
            "op": lambda: yoso_attention(q, k, v, None, num_hashes=0, hash_bits=8, seed=0, exact=True),
            "flex": lambda: flex.exact_attention_flex(q, k, v, None, 8),
        }
        with torch.inference_mode():
            times = alternated_medians(calls, repeats, torch.cuda.synchronize if device == "cuda" else None)
        out[n] = (times["op"], times["flex"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if (why := flex.unavailable(args.device)) is not None:
        raise SystemExit(f"flex cannot run on {args.device}: {why}")
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    runs = []
    for r in range(args.runs):
        runs.append(one_run(args.device, args.lengths, args.repeats, dtype))
        print(f"run {r + 1}/{args.runs}: " + ", ".join(f"N={n} op {o * 1e3:.2f} ms flex {f * 1e3:.2f} ms"
                                                          for n, (o, f) in runs[-1].items()), flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}, {str(dtype)[6:]}, 1 x 12 heads x 32, tau 8; medians over "
          f"{args.runs} runs of {args.repeats}\n")
    print("| N | op ms | flex ms | flex / op time |\n|---:|---:|---:|---:|")
    for n in args.lengths:
        op = statistics.median(run[n][0] for run in runs)
        fx = statistics.median(run[n][1] for run in runs)
        ratio = statistics.median(run[n][1] / run[n][0] for run in runs)
        print(f"| {n} | {op * 1e3:.2f} | {fx * 1e3:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
