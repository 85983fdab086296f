"""The overload scenario of bench/load.py (``--overload``): more clients than the server can serve
within its deadline, as issue 21 tried it.

Each client sends one or four texts of 8 to 1,500 words (a tenth of the requests malformed) over
its own keep-alive connection, closed-loop, and honours Retry-After after a 429 as a well-behaved
client does. One run is a fresh default server driven by ``--overload-clients`` (64) and another
fresh one by ``--baseline-clients`` (2: busy, but refusing nothing on 2 shared cores), each for
``--seconds``; requests in flight at the end are awaited so that every status is counted.
With ``--before-args`` each run also drives a server started with those flags (e.g. ``--forward-nice 0``,
the server as it was) the same way, side by side; ``--before-script`` starts that server from another
checkout's venv (the code as it was), with those flags if any. Reported: the share of 504 answers, the p99 latency of 429
answers (and of the 400/422 refusals of malformed bodies), the event loop's wait for a core (from the
server's /proc/<pid>/task/<tid>/schedstat: run-queue time per time slice of its main thread, the profile
that found the cause), and the accepted throughput:
tokens per second of 200 answers completed within the window, and the model's own tokens per second
over the window (only admitted inputs run), overload against baseline; and the padding (padded
tokens computed per real token), which a deeper queue of mixed lengths raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

# a tenth of the requests: bad JSON (400) and three kinds of invalid body (422)
MALFORMED = [b'{"inputs": ["an unfinished', b'{"inputs": []}', b'{"inputs": 5}',
             b'{"inputs": "fine text", "hashes": 100000}']
MIN_WORDS, MAX_WORDS = 8, 1500
DRAIN_S = 120.0  # after the window: the longest the scenario waits for requests in flight
# The opening burst: every client sends its first request at once, so the first ~64 bodies are read and parsed
# on the one event loop before the last of them is refused. Steady-state latencies leave these seconds out.
OPENING_S = 2.0


def make_bodies(words: list[str], n: int, seed: int) -> list[bytes]:
    """``n`` request bodies: 90 % one or four texts of MIN_WORDS..MAX_WORDS words, 10 % malformed."""
    rng = np.random.default_rng(seed)
    bodies = []
    for i in range(n):
        if i % 10 == 9:
            bodies.append(MALFORMED[(i // 10) % len(MALFORMED)])
            continue
        texts = [" ".join(rng.choice(words, rng.integers(MIN_WORDS, MAX_WORDS + 1)))
                 for _ in range(rng.choice([1, 4]))]
        bodies.append(json.dumps({"inputs": texts}).encode())
    return bodies


@dataclass
class Answer:
    sent: float  # seconds since the start of the window
    seconds: float
    status: int  # 0: the connection broke
    tokens: int  # x-compute-tokens of a 200


@dataclass
class Scenario:
    label: str
    clients: int
    window: float
    answers: list[Answer] = field(default_factory=list)
    loop_wait_ms: float = float("nan")  # the event loop thread's run-queue wait per time slice over the window
    loop_wait_share: float = float("nan")  # ... as a share of the window
    server_tokens: float = 0.0  # yoso_tokens_processed_total over the window: work the model did
    padded_tokens: float = 0.0  # yoso_batch_tokens_sum over the window: what that work cost

    @property
    def server_tokens_per_s(self) -> float:
        return self.server_tokens / self.window

    def count(self, *statuses: int) -> int:
        return sum(a.status in statuses for a in self.answers)

    def share(self, *statuses: int) -> float:
        return self.count(*statuses) / max(1, len(self.answers))

    def latency_ms(self, status: int | tuple[int, ...], q: float, after: float = 0.0) -> float:
        """The ``q``-th percentile latency of answers of ``status`` sent ``after`` seconds into the window or later."""
        statuses = status if isinstance(status, tuple) else (status,)
        xs = [a.seconds for a in self.answers if a.status in statuses and a.sent >= after]
        return float(np.percentile(xs, q)) * 1000 if xs else float("nan")

    def accepted(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200 and a.sent + a.seconds <= self.window]

    @property
    def accepted_tokens_per_s(self) -> float:
        return sum(a.tokens for a in self.accepted()) / self.window

    @property
    def accepted_per_s(self) -> float:
        return len(self.accepted()) / self.window


async def _exchange(conn, host: str, port: int, body: bytes):
    """One POST /embed on ``conn`` (opened if None): (conn, status, headers)."""
    reader, writer = conn or await asyncio.open_connection(host, port)
    writer.write(f"POST /embed HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    await reader.readexactly(int(headers["content-length"]))
    return (reader, writer), int(lines[0].split()[1]), headers


_BROKEN = (OSError, ValueError, KeyError, IndexError, asyncio.IncompleteReadError, asyncio.LimitOverrunError)


async def _send(conn, host: str, port: int, body: bytes):
    """_exchange, once more on a fresh connection when a kept-alive one fails: the server closes
    connections idle for 5 s, and a client that honoured a Retry-After finds its own closed."""
    if conn is not None:
        try:
            return await _exchange(conn, host, port, body)
        except _BROKEN:
            conn[1].close()
    return await _exchange(None, host, port, body)


def schedstat(pid: int) -> tuple[int, int, int] | None:
    """The main thread of ``pid`` (the event loop): (ns on a CPU, ns waiting on a run queue, time slices),
    from Linux's /proc (None elsewhere)."""
    try:
        run_ns, wait_ns, slices = (int(x) for x in open(f"/proc/{pid}/task/{pid}/schedstat").read().split())
    except (OSError, ValueError):
        return None
    return run_ns, wait_ns, slices


