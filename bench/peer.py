"""yoso-serve beside its peer, infinity-emb serving all-MiniLM-L6-v2 in each CPU configuration a user would
try, over loopback: what a user who chunks a short model gets today, against one pass over the whole document;
and how close the served tokens/s come to the dense layers' floor.

One run starts each server alone on 127.0.0.1 (never two at once: they share the cores), drives it, stops
it. yoso-serve serves the default model with its default settings (``hashes=auto``, ``--dense-dtype auto``);
infinity-emb 0.0.78 (bench/_peer_servers.py) runs with its torch engine in fp32 (its default on CPU), in
bf16 and in int8 (``--dtype int8``: torch's dynamic quantization of the fp32 weights), and with its ONNX Runtime
engine (``--peers`` picks among them; each is checked to run as named).

* short texts, 128 tokens, one per request: req/s and p50/p95 latency at concurrency 1, 8, 32;
* long documents, 1000–4000 tokens (mean about 2500), one per request: docs/s for yoso-serve in one
  pass, for infinity over 240-token windows (all of a document's windows in one request, their
  vectors averaged and renormalised on the client), and with ``--truncated`` for infinity truncated at 512;
* the same documents indexed piece by piece: yoso-serve's ``/embed_pieces`` (one pass, a vector per
  128-token piece and the document's own) against infinity embedding every 128-token window of a
  document (one request per document, each window a vector of its own);
* what the speed costs the vectors: each server embeds the first 64 short texts once, in one request, and
  each is compared with the same model in fp32 (yoso-serve's bundled model in the bench process, infinity's
  torch fp32 server);
* the floor: each batch shape yoso-serve served (its /metrics over each cell) is timed through the dense
  layers alone after the servers stop (bench/linear.py's ``dense_pass``), and the served tokens/s are
  reported as a share of what those GEMMs alone would allow.

Texts are cut at token boundaries from the Python documentation's reStructuredText sources that
Debian installs (python3.11-doc), the same tokenizer counting for both models. Every cell is
bounded in requests and seconds (short cells 15 s, long cells 45 s by default: 48 documents took
12–25 s a cell on 2 cores), and the run prints its bound at the start. Requests go over pre-encoded
keep-alive HTTP/1.1 connections (bench/load.py's reason: httpx's client CPU would be taken from the
servers' cores). ``--runs N`` repeats every server N times, alternating the order; yoso-serve is set
against the best configuration of each measure (highest median), medians and per-run ratios printed as
markdown, the plots go to docs/img/peer.png and peer_floor.png, raw numbers to bench/out/peer.json.

    make bench-peer ARGS="--runs 3 --write-docs"     # or .venv/bin/python bench/peer.py ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))
from _peer_report import (FLOOR_CELLS, PIECE_TOKENS, SHORT_TOKENS, WINDOW_TOKENS, agreement_table,  # noqa: E402
                          batch_shape, excluded_peers, floor_rows, floor_table, plot, plot_floor, tables)
from _peer_servers import (OUT, PEER_NAME, PEERS, ROOT, cell, infinity_server, parse_peers,  # noqa: E402
                           peer_model_dir, stop, yoso_server)
from _sections import machine, write_section  # noqa: E402
from load import free_port  # noqa: E402

PLOT = ROOT / "docs" / "img" / "peer.png"
FLOOR_PLOT = ROOT / "docs" / "img" / "peer_floor.png"
SECTION = "## Served side by side with infinity-emb"
FLOOR_SECTION = "## The dense-layer floor"
SOURCES = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc; never man pages
START_S = 60.0  # a server's start and its cells' warm-ups, in the bound printed at the start
PROBE_TEXTS = 64  # short texts each server embeds once, in one request, for the cosine-to-fp32 table
PEER_KEYS = {p.key: p for p in PEERS.values()}


def corpus(chars: int) -> str:
    """The first ``chars`` characters of the docs' sources, files in sorted order."""
    if not SOURCES.is_dir():
        raise SystemExit(f"{SOURCES} is missing: install the Debian package python3.11-doc")
    parts, total = [], 0
    for path in sorted(SOURCES.rglob("*.rst.txt")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= chars:
            break
    return "\n\n".join(parts)


def cut(n_short: int, n_docs: int, seed: int = 0) -> tuple[list[str], list[str], dict[int, list[list[str]]]]:
    """Short texts, documents and each document's windows of WINDOW_TOKENS and of PIECE_TOKENS tokens (size →
    per document), cut from the corpus at token boundaries (lengths count the two special tokens)."""
    from yoso_serve.model import TextTokenizer
    from yoso_serve.model.default import minilm_dir

    tok = TextTokenizer.from_dir(minilm_dir())
    rng = np.random.default_rng(seed)
    doc_lengths = rng.integers(1000, 4001, n_docs)
    text = corpus(8 * (n_short * SHORT_TOKENS + int(doc_lengths.sum())))
    ids, offsets = tok.encode_with_offsets([text], add_special_tokens=False)[0]
    pos = 0

    def take(n_content: int) -> tuple[str, list[tuple[int, int]]]:
        nonlocal pos
        if pos + n_content > len(ids):
            raise SystemExit("the docs corpus ran out of tokens; ask for fewer texts")
        span = offsets[pos: pos + n_content]
        pos += n_content
        return text[span[0][0]: span[-1][1]], [(a - span[0][0], b - span[0][0]) for a, b in span]

    shorts = [take(SHORT_TOKENS - 2)[0] for _ in range(n_short)]
    docs, windows = [], {WINDOW_TOKENS: [], PIECE_TOKENS: []}
    for n in doc_lengths:
        doc, spans = take(int(n) - 2)
        docs.append(doc)
        for size, per_doc in windows.items():
            step = size - 2
            per_doc.append([doc[spans[i][0]: spans[min(i + step, len(spans)) - 1][1]]
                            for i in range(0, len(spans), step)])
    return shorts, docs, windows


def windowed_mean(key, body: bytes) -> bool:
    """The client's share of windowing: average a document's window vectors and renormalise."""
    vectors = np.array([d["embedding"] for d in json.loads(body)["data"]], dtype=np.float32)
    mean = vectors.mean(axis=0)
    return bool(np.isfinite(mean / np.linalg.norm(mean)).all())


def all_windows(key, body: bytes, windows: dict) -> bool:
    """Every window of the document came back as a vector of its own."""
    return len(json.loads(body)["data"]) == len(windows[key])


def pieces(key, body: bytes) -> bool:
    """/embed_pieces answered the document's vector and at least one piece vector."""
    doc = json.loads(body)[0]
    return len(doc["embedding"]) > 0 and len(doc["pieces"]) > 0


async def measure(server: str, port: int, shorts, docs, windows, args) -> dict:
    """Every cell of one server, in order; a dict of label → cell."""
    out, yoso = {}, server == "yoso"
    if yoso:
        short_bodies, short_path = {i: {"inputs": t} for i, t in enumerate(shorts)}, "/embed"
    else:
        short_bodies, short_path = {i: {"model": PEER_NAME, "input": [t]} for i, t in enumerate(shorts)}, "/embeddings"
    for c in args.concurrency:
        out[f"short c={c}"] = await cell(port, short_path, short_bodies, c, args.short_requests, args.short_seconds,
                                         metrics=yoso)
        print(f"{server} short c={c}: {out[f'short c={c}']}", file=sys.stderr)
    long_args = (args.long_concurrency, len(docs), args.long_seconds)
    if yoso:
        out["long one pass"] = await cell(port, "/embed", {i: {"inputs": d} for i, d in enumerate(docs)}, *long_args,
                                          metrics=True)
        out["long pieces"] = await cell(port, "/embed_pieces", {i: {"inputs": d, "piece_tokens": PIECE_TOKENS}
                                                               for i, d in enumerate(docs)}, *long_args, check=pieces,
                                        metrics=True)
    else:
        out["long windows"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": w}
                                                               for i, w in enumerate(windows[WINDOW_TOKENS])},
                                         *long_args, check=windowed_mean)
        small = windows[PIECE_TOKENS]
        out["long small windows"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": w}
                                                                     for i, w in enumerate(small)}, *long_args,
                                               check=lambda key, body: all_windows(key, body, small))
        if args.truncated:
            out["long truncated"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": [d]}
                                                                     for i, d in enumerate(docs)}, *long_args)
    for label in [k for k in out if k.startswith("long")]:
        print(f"{server} {label}: {out[label]}", file=sys.stderr)
    return out


