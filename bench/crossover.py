"""Where exact YOSO-E stops being cheaper than LSH: the crossover that ``hashes="auto"`` switches at.

The bundled default model (what the server loads with no --model), ``model.embed`` on random token
ids without padding, batch 1 and 8, N = 64..1024, exact (hashes=0) against the model's LSH count
(32). One warm-up forward per point, then ``--repeats`` rounds alternating exact and LSH so both
see the same machine load; the median counts. The crossover of a batch size is where a least-squares
line through log(exact/LSH) against log N crosses 0 (exact is cheaper below it): on a shared machine
single points jump, and a fit over every N does not follow one of them. A batch size whose ratio shows
no rising trend gives no crossover (noise, not a measurement). The suggested default is the smaller
crossover over the batch sizes (exact only where it wins at both), rounded down to a multiple of 32 —
model/hashes.py's ``AUTO_EXACT_BELOW`` is where it goes.

Prints a markdown table, saves the rows to bench/out/crossover.json, writes docs/img/crossover.png, and
with ``--write-docs`` replaces the "## Exact vs LSH crossover" section of docs/benchmarks.md.
``--from-json A.json B.json`` reports saved rows (merged; a later file's batch sizes replace an earlier's)
without measuring.

    PYTHONSAFEPATH=1 .venv/bin/python bench/crossover.py [--batches 1 8] [--lengths 64 128 ...] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import alternated_medians, machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "crossover.json"
PLOT = ROOT / "docs" / "img" / "crossover.png"
SECTION = "## Exact vs LSH crossover"




def time_point(model, batch: int, n: int, lsh: int, repeats: int) -> dict:
    """Median seconds of one forward, exact and LSH, alternated so that load drift hits both."""
    import torch

    gen = torch.Generator().manual_seed(n * 31 + batch)
    ids = torch.randint(1000, 20000, (batch, n), generator=gen)
    mask = torch.ones_like(ids)
    # the warm-up call of each: allocator, extension and thread pool at this shape
    calls = {hashes: (lambda hashes=hashes: model.embed(ids, mask, hashes=hashes)) for hashes in (0, lsh)}
    with torch.inference_mode():
        times = alternated_medians(calls, repeats)
    return {"batch": batch, "n": n, "exact_s": times[0], "lsh_s": times[lsh], "lsh": lsh}


def crossover(rows: list[dict]) -> float | None:
    """The N where the least-squares line of log(exact/LSH) on log N crosses 0; None without a rising
    trend (exact's O(N²) against LSH's O(N·m) must show as a positive slope, else it is noise)."""
    xs = [math.log(r["n"]) for r in rows]
    ys = [math.log(r["exact_s"] / r["lsh_s"]) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0.1:
        return None
    return math.exp(mx - my / slope)


def _no_trend(rows: list[dict], batch: int) -> str:
    ratios = [r["exact_s"] / r["lsh_s"] for r in rows if r["batch"] == batch]
    return f"none found, exact/LSH shows no trend with N ({min(ratios):.2f} to {max(ratios):.2f})"


def table(rows: list[dict]) -> str:
    lines = ["| batch | N | exact (ms) | LSH (ms) | exact / LSH |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['n']} | {1000 * r['exact_s']:.1f} | {1000 * r['lsh_s']:.1f} | "
                     f"{r['exact_s'] / r['lsh_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], points: dict[int, float | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(points)
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == batch]
        ax.plot([r["n"] for r in sel], [1000 * r["exact_s"] for r in sel], "o-", label="exact (YOSO-E)")
        ax.plot([r["n"] for r in sel], [1000 * r["lsh_s"] for r in sel], "o-", label=f"LSH, {sel[0]['lsh']} hashes")
        if points[batch] is not None:
            ax.axvline(points[batch], color="grey", ls="--", label=f"crossover ≈ {points[batch]:.0f}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"tokens per input N (batch {batch})")
        ax.set_ylabel("one forward (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Bundled default model, exact vs LSH, CPU")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def measure(args) -> list[dict]:
    from yoso_serve.model import default_model_dir, load_pretrained

    model = load_pretrained(default_model_dir()).eval()
    rows = []
    for batch in args.batches:
        for n in args.lengths:
            rows.append(time_point(model, batch, n, model.config.default_hashes, args.repeats))
            print(f"batch {batch} N {n}: exact {rows[-1]['exact_s']:.3f} s, LSH {rows[-1]['lsh_s']:.3f} s",
                  file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 384, 512, 768, 1024])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per point; the median counts")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--from-json", type=Path, nargs="+", help="report saved rows instead of measuring")
    args = parser.parse_args()
    from yoso_serve.model.hashes import AUTO_EXACT_BELOW

    if args.from_json:
        runs = [json.loads(path.read_text()) for path in args.from_json]
    else:
        before = os.getloadavg()[0]
        rows = measure(args)
        runs = [{"rows": rows, "repeats": args.repeats, "machine": machine(), "load": [before, os.getloadavg()[0]]}]
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(runs[0]))
    rows, notes = [], []
    for i, run in enumerate(runs):  # a later run's batch sizes replace an earlier run's
        later = {r["batch"] for other in runs[i + 1:] for r in other["rows"]}
        kept = [r for r in run["rows"] if r["batch"] not in later]
        rows += kept
        if kept:
            notes.append(f"batch {', '.join(sorted({str(r['batch']) for r in kept}))}: median of {run['repeats']} "
                         f"rounds, {run['machine']}, load average {run['load'][0]:.1f} before, "
                         f"{run['load'][1]:.1f} after")
    lsh = rows[0]["lsh"]
    rows.sort(key=lambda r: (r["batch"], r["n"]))
    batches = sorted({r["batch"] for r in rows})
    points = {b: crossover([r for r in rows if r["batch"] == b]) for b in batches}
    found = [p for p in points.values() if p is not None]
    suggested = 32 * int(min(found) // 32) if found else None
    summary = "; ".join(f"batch {b}: " + (f"N ≈ {p:.0f}" if p is not None else _no_trend(rows, b))
                        for b, p in points.items())
    md = table(rows)
    print(md)
    print(f"\ncrossover (exact cheaper below): {summary}; suggested AUTO_EXACT_BELOW = {suggested} "
          f"(model/hashes.py has {AUTO_EXACT_BELOW})")
    plot(rows, points)
    if args.write_docs:
        write_section(SECTION,
            f"Where `hashes=\"auto\"` switches: one `embed` forward of the bundled default model, random ids, no "
            f"padding, exact YOSO-E against its {lsh} LSH hashes, alternated rounds (`bench/crossover.py`). "
            f"{'; '.join(notes)}.\n\n{md}\n\n"
            f"Crossover (exact cheaper below): {summary}. Suggested `--auto-exact-below` (`AUTO_EXACT_BELOW` in "
            f"model/hashes.py, now {AUTO_EXACT_BELOW}): the smallest crossover found, rounded down to a multiple "
            f"of 32: {suggested}.\n\n"
            f"![crossover](img/{PLOT.name})")


if __name__ == "__main__":
    main()
