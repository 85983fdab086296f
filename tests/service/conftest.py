"""Shared fixtures: tiny random models saved with save_pretrained (fast), the real default model,
and an in-process client that runs the app's lifespan (httpx.ASGITransport does not)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer, default_model_dir, save_pretrained
from yoso_serve.model.default import minilm_dir
from yoso_serve.service import ServeSettings, create_app

TINY_MAX = 64  # max_position_embeddings of the tiny models: a 3x-max document stays cheap


def _tiny(path: Path, *, labels: dict[int, str] | None = None) -> Path:
    torch.manual_seed(0)
    tokenizer = TextTokenizer.from_dir(minilm_dir())
    config = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, max_position_embeddings=TINY_MAX,
                           type_vocab_size=2, pad_token_id=tokenizer.pad_id, use_expectation=False,
                           num_hash=8, hash_code_len=4, hash_seed=7, id2label=labels)
    model = EncoderModel(config, with_classifier=labels is not None, tokenizer=tokenizer).eval()
    return save_pretrained(model, path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("tiny-cls"), labels={0: "negative", 1: "neutral", 2: "positive"})


@pytest.fixture(scope="session")
def default_dir() -> Path:
    return default_model_dir()


@asynccontextmanager
async def serving(model_dir: Path, *, wait_ready: bool = True, load_model=None, **overrides):
    """An app on ``model_dir`` with its lifespan running, and an httpx client talking to it in-process.

    The runtime is torch unless a test asks for another: these tests check the service against torch
    oracles whatever the default runtime (tests/onnx covers the others). For the same reason auto's
    exact switch is off unless asked for (auto_exact_below=0: auto runs the model's count on every
    input, what these oracles compute); tests/service/test_auto_hashes.py covers the switch. The dense
    layers run fp32 (the oracles' precision) unless a test asks for bf16 (tests/service/test_dense_dtype.py)."""
    settings = ServeSettings(model=model_dir, **{"runtime": "torch", "auto_exact_below": 0, "dense_dtype": "fp32",
                                                 **overrides})
    app = create_app(settings, load_model=load_model, model_name="test-model" if load_model else None)
    async with app.router.lifespan_context(app):
        if wait_ready:
            await app.state.startup
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            client.app = app
            yield client


def _metric(client, name: str, **labels) -> float:
    """Current value of one sample in the app's own registry (0 when absent)."""
    value = client.app.state.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


# Test modules cannot import this file (pytest's importlib mode), so helpers travel as fixtures.
# Tests are plain functions that drive one event loop each with asyncio.run (no async plugin).
@pytest.fixture
def serve():
    return serving


@pytest.fixture
def metric():
    return _metric


class ServerKit:
    """Real ``yoso-serve`` processes (the console script, under uvicorn) on 127.0.0.1."""

    script = Path(sys.executable).parent / "yoso-serve"

    @staticmethod
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def start(self, *flags: str, cache: Path | None = None) -> tuple[subprocess.Popen, str]:
        """The default model on the default runtime unless ``flags`` say otherwise; ``cache``, if given,
        as YOSO_CACHE_DIR. Returns once /ready answers 200."""
        port = self.free_port()
        env = {**os.environ, "YOSO_CACHE_DIR": str(cache)} if cache is not None else None
        proc = subprocess.Popen([str(self.script), "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                 "warning", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"yoso-serve exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        proc.kill()
        raise RuntimeError("yoso-serve did not become ready in 180 s")

    @staticmethod
    def stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="session")
def yoso_server() -> ServerKit:
    return ServerKit()