def probe(port: int, yoso: bool, shorts: list[str]) -> list[list[float]]:
    """The first PROBE_TEXTS short texts' vectors from one server, in one request."""
    import httpx

    texts, url = shorts[:PROBE_TEXTS], f"http://127.0.0.1:{port}"
    if yoso:
        return httpx.post(f"{url}/embed", json={"inputs": texts}, timeout=300).json()
    data = httpx.post(f"{url}/embeddings", json={"model": PEER_NAME, "input": texts}, timeout=300).json()["data"]
    return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]


def yoso_fp32_vectors(shorts: list[str]) -> list[list[float]]:
    """The probe texts through the bundled model in this process with its dense layers in fp32, each alone at
    the served default (``hashes=auto`` resolved for its length as the server resolves it)."""
    import torch

    from yoso_serve.model import default_model_dir, linear, load_pretrained
    from yoso_serve.model.hashes import AUTO, AUTO_EXACT_BELOW, resolve_hashes

    model = load_pretrained(default_model_dir()).eval()
    linear.set_dense_dtype(model, "fp32")
    out = []
    with torch.inference_mode():
        for ids in model.tokenizer.encode(shorts[:PROBE_TEXTS]):
            x = torch.tensor([ids])
            hashes = resolve_hashes(model.config, AUTO, exact_below=AUTO_EXACT_BELOW, n_tokens=len(ids))
            out.append(model.embed(x, torch.ones_like(x), hashes=hashes)[0].tolist())
    return out


