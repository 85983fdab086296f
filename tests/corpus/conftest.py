"""Fixtures of the bulk job's tests: a tiny saved model (64 positions, so chunking is cheap to reach), corpora
written to disk, the parts read back, a server in-process to compare with, and processes to kill."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer, save_pretrained
from yoso_serve.model.default import minilm_dir
from yoso_serve.service import ServeSettings, create_app

TINY_MAX = 64
WORDS = ("attention hashing linear cost encoder document corpus query vector piece window token batch "
         "server engine parquet manifest resume kill worker ray cluster model bundled").split()
EMBED = [str(Path(sys.executable).parent / "yoso-embed")]
# The settings both sides of a comparison run with: torch, fp32 dense layers (whatever this CPU has), and an
# exact crossover inside the tiny model's length, so that one corpus runs exact and LSH windows.
TINY_SETTINGS = {"runtime": "torch", "dense_dtype": "fp32", "auto_exact_below": 40, "chunk_overlap": 16}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    tokenizer = TextTokenizer.from_dir(minilm_dir())
    config = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=TINY_MAX,
                           type_vocab_size=2, pad_token_id=tokenizer.pad_id, use_expectation=False,
                           num_hash=8, hash_code_len=4, hash_seed=7)
    model = EncoderModel(config, tokenizer=tokenizer).eval()
    return save_pretrained(model, tmp_path_factory.mktemp("tiny-model"))


def texts(n: int, *, seed: int = 0, low: int = 3, high: int = 150) -> list[str]:
    """``n`` texts of ``low``-``high`` words (about as many tokens): past 64 tokens the tiny model chunks them."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows as lines: a dict is dumped as JSON, bytes are written as they are (bad lines)."""
    with open(path, "wb") as f:
        for row in rows:
            f.write((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n")
    return path


def read_output(out: Path) -> dict[str, dict]:
    """Every row of ``out``'s parts by id; fails on an id written twice."""
    import pyarrow.parquet as pq

    rows: dict[str, dict] = {}
    for part in sorted((out / "parts").glob("part-*.parquet")):
        for row in pq.read_table(part).to_pylist():
            assert row["id"] not in rows, f"id {row['id']!r} written twice"
            rows[row["id"]] = row
    return rows


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def same_bits(a, b) -> bool:
    a, b = f32(a), f32(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@asynccontextmanager
async def _serving(model_dir: Path | None, settings: dict):
    app = create_app(ServeSettings(model=model_dir, **settings))
    async with app.router.lifespan_context(app):
        await app.state.startup
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            yield client


def server_answers(model_dir: Path | None, settings: dict, route: str, bodies: list[dict]) -> list[httpx.Response]:
    """What a server on ``model_dir`` with ``settings`` answers to each body on ``route``, in-process."""

    async def run():
        async with _serving(model_dir, settings) as client:
            return [await client.post(route, json=body) for body in bodies]

    return asyncio.run(run())


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``: a job and all it started (Ray puts its workers in process
    groups of their own, but in the driver's session), as a crash of the machine would."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ValueError):
                continue


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_embed(*args: str) -> subprocess.Popen:
    """``yoso-embed ARGS`` in a session of its own (so the test can kill it with all it started)."""
    return subprocess.Popen([*EMBED, *args, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_parts(out: Path, proc: subprocess.Popen, at_least: int, timeout: float = 180) -> int:
    """Poll until ``out`` has ``at_least`` parts; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = len(list((out / "parts").glob("part-*.parquet"))) if (out / "parts").is_dir() else 0
        if n >= at_least:
            return n
        assert proc.poll() is None, f"the job ended before {at_least} parts: {proc.communicate()}"
        time.sleep(0.02)
    raise AssertionError(f"no {at_least} parts in {timeout} s")


@pytest.fixture
def corpus_kit():
    """The helpers above, for test modules (conftests cannot be imported under --import-mode=importlib)."""

    class Kit:
        pass

    kit = Kit()
    for name, fn in [("texts", texts), ("write_jsonl", write_jsonl), ("read_output", read_output), ("f32", f32),
                     ("same_bits", same_bits), ("manifest", manifest), ("server_answers", server_answers),
                     ("descendants", descendants), ("cmdline", cmdline), ("kill_session", kill_session), ("start_embed", start_embed),
                     ("wait_for_parts", wait_for_parts)]:
        setattr(kit, name, staticmethod(fn))
    kit.TINY_SETTINGS = TINY_SETTINGS
    kit.EMBED = EMBED
    return kit
