"""A real ``yoso-serve`` process (the console script, default model) on 127.0.0.1: the docs' curl
examples, the metrics port, and a SIGTERM drain that loses no accepted request."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory, yoso_server):
    """What `make serve` runs: no flags but the address, so the runtime is the default (auto), with a
    private YOSO_CACHE_DIR to show that it writes nothing there."""
    metrics_port = yoso_server.free_port()
    cache = tmp_path_factory.mktemp("yoso-cache")
    proc, url = yoso_server.start("--metrics-port", str(metrics_port), cache=cache)
    yield url, metrics_port, cache
    yoso_server.stop(proc)


def curl_examples() -> list[tuple[str, object]]:
    """Every curl command in the README's and docs/api.md's bash blocks, continuation lines joined, with
    the output the doc shows for it: the parsed ```json block that comes right after its bash block
    (nothing but blank lines between), else None. Such a block must be complete JSON and its bash block
    hold one curl; an abbreviated output ("...") is fenced as text, so it is not compared.

    The README's deployment examples name other hosts or images and are not replayed."""
    text = (ROOT / "README.md").read_text().split("## Deploy on a GPU node")[0] + (ROOT / "docs" / "api.md").read_text()
    blocks = list(re.finditer(r"```(\w*)\n(.*?)```", text, flags=re.S))
    examples = []
    for i, block in enumerate(blocks):
        if block.group(1) != "bash":
            continue
        commands = [line.strip() for line in block.group(2).replace("\\\n", " ").splitlines()
                    if line.strip().startswith("curl")]
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        expected = None
        if after is not None and after.group(1) == "json" and not text[block.end():after.start()].strip():
            assert len(commands) == 1, f"a json block follows a bash block of {len(commands)} curl commands"
            try:
                expected = json.loads(after.group(2))
            except json.JSONDecodeError as err:
                raise AssertionError(f"the output shown for {commands[0]} is not JSON ({err}); fence an "
                                     "abbreviated one as text") from None
        examples.extend((command, expected) for command in commands)
    return examples


def assert_matches(actual, expected, where: str = "$") -> None:
    """``actual`` has ``expected``'s structure, keys, strings and list order, and its numbers within
    0.01 (the docs round them)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (where, actual, expected)
        for key in expected:
            assert_matches(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (where, actual, expected)
        for k, (a, e) in enumerate(zip(actual, expected)):
            assert_matches(a, e, f"{where}[{k}]")
    elif isinstance(expected, (int, float)) and not isinstance(expected, bool):
        assert isinstance(actual, (int, float)) and not isinstance(actual, bool), (where, actual, expected)
        assert abs(actual - expected) <= 0.01 + 1e-9, f"{where}: the doc shows {expected}, the server returned {actual}"
    else:
        assert actual == expected and type(actual) is type(expected), (where, actual, expected)


def run_example(command: str, base: str) -> tuple[int, str]:
    """Run one example against ``base`` with curl, or replay it with httpx where curl is missing."""
    args = shlex.split(command.replace("localhost:8080", base.removeprefix("http://")))
    if shutil.which("curl"):
        out = subprocess.run([*args, "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=120).stdout
        body, _, status = out.rpartition("\n")
        return int(status), body
    url = "http://" + next(a for a in args[1:] if a.startswith(base.removeprefix("http://")))
    headers = dict(h.split(": ", 1) for h in (args[i + 1] for i, a in enumerate(args) if a == "-H"))
    data = next((args[i + 1] for i, a in enumerate(args) if a == "-d"), None)
    r = httpx.request("POST" if data else "GET", url, headers=headers, content=data, timeout=120)
    return r.status_code, r.text


def test_docs_curl_examples_work_as_written(server):
    url, _, cache = server
    examples = curl_examples()
    assert len(examples) >= 13
    assert sum(expected is not None for _, expected in examples) >= 5
    info = httpx.get(f"{url}/info", timeout=10).json()
    hidden = info["config"]["hidden_size"]
    # the default runtime (auto) is torch on CPU and on CUDA, and exports nothing
    assert info["runtime"] == "torch" and info["runtime_reason"].startswith(f"auto on {info['device']}: torch"), info
    assert list(cache.iterdir()) == []
    seen = set()
    for command, expected in examples:
        status, body = run_example(command, url)
        assert status == 200, (command, body)
        route = re.search(r"localhost:8080(/[\w/]*)", command).group(1)
        seen.add(route)
        if route == "/metrics":
            assert "yoso_model_info" in body
            continue
        data = json.loads(body)
        if expected is not None:  # what the doc shows right after the command
            assert_matches(data, expected, f"{command}\n$")
        if route == "/embed" and isinstance(data, list) and len(data) == 2:
            vectors = np.array(data)
            assert vectors.shape == (2, hidden)
            np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
        if route == "/v1/embeddings":
            assert len(data["data"][0]["embedding"]) == 128 and data["model"] == "yoso"
        if route == "/classify":  # zero-shot: a distribution over exactly the labels sent, best first
            assert {s["label"] for s in data[0]} == {"hardware problem", "billing", "praise"}
            scores = [s["score"] for s in data[0]]
            assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) < 1e-5
        if route == "/":  # TEI's root on an embedding model: /embed
            assert np.array(data).shape == (1, hidden)
        if route == "/similarity":
            assert len(data) == 2 and data[0] > data[1]
        if route == "/rerank" and "piece_tokens" in command:  # each text by its best 16-token piece, named
            assert [r["index"] for r in data] == [0, 1] and all(set(r["piece"]) == {"tokens", "chars"} for r in data)
            assert all(0 < r["piece"]["tokens"][1] - r["piece"]["tokens"][0] <= 16 for r in data)
        elif route == "/rerank":
            assert [r["index"] for r in data] == [1, 0] and data[0]["text"].startswith("YOSO")
        if route == "/decode":
            assert data == ["hello"]
    assert seen >= {"/embed", "/embed_all", "/v1/embeddings", "/classify", "/tokenize", "/info", "/health",
                    "/ready", "/metrics", "/", "/similarity", "/rerank", "/decode"}


def test_help_names_the_default_of_every_unset_setting():
    from yoso_serve.service.cli import NONE_DEFAULTS, build_parser
    from yoso_serve.service.settings import ServeSettings

    unset = {name for name, field in ServeSettings.model_fields.items() if field.default is None}
    assert unset == set(NONE_DEFAULTS)
    text = " ".join(build_parser().format_help().split())
    assert "default model's" not in text
    assert "[env YOSO_THREADS; default torch's choice]" in text
    assert "[env YOSO_MAX_PADDING_TOKENS; default 64 on CPU, 2048 on CUDA]" in text


def test_metrics_port_serves_the_same_registry(server):
    url, metrics_port, _ = server
    httpx.post(f"{url}/embed", json={"inputs": "count me"}, timeout=60)
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'yoso_requests_total{route="/embed",status="200"}' in text
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert f'backend="{info["backend"]["backend"]}"' in text and f'runtime="{info["runtime"]}"' in text


def test_sigterm_drains_accepted_requests_refuses_new_ones_and_exits_0(yoso_server):
    proc, url = yoso_server.start("--max-batch-requests", "2", "--drain-timeout", "60")
    doc = " ".join(f"paragraph {i} of a long report about hashing attention" for i in range(60))

    def in_flight() -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return float(re.search(r"^yoso_in_flight_requests (\S+)$", text, flags=re.M).group(1))

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            accepted = [asyncio.create_task(client.post(f"{url}/embed", json={"inputs": f"{i} {doc}"}))
                        for i in range(6)]
            deadline, seen = time.monotonic() + 60, in_flight()
            while seen < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                seen = in_flight()
            assert seen == 6  # the scrape that saw all six: a second one may find the first batch done
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:
                async with httpx.AsyncClient(timeout=10) as fresh:
                    late = (await fresh.post(f"{url}/embed", json={"inputs": "too late"})).status_code
            except httpx.TransportError:
                late = "refused"
            return [r.status_code for r in await asyncio.gather(*accepted)], late

    try:
        statuses, late = asyncio.run(main())
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert statuses == [200] * 6
    assert late in ("refused", 503)
    assert code == 0, proc.stdout.read()


def test_bad_settings_exit_2_before_loading_anything(yoso_server):
    out = subprocess.run([str(yoso_server.script), "--runtime", "onnx"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "use --runtime torch" in out.stderr, out.stderr


def test_a_model_that_cannot_start_exits_1_with_the_reason(tiny_dir, yoso_server):
    port = yoso_server.free_port()
    out = subprocess.run([str(yoso_server.script), "--model", str(tiny_dir), "--host", "127.0.0.1", "--port", str(port),
                          "--chunk-overlap", "100"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--chunk-overlap 100 must be below the window of 62 tokens" in out.stderr
    assert "Traceback" not in out.stderr  # a bad setting or model: one line says it all


class StallWatch:
    """A thread of the test's own process that sleeps 10 ms at a time and keeps the longest oversleep: when
    it passes half a second, this process was held up (by the machine, or by a thread of its own holding
    the interpreter), and a timing the client took across it does not measure the server, which runs in
    another process."""

    def __init__(self) -> None:
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(0.01)
            self.worst = max(self.worst, time.monotonic() - t0 - 0.01)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_overload_is_refused_at_once_with_429_not_left_to_504(yoso_server):
    # A 1 s deadline and 40 requests of ~500 tokens sent at once: several seconds of work on any
    # CPU. What cannot start within the deadline must be told so at once (429), not after it (504).
    text = " ".join(f"word{i % 50}" for i in range(250))

    async def one(client, url, i):
        t0 = time.monotonic()
        r = await client.post(f"{url}/embed", json={"inputs": f"{i} {text}"})
        return r, time.monotonic() - t0

    async def burst(url):
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as client:
            return await asyncio.gather(*(one(client, url, i) for i in range(40)))

    # Twice in this suite's logs, in full runs only, every 429 of the burst took 1.2-1.4 s; alone the test
    # has always passed. Whether the server or the test's own process was held up then is not known; the
    # watch tells them apart: a burst across which the test's own process was held up is sent again on a
    # fresh server, once. A stall of the server alone is not excused.
    for _ in range(2):
        proc, url = yoso_server.start("--request-timeout", "1")
        try:
            with StallWatch() as watch:
                results = asyncio.run(burst(url))
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
        finally:
            yoso_server.stop(proc)
        if watch.worst < 0.5:
            break
    assert watch.worst < 0.5, f"the test's own process stalled {watch.worst:.2f} s during both bursts"
    statuses = [r.status_code for r, _ in results]
    refused = [(r, seconds) for r, seconds in results if r.status_code == 429]
    assert set(statuses) <= {200, 429, 504} and 200 in statuses, statuses
    assert len(refused) >= 20, statuses
    assert sum(seconds < 1.0 for _, seconds in refused) >= 0.8 * len(refused), sorted(s for _, s in refused)
    assert all(r.json()["error"]["code"] == "predicted_wait" and int(r.headers["retry-after"]) >= 1
               for r, _ in refused)
    assert statuses.count(504) <= 4, statuses
    counted = re.search(r'^yoso_rejections_total\{reason="predicted_wait"\} (\S+)$', metrics, flags=re.M)
    assert float(counted.group(1)) == len(refused)


def _thread_nices(pid: int) -> dict[int, int]:
    """Each thread of process ``pid``: its nice value (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat[stat.rindex(")") + 2:].split()[16])
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread priorities are read from Linux's /proc")
def test_the_forward_runs_below_the_event_loop_and_its_openmp_team_with_it(yoso_server):
    """--forward-nice (10 by default): the batcher thread lowers its own priority before its first forward,
    so the OpenMP worker it starts inherits it; the event loop (the main thread) and everything else keep
    the process's priority. --forward-nice 0 leaves every thread there."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    for flags, lowered in ((), min(19, base + 10)), (("--forward-nice", "0"), base):
        proc, url = yoso_server.start("--threads", "2", *flags)
        try:
            r = httpx.post(f"{url}/embed", json={"inputs": ["a long input " * 300, "short"]}, timeout=60)
            assert r.status_code == 200, r.text
            nices = _thread_nices(proc.pid)
        finally:
            yoso_server.stop(proc)
        assert nices[proc.pid] == base, nices
        if lowered == base:
            assert set(nices.values()) == {base}, nices
        else:  # the batcher and its one OpenMP worker (2 threads), nothing else
            assert sorted(n for n in nices.values() if n != base) == [lowered, lowered], nices


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="a process's loaded libraries are read from Linux's /proc")
def test_the_server_parses_http_with_httptools(yoso_server):
    """uvicorn runs httptools' C parser (service/cli.py HTTP_PARSER), never a silent fall back to h11, which
    cost the event loop as much per refused request as the app itself."""
    proc, url = yoso_server.start()
    try:
        assert httpx.post(f"{url}/embed", json={"inputs": "parsed in C"}, timeout=60).status_code == 200
        libraries = Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        yoso_server.stop(proc)
    assert re.search(r"/httptools/parser/parser\.[^/\s]*\.so$", libraries, flags=re.M), "httptools is not loaded"
