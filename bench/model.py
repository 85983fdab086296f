"""Peak memory and time of one forward of the default-size model (MiniLM-L6 → YOSO) at long lengths.

Each (mode, N) runs in a fresh subprocess so that ``ru_maxrss`` is that forward's peak and no
allocator cache carries over. The model is the packaged all-MiniLM-L6-v2 converted to YOSO with a
16384-row position table (so every N fits); batch size 1, random token ids, one warm-up forward
at N = 128, then ``--repeats`` timed forwards of which the fastest is reported (the machine is
shared, so the minimum is the least noisy figure); peak RSS covers all of them. Prints a markdown table, writes docs/img/model_forward.png, and
with ``--write-docs`` replaces the "## Model forward" section of docs/benchmarks.md.

    PYTHONSAFEPATH=1 .venv/bin/python bench/model.py [--lengths 512 4096 16384] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

# appended, not prepended: bench/onnx.py must not shadow the onnx package (PYTHONSAFEPATH keeps bench/ off the path)
sys.path.append(str(Path(__file__).resolve().parent))
from _sections import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "model_forward.png"
SECTION = "## Model forward"
# LSH with the default 32 hashes at every length; exact YOSO-E (O(N²)) where it stays affordable.
EXACT_MAX_N = 4096

_CHILD = r"""
import json, resource, sys, time
import torch
from yoso_serve.model import load_pretrained

path, n, hashes, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = load_pretrained(path)
gen = torch.Generator().manual_seed(0)
with torch.inference_mode():
    warm = torch.randint(1000, 20000, (1, 128), generator=gen)
    model.last_hidden(warm, torch.ones_like(warm), hashes=hashes)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids = torch.randint(1000, 20000, (1, n), generator=gen)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = model.last_hidden(ids, torch.ones_like(ids), hashes=hashes)
        times.append(time.perf_counter() - start)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"n": n, "hashes": hashes, "seconds": min(times), "times": times, "rss_before_mib": before / 1024,
                  "peak_rss_mib": peak / 1024, "finite": bool(torch.isfinite(out).all())}))
"""


def run_one(model_dir: Path, n: int, hashes: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), str(n), str(hashes), str(repeats)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"forward at N={n}, hashes={hashes} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), CPU only")


def table(rows: list[dict]) -> str:
    lines = ["| mode | N | forward (s) | tokens/s | RSS before (MiB) | peak RSS (MiB) | forward extra (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mode = "exact (YOSO-E)" if r["hashes"] == 0 else f"LSH, {r['hashes']} hashes"
        lines.append(f"| {mode} | {r['n']} | {r['seconds']:.2f} | {r['n'] / r['seconds']:.0f} | "
                     f"{r['rss_before_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_rss_mib'] - r['rss_before_mib']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for hashes in sorted({r["hashes"] for r in rows}, reverse=True):
        sel = [r for r in rows if r["hashes"] == hashes]
        label = "exact (YOSO-E)" if hashes == 0 else f"LSH, {hashes} hashes"
        ax_t.plot([r["n"] for r in sel], [r["seconds"] for r in sel], "o-", label=label)
        ax_m.plot([r["n"] for r in sel], [r["peak_rss_mib"] for r in sel], "o-", label=label)
    for ax, ylabel in ((ax_t, "one forward (s)"), (ax_m, "peak RSS (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (batch 1)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle("YOSO MiniLM-L6 (384 hidden, 6 layers, 12 heads), CPU")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--hashes", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per point; the fastest counts")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    from yoso_serve.model import convert_bert_to_yoso
    from yoso_serve.model.default import minilm_dir

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = convert_bert_to_yoso(minilm_dir(), Path(scratch) / "m", max_positions=max(args.lengths),
                                         num_hash=args.hashes)
        for n in args.lengths:
            for hashes in (args.hashes, 0) if n <= EXACT_MAX_N else (args.hashes,):
                rows.append(run_one(model_dir, n, hashes, args.repeats))
                print(json.dumps(rows[-1]), file=sys.stderr)
    md = table(rows)
    print(md)
    plot(rows)
    if args.write_docs:
        write_section(SECTION,
            f"One forward of the default-size model (all-MiniLM-L6-v2 converted to YOSO: 6 layers, 384 hidden, "
            f"12 heads, τ = 8), batch 1, each point in a fresh process (`bench/model.py`). Machine: {machine()}.\n"
            f"The feed-forward block runs in chunks of 1024 positions above 4096 tokens. "
            f"\"forward extra\" is peak RSS minus the RSS after loading and a warm-up forward; time is the fastest of "
            f"{args.repeats} forwards.\n\n"
            f"{md}\n\n![model forward](img/{PLOT.name})"
        )


if __name__ == "__main__":
    main()
