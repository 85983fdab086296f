"""Hash count against quality: what fewer LSH samples cost a long-document model, to choose ``--hashes``.

Two measurements of one model (default: the bundled one), every count in one run:

1. Noise by length: the pooled embedding at m hashes against the same model's exact YOSO-E
   embedding (mean and lowest cosine), for documents truncated to each length. LSH noise falls only
   slowly with length, so a long input does not excuse fewer hashes by itself.
2. Deep retrieval (``yoso-train eval``'s task, student side only): a paragraph from a document's
   second half is the query, every document of the corpus the answer set; queries run as the server's
   ``auto`` would (exact when short), documents at each m. Needs a document JSONL
   (``{doc, source, blocks, tokens}``, what ``yoso-train longdoc-data`` writes); the default is the
   held-out PostgreSQL source of ``make default-model``'s work directory.

3. Speed (``--speed``): one forward of the whole model at each m and exact, as served (int8 hashing as the
   model's config says, the dense layers' GEMMs in bf16 where the CPU has them, as ``--dense-dtype auto``),
   random token ids, every mode interleaved inside each repeat and the median kept, so the ratios compare
   forwards taken seconds apart. Unlike the quality parts this needs a quiet machine.

Prints markdown tables, writes docs/img/hashes.png, and with ``--write-docs`` replaces the "## Hash count
against quality" section of docs/benchmarks.md.

    PYTHONSAFEPATH=1 .venv/bin/python bench/hashes.py [--counts 8 16 32] [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "model" / "bundled" / "yoso-minilm-l6-4096"
TRANSFER = ROOT / "runs" / "default-model" / "longdoc-data" / "transfer_docs.jsonl"
PLOT = ROOT / "docs" / "img" / "hashes.png"
SECTION = "## Hash count against quality"


def noise_by_length(model, docs: list[list[int]], lengths: list[int], counts: list[int], batch: int = 4) -> dict:
    """(length, m) -> (mean, lowest) cosine of the m-hash embedding to the exact one."""
    out = {}
    bar = tqdm(total=len(lengths) * (len(counts) + 1), desc="noise by length", unit="setting")
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([d[:n] for d in docs])
            mask = torch.ones_like(ids)

            def embed(m):
                return torch.cat([model.embed(ids[i:i + batch], mask[i:i + batch], hashes=m).float()
                                  for i in range(0, len(ids), batch)])

            exact = embed(0)
            bar.update()
            for m in counts:
                cos = F.cosine_similarity(embed(m), exact)
                out[(n, m)] = (cos.mean().item(), cos.min().item())
                bar.update()
    bar.close()
    return out


def deep_retrieval(model, rows: list[dict], counts: list[int], max_docs: int) -> tuple[int, dict]:
    """(documents, m -> {recall_at_1, mrr_at_10}) with queries at auto."""
    from yoso_serve.model.train import retrieval

    docs, queries = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=max_docs, seed=0)
    emb = retrieval.Embedders(model, None, hashes="auto", window=240, device=torch.device("cpu"))
    q = emb.student_one_pass(queries)
    out = {}
    for m in counts:
        emb.hashes = m
        out[m] = retrieval.scores(q, emb.student_one_pass(docs))
    return len(docs), out


def speed(model, shapes: list[tuple[int, int]], counts: list[int], repeats: int) -> dict:
    """(batch, n) -> {m: median seconds of one forward}, exact YOSO-E as m = 0, modes interleaved per repeat."""
    from statistics import median

    out = {}
    modes = [*counts, 0]
    bar = tqdm(total=len(shapes) * (repeats + 1) * len(modes), desc="speed", unit="forward")
    with torch.inference_mode():
        for batch, n in shapes:
            ids = torch.randint(1000, 20000, (batch, n), generator=torch.Generator().manual_seed(n))
            mask = torch.ones_like(ids)
            times = {m: [] for m in modes}
            for _ in range(repeats + 1):  # the first round warms up
                for m in modes:
                    start = time.perf_counter()
                    model.last_hidden(ids, mask, hashes=m)
                    times[m].append(time.perf_counter() - start)
                    bar.update()
            out[(batch, n)] = {m: median(t[1:]) for m, t in times.items()}
    bar.close()
    return out


def plot(noise: dict, lengths: list[int], counts: list[int], path: Path, deep: dict | None = None,
         timed: dict | None = None) -> None:
    """The noise by length; with the speed part, beside it deep recall@1 against forward time per count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11.5 if timed else 6.4, 4), squeeze=False)
    ax = axes[0][0]
    for m in counts:
        ax.plot(lengths, [noise[(n, m)][0] for n in lengths], marker="o", label=f"{m} hashes")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("input tokens")
    ax.set_ylabel("mean cosine to exact YOSO-E")
    ax.set_title("LSH noise in the pooled embedding")
    ax.grid(alpha=0.3)
    ax.legend()
    if timed:
        ax = axes[0][1]
        for (batch, n), t in timed.items():
            ms = [1e3 * t[m] for m in counts]
            ax.plot(ms, [deep[m]["recall_at_1"] for m in counts], marker="o", label=f"forward of {batch} × {n}")
            for m, x in zip(counts, ms):
                ax.annotate(f"{m}", (x, deep[m]["recall_at_1"]), textcoords="offset points", xytext=(4, -10))
        ax.set_xlabel("forward time as served (ms, median)")
        ax.set_ylabel("deep retrieval recall@1")
        ax.set_title("what each hash count buys (labels: hashes)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--data", type=Path, default=TRANSFER, help="document JSONL for both parts")
    p.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--lengths", type=int, nargs="+", default=[288, 512, 1024, 2048, 3072])
    p.add_argument("--noise-docs", type=int, default=24, help="documents in the noise part")
    p.add_argument("--retrieval-docs", type=int, default=300)
    p.add_argument("--speed", action="store_true", help="also time whole forwards at each count (quiet machine)")
    p.add_argument("--shapes", nargs="+", default=["1x4096", "4x1024"], help="batch x N of the speed part")
    p.add_argument("--repeats", type=int, default=5, help="interleaved forwards per mode in the speed part")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--plot", type=Path, default=PLOT)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.data.is_file():
        p.error(f"--data {args.data} not found: build it with `make default-model` (stage longdoc-data) "
                "or pass a document JSONL")
    if any(m < 1 for m in args.counts) or any(n < 3 for n in args.lengths):
        p.error("--counts must be >= 1 (exact is the reference) and --lengths >= 3")
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    except ValueError:
        p.error(f"--shapes must be BATCHxN, got {args.shapes}")
    if args.repeats < 1 or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error("--repeats must be >= 1 and --shapes BATCHxN with both >= 1")

    from yoso_serve.model import load_pretrained
    from yoso_serve.model.linear import native_bf16, set_dense_dtype
    from yoso_serve.model.train.longdoc import read_documents

    model = load_pretrained(args.model, device=torch.device("cpu"))
    rows = read_documents([args.data])
    longest = max(args.lengths)
    texts = ["\n".join(r["blocks"]) for r in rows if r.get("tokens", 0) >= longest + 128][:args.noise_docs]
    if len(texts) < 2:
        p.error(f"--data has {len(texts)} documents of at least {longest + 128} tokens; need 2")
    docs = model.tokenizer.encode(texts, max_length=model.config.max_length)
    noise = noise_by_length(model, docs, args.lengths, args.counts)
    n_docs, deep = deep_retrieval(model, rows, args.counts, args.retrieval_docs)
    dense = "bf16" if native_bf16() else "fp32"  # what the server's --dense-dtype auto picks on this CPU
    timed = {}  # (batch, n) -> {m: seconds}, with --speed
    if args.speed:
        set_dense_dtype(model, dense)
        timed = speed(model, shapes, args.counts, args.repeats)
        set_dense_dtype(model, "fp32")

    head = "| tokens | " + " | ".join(f"{m} hashes" for m in args.counts) + " |"
    noise_table = [head, "|---:|" + "---:|" * len(args.counts)]
    for n in args.lengths:
        noise_table.append(f"| {n} | " + " | ".join(f"{noise[(n, m)][0]:.3f} (min {noise[(n, m)][1]:.3f})"
                                                      for m in args.counts) + " |")
    deep_table = ["| document hashes | recall@1 | MRR@10 |", "|---:|---:|---:|"]
    for m in args.counts:
        r = deep[m]
        deep_table.append(f"| {m} | {r['recall_at_1']:.3f} | {r['mrr_at_10']:.3f} |")
    base = 32 if 32 in args.counts else max(args.counts)  # the speed-ups are over this count
    speed_table = ["| batch × N | " + " | ".join(f"{m} hashes" for m in args.counts) + " | exact (YOSO-E) |",
                   "|---|" + "---:|" * (len(args.counts) + 1)]
    for (batch, n), t in timed.items():
        speed_table.append(f"| {batch} × {n} | " + " | ".join(
            f"{1e3 * t[m]:.0f} ms ({t[base] / t[m]:.2f}×)" for m in [*args.counts, 0]) + " |")
    speed_part = [f"Speed: one forward as served ({'int8' if model.config.hash_int8 else 'fp32'} hashing, dense "
                  f"GEMMs in {dense}), median of {args.repeats} interleaved repeats; in brackets the speed-up "
                  f"over {base} hashes:", "", *speed_table, ""] \
        if timed else []
    command = "PYTHONSAFEPATH=1 .venv/bin/python bench/hashes.py " + " ".join(sys.argv[1:])
    body = "\n".join([
        f"Command: `{command.strip()}`; model `{args.model.name}`, data `{args.data.name}`, "
        f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {machine()}.",
        "",
        f"Mean (and lowest) cosine of the pooled embedding at m hashes to the exact YOSO-E embedding, "
        f"{len(docs)} documents truncated to each length:", "", *noise_table, "",
        f"Deep retrieval, {n_docs} documents of 1.2k–4k tokens (a paragraph from the second half finds its "
        f"document; queries at `auto`, documents at m hashes):", "", *deep_table, "", *speed_part,
        "![hash count against quality](img/hashes.png)"])
    print(body)
    plot(noise, args.lengths, args.counts, args.plot, deep, timed)
    print(f"wrote {args.plot}")
    if args.write_docs:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