async def drive(url: str, label: str, bodies: list[bytes], clients: int, seconds: float,
                pid: int | None = None) -> Scenario:
    parsed = httpx.URL(url)
    host, port = parsed.host, parsed.port
    result = Scenario(label, clients, seconds)
    start = time.perf_counter()
    stop_at = start + seconds

    async def client(i: int) -> None:
        conn, k = None, i
        while time.perf_counter() < stop_at:
            body, k = bodies[k % len(bodies)], k + clients
            t0 = time.perf_counter()
            try:
                conn, status, headers = await _send(conn, host, port, body)
            except _BROKEN:
                conn, status, headers = None, 0, {}
            t1 = time.perf_counter()
            result.answers.append(Answer(t0 - start, t1 - t0, status, int(headers.get("x-compute-tokens", 0))))
            if status == 429:
                retry = float(headers.get("retry-after", 0))
                await asyncio.sleep(min(retry, max(0.0, stop_at - time.perf_counter())))
        if conn is not None:
            conn[1].close()

    async def tokens_over_window() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            before = _sample((await http.get(f"{url}/metrics")).text)
            sched0 = schedstat(pid) if pid else None
            await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
            sched1 = schedstat(pid) if pid else None
            after = _sample((await http.get(f"{url}/metrics")).text)
        result.server_tokens, result.padded_tokens = (a - b for a, b in zip(after, before))
        if sched0 and sched1:
            _, wait_ns, slices = (b - a for a, b in zip(sched0, sched1))
            result.loop_wait_ms = wait_ns / 1e6 / max(slices, 1)
            result.loop_wait_share = wait_ns / 1e9 / seconds

    await asyncio.wait_for(asyncio.gather(tokens_over_window(), *(client(i) for i in range(clients))),
                           seconds + DRAIN_S)
    return result


def _sample(metrics: str) -> tuple[float, float]:
    """(real tokens the model ran, padded tokens its batches cost). Only admitted inputs run, so the
    first is the accepted work, counted as it is done."""
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("yoso_tokens_processed_total ", "yoso_batch_tokens_sum "))}
    return values["yoso_tokens_processed_total"], values["yoso_batch_tokens_sum"]