def run_server(server: str, texts: tuple, args, peer_model: Path | None,
               vectors: dict | None = None) -> tuple[dict, str]:
    """One server started alone, measured, stopped: its cells, and how it ran (yoso-serve: its dense dtype;
    infinity: its engine and dtype as /models gives them). With ``vectors``, first the probe texts' vectors
    into ``vectors[server]``."""
    port = free_port()
    proc, ran_as = yoso_server(port) if server == "yoso" else infinity_server(port, peer_model, PEER_KEYS[server])
    print(f"{server} ready: {ran_as}", file=sys.stderr)
    try:
        if vectors is not None:
            vectors[server] = probe(port, server == "yoso", texts[0])
        return asyncio.run(measure(server, port, *texts, args)), ran_as
    finally:
        stop(proc)


def estimate_s(args, peers: list) -> float:
    """The longest a measured run can take: every cell at its time bound, START_S for each server's start."""
    short = len(args.concurrency) * args.short_seconds
    yoso = START_S + short + 2 * args.long_seconds
    infinity = START_S + short + (3 if args.truncated else 2) * args.long_seconds
    return args.runs * (yoso + len(peers) * infinity)


def measure_all(args, peers: list, command: str) -> dict:
    """``args.runs`` rounds of every server, alternating the order; then the dense floor of each batch shape
    yoso-serve served. Saved to bench/out/peer.json."""
    texts = cut(256, args.docs)
    peer_model = peer_model_dir(onnx=any(p.engine == "optimum" for p in peers)) if peers else None
    load_before, runs, ran_as, started = os.getloadavg(), [], {}, time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    failed, vectors = {}, {}
    for run in range(args.runs):
        order = ["yoso"] + [p.key for p in peers]
        if run % 2:
            order.reverse()
        runs.append({})
        for server in order:
            try:
                runs[-1][server], ran_as[server] = run_server(server, texts, args, peer_model,
                                                              None if server in vectors else vectors)
            except RuntimeError as exc:  # one configuration that will not start leaves the others' figures
                if server == "yoso":
                    raise
                failed[server] = str(exc)
                print(f"{server} not measured: {exc}", file=sys.stderr)
    load_after = os.getloadavg()
    vectors["yoso fp32"] = yoso_fp32_vectors(texts[0])
    dense = {}
    if args.floor:
        from linear import dense_seconds
        from yoso_serve.model import default_model_dir, load_pretrained

        shapes = sorted({batch_shape(r["yoso"][lb]) for r in runs for lb in FLOOR_CELLS
                         if r["yoso"].get(lb, {}).get("batches")})
        times = dense_seconds(load_pretrained(default_model_dir()), {s: s for s in shapes}, ran_as["yoso"],
                              args.floor_repeats)
        dense = {f"{a}x{b}": t for (a, b), t in times.items()}
    saved = {"args": {k: v for k, v in vars(args).items() if k != "from_json"}, "command": command, "runs": runs,
             "ran_as": ran_as, "failed": failed, "load": [load_before, load_after], "dense_s": dense,
             "vectors": vectors,
             "machine": machine(),
             "date": f"{started}–{time.strftime('%H:%M', time.gmtime())} UTC"}
    (OUT / "peer.json").write_text(json.dumps(saved, indent=1))
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="rounds of every server, alternating the order")
    parser.add_argument("--peers", default="all", help=f"infinity configurations, comma-separated from "
                        f"{', '.join(PEERS)} (default all)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--short-requests", type=int, default=1000, help="most requests per short cell")
    parser.add_argument("--short-seconds", type=float, default=15.0, help="most seconds per short cell")
    parser.add_argument("--docs", type=int, default=48, help="long documents, each sent once per cell")
    parser.add_argument("--long-concurrency", type=int, default=8)
    parser.add_argument("--long-seconds", type=float, default=45.0, help="most seconds per long cell")
    parser.add_argument("--truncated", action="store_true", help="also infinity on the documents truncated at "
                        "512 tokens (not compared: another output)")
    parser.add_argument("--yoso-only", action="store_true", help="no peer")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="skip the dense-layer floor")
    parser.add_argument("--floor-repeats", type=int, default=10, help="timed dense passes per batch shape")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--from-json", type=Path, help="report a saved bench/out/peer.json instead of measuring")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    saved = json.loads(args.from_json.read_text()) if args.from_json else None
    if saved:
        args = argparse.Namespace(**{**saved["args"], "write_docs": args.write_docs})
    peers = [] if args.yoso_only else parse_peers(args.peers)
    if not saved:
        print(f"{args.runs} run(s) of yoso-serve and {len(peers)} infinity configuration(s): at most about "
              f"{estimate_s(args, peers) / 60:.0f} min (every cell at its time bound, {START_S:.0f} s a start), and "
              "a minute or two for the ONNX export (once) and the floor",
              file=sys.stderr)
        saved = measure_all(args, peers, "make bench-peer ARGS=\"" + " ".join(sys.argv[1:]) + "\"")
    runs, command = saved["runs"], saved["command"]
    dense = {tuple(int(n) for n in k.split("x")): t for k, t in saved["dense_s"].items()}
    vectors = saved.get("vectors", {})
    excluded = excluded_peers(vectors, peers)
    md = tables(runs, peers, args.concurrency, excluded)
    agreement = agreement_table(vectors, peers, saved["ran_as"]["yoso"])
    md += f"\n\n{agreement}" if agreement else ""
    floor_md = floor_table(floor_rows(runs, dense), runs, peers, dense, excluded, args.concurrency) if dense else ""
    print(f"machine: {saved['machine']}; {saved['date']}; command: {command}\nran as: {saved['ran_as']}\n\n{md}"
          f"\n\n{floor_md}")
    plot(runs, peers, args.concurrency, args.long_concurrency, PLOT, saved["ran_as"].get("yoso"), excluded)
    if dense:
        plot_floor(floor_rows(runs, dense), FLOOR_PLOT)
    if args.write_docs and peers and not saved["failed"]:
        write_docs(saved, args, peers, md, floor_md, command)
    if saved["failed"]:
        raise SystemExit("not measured (docs left as they were): " + "; ".join(
            f"{server}: {why}" for server, why in saved["failed"].items()))


