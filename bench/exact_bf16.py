"""Exact mode over bf16 q, k, v (what the bf16 and int8 dense layers give the attention): the extension's
``exact_attention`` with AVX-512 BF16 dot products for the cosines against the same op with them switched off
(YOSO_CPU_NO_BF16_DOT=1: the fp32 tiles). The switch is read once per process, so each side runs in its own
process, the two alternated ``--runs`` times; in each, ``--repeats`` timed calls after two to warm up, head-split
views of one (B, N, 3, 12, 32) tensor as the fused projection gives them, no padding, τ = 8. Prints a markdown
table: each side's median over the runs' medians, and the median of the per-run ratios.

    PYTHONSAFEPATH=1 .venv/bin/python bench/exact_bf16.py [--shapes 17x128 1x512 1x2048] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine  # noqa: E402

_ONE_SIDE = r"""
import json, sys, time, statistics, torch
from yoso_serve.kernels._build import cpu_extension
from yoso_serve.service.heap import retain_freed_memory
retain_freed_memory()
ext = cpu_extension()
out = {"dots": bool(ext.bf16_dots())}
for shape in sys.argv[2:]:
    b, n = map(int, shape.split("x"))
    qkv = torch.randn(b, n, 3, 12, 32, generator=torch.Generator().manual_seed(n)).bfloat16()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    keep = torch.ones(b, n, dtype=torch.bool)
    times = []
    for rep in range(int(sys.argv[1]) + 2):
        start = time.perf_counter()
        ext.exact_attention(q, k, v, keep, 8)
        if rep >= 2:
            times.append(time.perf_counter() - start)
    out[shape] = statistics.median(times)
print(json.dumps(out))
"""


def one_side(dots: bool, shapes: list[str], repeats: int) -> dict:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    if not dots:
        env["YOSO_CPU_NO_BF16_DOT"] = "1"
    done = subprocess.run([sys.executable, "-c", _ONE_SIDE, str(repeats), *shapes], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["17x128", "1x512", "1x2048"], help="batch x tokens")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    from tqdm import tqdm

    runs = []
    for r in tqdm(range(args.runs), desc="runs"):
        sides = [True, False] if r % 2 == 0 else [False, True]
        runs.append({dots: one_side(dots, args.shapes, args.repeats) for dots in sides})
    if not runs[0][True]["dots"]:
        raise SystemExit("this CPU has no AVX-512 BF16 dot products: both sides ran the fp32 tiles")
    print(f"machine: {machine()}; exact_attention, bf16 q, k, v, 12 heads of 32, τ = 8; {args.runs} runs alternated, "
          f"medians of {args.repeats} calls each")
    print("| batch × N | bf16 dot products (ms) | fp32 tiles (ms) | fp32 tiles / dot products, per run | median |")
    print("|---|---:|---:|---|---:|")
    for shape in args.shapes:
        dots = [run[True][shape] for run in runs]
        tiles = [run[False][shape] for run in runs]
        ratios = [t / d for t, d in zip(tiles, dots)]
        print(f"| {shape.replace('x', ' × ')} | {1e3 * median(dots):.2f} | {1e3 * median(tiles):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {median(ratios):.2f}× |")


if __name__ == "__main__":
    main()