def table(rows: list[Scenario]) -> str:
    out = ["| scenario | clients | requests | 200 | 429 | 504 | 400/422 | other | 504 share | 429 p50 ms "
           "| 429 p99 ms | 429 p99 ms after 2 s | 400/422 p99 ms | loop wait ms/slice | 200 p50 ms | 200 p99 ms | accepted req/s | accepted tokens/s "
           "| model tokens/s | padding |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        rest = Counter(a.status for a in s.answers if a.status not in (200, 429, 504, 400, 422))
        other = ", ".join(f"{n}x {'no answer' if code == 0 else code}" for code, n in sorted(rest.items())) or "0"
        out.append(f"| {s.label} | {s.clients} | {len(s.answers)} | {s.count(200)} | {s.count(429)} | {s.count(504)} "
                   f"| {s.count(400, 422)} | {other} | {100 * s.share(504):.1f} % | {s.latency_ms(429, 50):.0f} "
                   f"| {s.latency_ms(429, 99):.0f} | {s.latency_ms(429, 99, OPENING_S):.0f} | {s.latency_ms((400, 422), 99):.0f} | {s.loop_wait_ms:.2f} "
                   f"| {s.latency_ms(200, 50):.0f} | {s.latency_ms(200, 99):.0f} "
                   f"| {s.accepted_per_s:.2f} | {s.accepted_tokens_per_s:.0f} | {s.server_tokens_per_s:.0f} "
                   f"| {s.padded_tokens / max(s.server_tokens, 1):.2f} |")
    return "\n".join(out)


def plot(rows: list[Scenario], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = {s.label: s for s in rows}  # the last run of each scenario
    fig, axes = plt.subplots(1, len(last), figsize=(6 * len(last), 4), squeeze=False)
    colors = {200: "tab:green", 429: "tab:orange", 504: "tab:red", 400: "tab:gray", 422: "tab:gray"}
    for ax, s in zip(axes[0], last.values()):
        for status, color in colors.items():
            pts = [(a.sent, a.seconds) for a in s.answers if a.status == status]
            if pts:
                ax.scatter(*zip(*pts), s=6, color=color, label=str(status))
        ax.set(title=f"{s.label}: {s.clients} clients", xlabel="sent at (s)", ylabel="latency (s)", yscale="log")
        ax.legend(markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(words: list[str], start_server, stop_server, *, runs: int, seconds: float, overload_clients: int,
        baseline_clients: int, out_path, before_args: list[str] | None = None, start_before=None) -> None:
    bodies = make_bodies(words, 512, seed=21)
    scenarios = [("baseline", baseline_clients, [], start_server), ("overload", overload_clients, [], start_server)]
    if before_args or start_before:  # the server as it was, driven the same way in the same run
        scenarios.append(("overload, before", overload_clients, before_args or [], start_before or start_server))
    rows: list[Scenario] = []
    for i in range(runs):
        # the two overload servers swap places every other run, so that neither always follows the baseline
        order = scenarios if i % 2 == 0 or len(scenarios) < 3 else [scenarios[0], scenarios[2], scenarios[1]]
        for label, clients, flags, start in order:
            proc, url = start(*flags)  # a fresh server: its estimate starts from the warm-up
            try:
                rows.append(asyncio.run(drive(url, label, bodies, clients, seconds, proc.pid)))
            finally:
                stop_server(proc)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    by = {label: [r for r in rows if r.label == label] for label, *_ in scenarios}
    for label in by:
        if label == "baseline":
            continue
        over = by[label]
        ratios = [o.server_tokens_per_s / b.server_tokens_per_s for b, o in zip(by["baseline"], over)]
        print(f"{label}, median of {len(over)} runs: 504 share {100 * np.median([o.share(504) for o in over]):.1f} % "
              f"(target < 5 %), 429 p99 {np.median([o.latency_ms(429, 99) for o in over]):.0f} ms, after the opening "
              f"{OPENING_S:g} s {np.median([o.latency_ms(429, 99, OPENING_S) for o in over]):.0f} ms (target < 100), "
              f"400/422 p99 {np.median([o.latency_ms((400, 422), 99) for o in over]):.0f} ms, event loop wait "
              f"{np.median([o.loop_wait_ms for o in over]):.2f} ms per slice "
              f"({100 * np.median([o.loop_wait_share for o in over]):.1f} % of the window), accepted req/s "
              f"{np.median([o.accepted_per_s for o in over]):.2f}, model tokens/s vs baseline {np.median(ratios):.2f} "
              f"(target >= 0.95; per run {', '.join(f'{r:.2f}' for r in ratios)})")
    if "overload, before" in by:
        now, before = by["overload"], by["overload, before"]
        print(f"accepted req/s, now / before (per run): "
              f"{', '.join(f'{n.accepted_per_s / max(b.accepted_per_s, 1e-9):.2f}' for n, b in zip(now, before))}; "
              f"median {np.median([n.accepted_per_s / max(b.accepted_per_s, 1e-9) for n, b in zip(now, before)]):.2f}")
        model = [n.server_tokens_per_s / max(b.server_tokens_per_s, 1e-9) for n, b in zip(now, before)]
        print(f"model tokens/s, now / before (per run): {', '.join(f'{r:.2f}' for r in model)}; "
              f"median {np.median(model):.2f}")
    plot(rows, out_path)
    print(f"plot: {out_path}")