def write_docs(saved: dict, args, peers: list, md: str, floor_md: str, command: str) -> None:
    load = f"load average {saved['load'][0][0]:.1f} before, {saved['load'][1][0]:.1f} after"
    ran = "; ".join(f"{p.label}: `{saved['ran_as'][p.key]}`" for p in peers)
    write_section(SECTION, f"`bench/peer.py` (`{command}`, {saved['date']}): yoso-serve with its defaults (the "
                  f"bundled model, `hashes=auto`, `--dense-dtype auto`, here {saved['ran_as']['yoso']}) against "
                  f"infinity-emb 0.0.78 serving all-MiniLM-L6-v2 in each CPU configuration a user would try "
                  f"({', '.join(p.label for p in peers)}), each server alone on loopback, the same texts cut from "
                  f"Debian's Python documentation sources. Short texts: {SHORT_TOKENS} tokens, one per request, at "
                  f"most {args.short_seconds:g} s a cell. Long documents: {args.docs} of 1000–4000 tokens "
                  f"(mean about 2500), one per request, concurrency {args.long_concurrency}, at most "
                  f"{args.long_seconds:g} s a cell. Machine: {saved['machine']}; {load}. How each infinity server "
                  f"said it ran: {ran}."
                  f"\n\n{md}\n\n![peer](img/{PLOT.name})")
    if floor_md:
        write_section(FLOOR_SECTION, f"The same run's yoso-serve cells against the dense layers alone "
                      f"(`bench/linear.py`'s `dense_pass`: the bundled model's `Linear` layers at the server's dense "
                      f"dtype, {saved['ran_as']['yoso']}, Q/K/V, attention output, FFN with their epilogues, over "
                      f"each cell's mean batch from the server's /metrics, medians of {args.floor_repeats}, in the "
                      f"bench process after the servers stopped). \"Share of the floor\" is served tokens/s over "
                      f"what the GEMMs alone would allow; \"in the forward\" the wall time inside the model's "
                      f"forward; the rest is HTTP, tokenising and the queue. \"Over the best, at the floor\" is "
                      f"yoso-serve / best of the table above divided by the share: the most that faster code around "
                      f"the same GEMMs could make of that row. Command: `{command}`, "
                      f"{saved['date']}. Machine: {saved['machine']}; {load}."
                      f"\n\n{floor_md}\n\n![floor](img/{FLOOR_PLOT.name})")


if __name__ == "__main__":
    main()
