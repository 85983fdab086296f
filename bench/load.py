"""HTTP load benchmark for yoso-serve: throughput and latency percentiles over loopback.

Starts its own `yoso-serve` on 127.0.0.1 (or uses --url), drives it with closed-loop asyncio
workers over keep-alive HTTP/1.1 connections at concurrency 1, 8, 32, 64 for 128- and
2048-token inputs, and puts the engine's in-process
throughput on the same inputs beside it (same settings, no HTTP). A second server with
--max-batch-requests 1 gives the dynamic-batching ratio. Every cell is bounded in request count
and in seconds, so the run stops by itself. ``--soak 300`` samples the server's RSS under load.
``--overload`` runs the overload scenario instead (bench/_overload.py: 64 clients against the
default server, 504 share, 429 latency, accepted throughput against an unsaturated run).

    .venv/bin/python bench/load.py                  # full matrix
    .venv/bin/python bench/load.py --quick          # fewer requests per cell
    .venv/bin/python bench/load.py --soak 300       # plus a 5-minute RSS soak
    .venv/bin/python bench/load.py --overload --runs 3 --seconds 60
    .venv/bin/python bench/load.py --overload --runs 3 --seconds 60 --before-args="--forward-nice 0"
    .venv/bin/python bench/load.py --overload --runs 3 --seconds 60 --before-script ../old/.venv/bin/yoso-serve

Prints a markdown table and writes bench/out/load.png (load_overload.png with --overload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np

OUT = Path(__file__).resolve().parent / "out"
SCRIPT = Path(sys.executable).parent / "yoso-serve"

# appended, not prepended: nothing in bench/ may shadow an installed package
sys.path.append(str(Path(__file__).resolve().parent))
import _overload  # noqa: E402


@dataclass
class Cell:
    label: str
    tokens: int
    concurrency: int
    done: int
    errors: int
    seconds: float
    latencies: list[float]
    client_ms: float | None = None  # load generator CPU per request (None: in-process, no client)

    @property
    def throughput(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")


def vocab_words(tok) -> list[str]:
    """Words the default model's tokenizer keeps as one token each."""
    return [w for w, _ in sorted(tok.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
            if w.isalpha() and w.islower() and len(w) >= 3][:5000]


def make_texts(n: int, tokens: int, seed: int) -> list[str]:
    """``n`` distinct texts of exactly ``tokens`` tokens (specials included) for the default model."""
    from yoso_serve.model import default_model_dir, load_pretrained

    tok = load_pretrained(default_model_dir()).tokenizer
    words = vocab_words(tok)
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        text = " ".join(rng.choice(words, tokens - 2))
        assert len(tok.encode([text])[0]) == tokens, "word list must tokenise one token per word"
        texts.append(text)
    return texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


READY_TIMEOUT_S = 600.0


def start_server(*flags: str, script: Path = SCRIPT) -> tuple[subprocess.Popen, str]:
    port = free_port()
    errors = tempfile.TemporaryFile()  # the server's stderr: its last lines explain an early exit
    proc = subprocess.Popen([str(script), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                             *flags], stdout=subprocess.DEVNULL, stderr=errors)
    url = f"http://127.0.0.1:{port}"
    # /ready answers 503 while the model loads (the first start also builds the C++ extension, a
    # minute or two): poll until 200, the process exits, or READY_TIMEOUT_S passes. Killing a
    # server mid-build used to leave torch's build lock behind (kernels/_build.py now clears it).
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-15:]
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready; its stderr ends:\n"
                               + "\n".join(tail))
        try:
            status = httpx.get(f"{url}/ready", timeout=1).status_code
            if status == 200:
                return proc, url
            last = f"/ready answered {status}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S:g} s ({last})")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


async def drive(send, texts: list[str], concurrency: int, max_requests: int, max_seconds: float):
    """Run ``concurrency`` closed-loop workers until ``max_requests`` are issued or time runs out."""
    issued, latencies, errors = 0, [], 0
    stop_at = time.perf_counter() + max_seconds

    async def worker():
        nonlocal issued, errors
        while issued < max_requests and time.perf_counter() < stop_at:
            text = texts[issued % len(texts)]
            issued += 1
            t0 = time.perf_counter()
            ok = await send(text)
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(latencies), errors, time.perf_counter() - start, latencies


