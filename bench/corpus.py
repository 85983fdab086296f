"""Indexing a corpus: an HTTP client loop against yoso-serve, against ``yoso-embed`` on the local engine and on
the Ray engine with 1 and 2 workers, on the same documents.

The documents are cut at token boundaries from the Python documentation's reStructuredText sources that
Debian installs (python3.11-doc), 1000-4000 tokens each, as bench/peer.py cuts them. Each cell is one whole
job as a user runs it, timed from the command's start to its end, model load included:

* ``http``: ``yoso-serve`` (defaults) started, then a client posting every document to ``/embed`` with
  ``long_input: "chunk"``, two requests in flight, then stopped;
* ``local``: ``yoso-embed --input corpus.jsonl --out DIR`` (defaults);
* ``ray-1``, ``ray-2``: the same with ``--engine ray --workers N --threads-per-worker CORES/N`` on a Ray
  started for the job.

``--runs N`` repeats the four, rotating which goes first; medians of docs/s and tokens/s are printed as a
markdown table with the machine, the plot goes to docs/img/corpus.png, raw numbers to bench/out/corpus.json,
and ``--write-docs`` replaces the section of docs/benchmarks.md. The first run also checks that every mode
wrote the same vectors, bit for bit. The driver's own pass over the input (read, check, deduplicate: what
bounds a cluster's input rate) is timed on its own.

    .venv/bin/python bench/corpus.py --docs 300 --runs 3 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine, save_figure, write_section  # noqa: E402
from load import free_port  # noqa: E402
from peer import cut  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "corpus"
PLOT = ROOT / "docs" / "img" / "corpus.png"
RAW = ROOT / "bench" / "out" / "corpus.json"
SECTION = "## Indexing a corpus (yoso-embed)"
BIN = Path(sys.executable).parent
MODES = ("http", "local", "ray-1", "ray-2")
TARGET_DOCS = 10_000_000


def _vectors(out: Path) -> dict[str, np.ndarray]:
    import pyarrow.dataset as ds

    table = ds.dataset(out / "parts").to_table(columns=["id", "vector"])
    return {i: np.asarray(v, np.float32) for i, v in zip(table.column("id").to_pylist(),
                                                          table.column("vector").to_pylist())}


def run_http(docs: list[str], work: Path) -> tuple[float, int, dict]:
    import httpx

    start = time.perf_counter()
    port = free_port()
    proc = subprocess.Popen([str(BIN / "yoso-serve"), "--host", "127.0.0.1", "--port", str(port), "--log-level",
                             "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit("yoso-serve exited before it was ready")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=600) as client:
            def one(i: int):
                r = client.post("/embed", json={"inputs": [docs[i]], "long_input": "chunk"})
                r.raise_for_status()
                return str(i), np.asarray(r.json()[0], np.float32), int(r.headers["x-compute-tokens"])

            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(one, range(len(docs))))
    finally:
        proc.terminate()
        proc.wait(60)
    return time.perf_counter() - start, sum(t for *_, t in answers), {i: v for i, v, _ in answers}


def run_embed(mode: str, src: Path, work: Path) -> tuple[float, int, dict]:
    out = work / mode
    shutil.rmtree(out, ignore_errors=True)
    cmd = [str(BIN / "yoso-embed"), "--input", str(src), "--out", str(out), "--no-progress"]
    if mode.startswith("ray-"):
        workers = int(mode.split("-")[1])
        cmd += ["--engine", "ray", "--workers", str(workers), "--threads-per-worker",
                str(max(1, (os.cpu_count() or 1) // workers)), "--part-rows", "10"]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{run.stderr[-3000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    return wall, manifest["counts"]["tokens"], _vectors(out)


def driver_pass(src: Path) -> float:
    """Documents/s of the reader and admission alone (what the Ray driver does before the workers start)."""
    from yoso_serve.service.corpus.sources import Admission, Document, plan_sources, read_documents

    start, n = time.perf_counter(), 0
    admission = Admission(set())
    for row in read_documents(plan_sources([src]), "id", "text"):
        n += isinstance(row, Document) and isinstance(admission.check(row), Document)
    return n / (time.perf_counter() - start)


def plot(medians: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(medians)
    ax.bar(names, [medians[m]["docs_s"] for m in names], color=["#888", "#2a6", "#26a", "#14c"][: len(names)])
    ax.set_ylabel("documents / s (median)")
    ax.set_title("Indexing 1-4k-token documents, end to end")
    save_figure(fig, PLOT, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=300)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--write-docs", action="store_true")
    p.add_argument("--from-json", action="store_true", help="publish bench/out/corpus.json again, running nothing")
    args = p.parse_args()
    modes = args.modes.split(",")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        publish(json.loads(RAW.read_text()), args.write_docs)
        return
    _, docs, _ = cut(0, args.docs)
    src = OUT / "corpus.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": str(i), "text": doc}) + "\n")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    same = None
    for r in range(args.runs):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        vectors = {}
        for mode in order:
            wall, tokens, vecs = run_http(docs, OUT) if mode == "http" else run_embed(mode, src, OUT)
            results[mode].append({"wall_s": wall, "docs_s": len(docs) / wall, "tokens_s": tokens / wall})
            print(f"run {r + 1} {mode}: {wall:.1f} s, {len(docs) / wall:.2f} docs/s", flush=True)
            vectors[mode] = vecs
        if r == 0:
            first = vectors[modes[0]]
            same = all(set(v) == set(first) and all(np.array_equal(v[i].view(np.uint32), first[i].view(np.uint32))
                                                    for i in first) for v in vectors.values())
            print(f"vectors bit for bit equal across {', '.join(modes)}: {same}", flush=True)
    data = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "docs": args.docs,
            "runs": args.runs, "results": results, "driver_docs_s": driver_pass(src), "equal": same}
    RAW.write_text(json.dumps(data, indent=2))
    publish(data, args.write_docs)


def publish(data: dict, write_docs: bool) -> None:
    """Print the table (and the paragraph on a cluster), plot, and with ``write_docs`` replace the section."""
    medians = {m: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "docs_s", "tokens_s")}
               for m, rs in data["results"].items()}
    first = next(iter(data["results"].values()))[0]
    mean_tokens = first["tokens_s"] * first["wall_s"] / data["docs"]
    lines = [f"Machine: {data['machine']}. Date: {data['date']}. {data['docs']} documents of 1000-4000 tokens "
             f"(mean {mean_tokens:,.0f} tokens run, specials included), medians of {data['runs']} runs, each a whole job as a user "
             "runs it (start, model load, every document, exit). Vectors bit for bit equal across the modes: "
             f"{'yes' if data['equal'] else 'NO'}." + (f" {data['note']}" if data.get("note") else ""), "",
             "| mode | wall s | docs/s | tokens/s | vs http |", "|---|---|---|---|---|"]
    base = medians.get("http", next(iter(medians.values())))["docs_s"]
    for m, v in medians.items():
        lines.append(f"| {m} | {v['wall_s']:.1f} | {v['docs_s']:.2f} | {v['tokens_s']:,.0f} | "
                     f"{v['docs_s'] / base:.2f}x |")
    reader = data["driver_docs_s"]
    text = (f"Start-up (the model's load, Ray's own start) is inside every figure. The driver's own pass over the input "
            f"(read, check, deduplicate), alone: {reader:,.0f} docs/s.")
    if "ray-1" in medians:
        rate = medians["ray-1"]["docs_s"]
        text += (f" On paper, for {TARGET_DOCS:,} such documents: one worker of this machine (both cores) at {rate:.2f} "
                 f"docs/s would take {TARGET_DOCS / rate / 3600:,.0f} hours, N of them that over N. GPU workers are not "
                 "measured here; whatever their rate r, N of them take 10^7 / (N r) seconds until the driver binds: it "
                 f"reads, checks and stages the corpus alone, at most at the rate above ({TARGET_DOCS / reader / 60:,.0f} "
                 "minutes for the whole corpus, before the workers start), and copies the admitted texts once into "
                 "`DIR/_staging`, so shared storage takes the corpus once in and out and the vectors once (1.5 KB a "
                 "document at 384 float32). Each worker loads the model once; a lost worker costs the part it was writing.")
    lines += ["", text]
    table = "\n".join(lines)
    print(table)
    plot(medians)
    if write_docs:
        write_section(SECTION, table + "\n\n![indexing](img/corpus.png)\n\nCommand: `.venv/bin/python bench/corpus.py "
                      f"--docs {data['docs']} --runs {data['runs']} --write-docs`.")

if __name__ == "__main__":
    main()
