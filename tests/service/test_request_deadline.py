"""A request's deadline bounds its wait to start, not the run of its own inputs: one request of 64 long
documents into an idle server takes far longer than ``--request-timeout`` to compute, and must get 200 on
every runtime, never a 504 for the queue positions of its own inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

WORDS = ("a long document about hashing attention that a client indexes in one request while nothing "
         "else is queued and every one of its inputs must come back ").split()
DOCS = [" ".join(WORDS * (30 + 5 * (i % 8))) for i in range(64)]  # about 700 to 1,400 tokens each


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YOSO_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("runtime", ["torch", "hybrid"])
def test_one_request_of_64_long_documents_into_an_idle_server_is_served(serve, default_dir, cache, runtime):
    async def main():
        async with serve(default_dir, runtime=runtime, request_timeout=1.0) as c:
            r = await c.post("/embed", json={"inputs": DOCS})
            return r, float(r.headers.get("x-inference-time", 0))

    r, inference_ms = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert inference_ms > 1000  # the work really outlasted the deadline
    vectors = np.array(r.json())
    assert vectors.shape == (64, 384) and np.isfinite(vectors).all()