class RawPool:
    """``concurrency`` keep-alive HTTP/1.1 connections sending pre-encoded ``POST /embed`` bytes.

    The load generator shares the server's cores, and its CPU is taken from the server: httpx
    spent 3–4 ms of client CPU per request, about a tenth of a batched 128-token forward on 2
    cores, so it measured the client as much as the server. Pre-built request bytes and a
    Content-Length read cost well under 0.1 ms per request.
    """

    def __init__(self, url: str, texts: list[str], size: int) -> None:
        parsed = httpx.URL(url)
        self.host, self.port, self.size = parsed.host, parsed.port or 80, size
        self.requests = {}
        for text in texts:
            body = json.dumps({"inputs": text}).encode()
            head = (f"POST /embed HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json"
                    f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            self.requests[text] = head + body
        self.idle: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> "RawPool":
        for _ in range(self.size):
            self.idle.put_nowait(await asyncio.open_connection(self.host, self.port))
        return self

    async def __aexit__(self, *exc) -> None:
        while not self.idle.empty():
            if (conn := self.idle.get_nowait()) is not None:
                conn[1].close()

    async def send(self, text: str) -> bool:
        """True on a 200 answer; another status or a broken connection is an error (reconnects)."""
        conn, ok = await self.idle.get(), False
        try:
            reader, writer = conn = conn or await asyncio.open_connection(self.host, self.port)
            writer.write(self.requests[text])
            lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            length = [int(line.split(b":", 1)[1]) for line in lines if line.lower().startswith(b"content-length:")]
            await reader.readexactly(length[0])
            ok = lines[0].split()[1] == b"200"
        except (OSError, IndexError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            if conn is not None:
                conn[1].close()
            conn = None  # the next send on this slot connects afresh
        self.idle.put_nowait(conn)
        return ok


async def http_cell(url: str, label: str, texts, tokens, concurrency, max_requests, max_seconds) -> Cell:
    async with RawPool(url, texts, concurrency) as pool:
        await pool.send(texts[0])  # skip first-request costs
        cpu = sum(os.times()[:2])
        done, errors, seconds, lat = await drive(pool.send, texts, concurrency, max_requests, max_seconds)
        client_ms = 1000 * (sum(os.times()[:2]) - cpu) / max(1, done + errors)
    return Cell(label, tokens, concurrency, done, errors, seconds, lat, client_ms)


async def engine_cell(texts, tokens, concurrency, max_requests, max_seconds, flags: dict) -> Cell:
    """The same engine and settings, called in-process: the ceiling the HTTP server is held to."""
    from yoso_serve.service import EmbedParams, ServeSettings, create_app

    app = create_app(ServeSettings(**flags))
    async with app.router.lifespan_context(app):
        await app.state.startup
        engine = app.state.engine

        async def send(text):
            await engine.embed(EmbedParams([text]))
            return True

        await send(texts[0])
        done, errors, seconds, lat = await drive(send, texts, concurrency, max_requests, max_seconds)
    return Cell("in-process", tokens, concurrency, done, errors, seconds, lat)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def soak(url: str, pid: int, texts, seconds: float) -> list[tuple[float, int]]:
    samples, start = [], time.perf_counter()

    async def sample():
        while time.perf_counter() - start < seconds:
            samples.append((time.perf_counter() - start, rss_kib(pid)))
            await asyncio.sleep(5)

    sampler = asyncio.create_task(sample())
    cell = await http_cell(url, "soak", texts, 128, 8, 10**9, seconds)
    await sampler
    print(f"soak: {cell.done} requests, {cell.errors} errors in {cell.seconds:.0f} s")
    return samples


def table(cells: list[Cell]) -> str:
    rows = ["| run | tokens | concurrency | requests | errors | req/s | p50 ms | p95 ms | p99 ms | client CPU ms/req |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        client = "—" if c.client_ms is None else f"{c.client_ms:.2f}"
        rows.append(f"| {c.label} | {c.tokens} | {c.concurrency} | {c.done} | {c.errors} | {c.throughput:.2f} "
                    f"| {c.pct(50):.0f} | {c.pct(95):.0f} | {c.pct(99):.0f} | {client} |")
    return "\n".join(rows)


def plot(cells: list[Cell], soak_samples, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if soak_samples else 2, figsize=(15 if soak_samples else 10, 4))
    for ax, tokens in zip(axes, (128, 2048)):
        for label in ("http", "in-process", "http mbr=1"):
            pts = sorted((c.concurrency, c.throughput) for c in cells if c.tokens == tokens and c.label == label)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(title=f"{tokens}-token inputs", xlabel="concurrency", ylabel="requests/s", xscale="log")
        if ax.lines:
            ax.legend()
    if soak_samples:
        t, rss = zip(*soak_samples)
        axes[2].plot(t, np.array(rss) / 1024)
        axes[2].set(title="server RSS under load", xlabel="s", ylabel="MiB", ylim=(0, max(rss) / 1024 * 1.2))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="benchmark a running server instead of starting one (no batching ratio)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--lengths", default="128,2048")
    p.add_argument("--requests", type=int, default=256, help="most requests per cell")
    p.add_argument("--seconds", type=float, default=60, help="most seconds per cell")
    p.add_argument("--quick", action="store_true", help="64 requests, 20 s per cell")
    p.add_argument("--soak", type=float, default=0, help="seconds of RSS soak at concurrency 8 (0 = none)")
    p.add_argument("--overload", action="store_true", help="the overload scenario instead of the matrix")
    p.add_argument("--runs", type=int, default=3, help="overload: runs of (baseline, overload)")
    p.add_argument("--overload-clients", type=int, default=64)
    p.add_argument("--baseline-clients", type=int, default=2, help="overload: the unsaturated run's clients")
    p.add_argument("--before-script", type=Path, help="overload: the before server is this yoso-serve (another "
                   "checkout's .venv/bin/yoso-serve: the code as it was), with --before-args if any")
    p.add_argument("--before-args", default="", help="overload: also drive a server started with these flags "
                   "(e.g. '--forward-nice 0'), side by side in each run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.seconds = 64, 20.0
    if args.overload:
        from yoso_serve.model import default_model_dir, load_pretrained

        OUT.mkdir(exist_ok=True)
        words = vocab_words(load_pretrained(default_model_dir()).tokenizer)
        _overload.run(words, start_server, stop_server, runs=args.runs, seconds=args.seconds,
                      overload_clients=args.overload_clients, baseline_clients=args.baseline_clients,
                      out_path=OUT / "load_overload.png", before_args=args.before_args.split(),
                      start_before=partial(start_server, script=args.before_script) if args.before_script else None)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    texts = {n: make_texts(64, n, seed=n) for n in lengths}
    # A long queue is the point of the benchmark: deadlines must not turn it into 504s.
    flags = {"max_batch_tokens": 16384, "max_batch_requests": 64, "request_timeout": 3600}
    cells: list[Cell] = []

    proc, url = (None, args.url) if args.url else start_server(
        *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()))
    try:
        for n in lengths:
            for c in levels:
                cells.append(asyncio.run(http_cell(url, "http", texts[n], n, c, args.requests, args.seconds)))
                print(table(cells[-1:]).splitlines()[-1], flush=True)
        soak_samples = asyncio.run(soak(url, proc.pid, texts[128], args.soak)) if args.soak and proc else []
    finally:
        if proc is not None:
            stop_server(proc)
    if not args.url:
        proc, url = start_server("--max-batch-requests=1", "--request-timeout=3600")
        try:
            cells.append(asyncio.run(http_cell(url, "http mbr=1", texts[128], 128, 32, args.requests, args.seconds)))
        finally:
            stop_server(proc)
        for n in lengths:
            cells.append(asyncio.run(engine_cell(texts[n], n, 32, args.requests, args.seconds, flags)))
    print(table(cells))
    ratio = {}
    for n in lengths:
        http32 = next((c for c in cells if c.label == "http" and c.tokens == n and c.concurrency == 32), None)
        inproc = next((c for c in cells if c.label == "in-process" and c.tokens == n), None)
        if http32 and inproc:
            ratio[n] = http32.throughput / inproc.throughput
            print(f"{n} tokens: HTTP at concurrency 32 / in-process = {ratio[n]:.2f}")
    single = next((c for c in cells if c.label == "http mbr=1"), None)
    batched = next((c for c in cells if c.label == "http" and c.tokens == 128 and c.concurrency == 32), None)
    if single and batched:
        print(f"dynamic batching (128 tokens, c=32): {batched.throughput / single.throughput:.2f}x "
              f"max_batch_requests=1")
    print(f"errors: {sum(c.errors for c in cells)}")
    if soak_samples:
        rss = np.array([r for _, r in soak_samples]) / 1024
        half = len(rss) // 2
        print(f"soak RSS MiB: start {rss[0]:.0f}, max {rss.max():.0f}, end {rss[-1]:.0f}, "
              f"second-half drift {rss[-1] - rss[half]:+.0f}")
    OUT.mkdir(exist_ok=True)
    plot(cells, soak_samples, OUT / "load.png")
    print(f"plot: {OUT / 'load.png'}  (machine: {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
