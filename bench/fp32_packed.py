"""What the packed fp32 path buys (model/linear.py's ``FP32_PACKED``, taken on AVX2 CPUs without AVX-512): the
bundled model's fp32 forward with oneDNN's packed weights, Q/K/V as one GEMM and GELU as aten's pass after the GEMM,
against the plain path (weights as they are, three GEMMs, GELU in oneDNN's epilogue), interleaved inside every
repeat, at ``hashes=auto``. Checks that both give the same bits, prints one markdown row per shape (median ms of each
path over the runs, the plain / packed time of each run and their median) and plots the ratios.

    PYTHONSAFEPATH=1 .venv/bin/python bench/fp32_packed.py [--shapes 1x128 16x128 1x240 12x240 1x2048] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

import torch
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import alternated_medians, machine, parse_shapes, report, save_figure  # noqa: E402

from yoso_serve.model import default_model_dir, linear, load_pretrained  # noqa: E402
from yoso_serve.model.hashes import AUTO_EXACT_BELOW  # noqa: E402
from yoso_serve.service.heap import retain_freed_memory  # noqa: E402

PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "fp32_packed.png"
PATHS = {"plain": False, "packed": True}


def compare(model, batch: int, n: int, runs: int, repeats: int) -> dict:
    """{"ms": {path: median ms}, "ratios": [plain / packed time per run], "same": bits equal} for one shape."""
    ids = torch.randint(1000, 20000, (batch, n), generator=torch.Generator().manual_seed(n))
    hashes = 0 if n < AUTO_EXACT_BELOW else None  # hashes=auto
    saved = linear.FP32_PACKED
    outs = {}

    def forward(path):
        def call():
            linear.FP32_PACKED = PATHS[path]
            outs[path] = model.last_hidden(ids, torch.ones_like(ids), hashes=hashes)
        return call

    try:
        with torch.inference_mode():
            per_run = [alternated_medians({p: forward(p) for p in PATHS}, repeats) for _ in range(runs)]
    finally:
        linear.FP32_PACKED = saved
    return {"ms": {p: 1e3 * median(r[p] for r in per_run) for p in PATHS},
            "ratios": [r["plain"] / r["packed"] for r in per_run], "same": torch.equal(outs["plain"], outs["packed"])}


def table(results: dict) -> str:
    rows = ["| batch × N | plain ms | packed ms | plain / packed time (per run) | same bits |",
            "|---|---:|---:|---|---|"]
    for (batch, n), r in results.items():
        per_run = ", ".join(f"{v:.2f}" for v in r["ratios"])
        rows.append(f"| {batch} × {n} | {r['ms']['plain']:.1f} | {r['ms']['packed']:.1f} | "
                    f"**{median(r['ratios']):.2f}×** ({per_run}) | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{b} × {n}" for b, n in results]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(labels, [median(r["ratios"]) for r in results.values()], color="#4c72b0")
    for i, r in enumerate(results.values()):
        ax.plot([i] * len(r["ratios"]), r["ratios"], "k.", ms=4)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("plain / packed forward time")
    ax.set_title("fp32 forward, packed path against plain (dots: runs)", fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x128", "16x128", "1x240", "12x240", "1x2048"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plot", default=str(PLOT), help="where the plot goes ('' for none)")
    args = p.parse_args(argv)
    if linear.ONEDNN_LINEAR is None:
        raise SystemExit("this torch has no oneDNN linear: nothing to compare")
    retain_freed_memory()  # the server's heap settings
    model = load_pretrained(default_model_dir()).eval()
    linear.set_dense_dtype(model, "fp32")
    shapes = parse_shapes(args.shapes)
    results = {(b, n): compare(model, b, n, args.runs, args.repeats) for b, n in tqdm(shapes, desc="shapes")}
    print(f"machine: {machine()}; packed path taken by default here: {linear.fp32_packed()}")
    report(table(results), lambda path: plot(results, path), args.plot)
    return results


if __name__ == "__main__":
    main()
