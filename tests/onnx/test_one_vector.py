"""One text, one vector, whatever serves it: the bundled model at the deployment defaults (``--hashes auto``
with the measured crossover, ``--dense-dtype auto``) on torch and on hybrid resolves every input to the same
hash count and agrees to cosine 0.999 on short and long texts; on a GPU, CUDA fp16 agrees with the CPU too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from yoso_serve.model import default_model_dir
from yoso_serve.model.hashes import AUTO_EXACT_BELOW

WORDS = ("an index built by one replica and queried through another must find the same neighbours so every "
         "runtime resolves a text to the same hash count and the same vector ").split()
SHORT = ["What is YOSO attention?", "two sentences about hashing. They are short.", " ".join(WORDS * 3)]
LONG = [" ".join(WORDS * n) for n in (20, 60, 150)]  # about 0.5k, 1.6k and 4k tokens


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("YOSO_CACHE_DIR", str(tmp_path / "cache"))


def _served(serve, **settings) -> dict:
    async def main():
        defaults = {"auto_exact_below": AUTO_EXACT_BELOW, "dense_dtype": "auto", **settings}
        async with serve(default_model_dir(), **defaults) as c:
            info = (await c.get("/info")).json()
            out = {"info": info}
            for name, texts in (("short", SHORT), ("long", LONG)):
                r = await c.post("/embed", json={"inputs": texts})
                assert r.status_code == 200, r.text
                out[name] = (np.array(r.json()), r.headers["x-hashes"])
            return out

    return asyncio.run(main())


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def _agree(x: dict, y: dict, long_floor: float = 0.999) -> None:
    for name, floor in (("short", 0.999), ("long", long_floor)):
        (a, ha), (b, hb) = x[name], y[name]
        assert ha == hb, f"{name}: x-hashes {ha} vs {hb}: the runtime changed what auto ran"
        cos = _cosines(a, b)
        assert cos.min() >= floor, f"{name}: cosine {cos.round(5)}"


def test_torch_and_hybrid_resolve_auto_alike_and_agree(serve, cache):
    runs = {dense: _served(serve, runtime="torch", dense_dtype=dense) for dense in ("fp32", "auto")}
    hybrid = _served(serve, runtime="hybrid")
    for run in (*runs.values(), hybrid):
        assert run["info"]["auto_exact_below"] == AUTO_EXACT_BELOW
        assert run["short"][1] == "0"  # every short text under the crossover: exact
        assert run["long"][1] == str(run["info"]["default_hashes"])  # every long one: the model's count
    assert hybrid["info"]["runtime"] == "hybrid"
    _agree(runs["fp32"], hybrid)  # the same precision: only the runtime differs
    # torch's default dense layers are bf16 where the CPU has it; ONNX Runtime runs fp32. A bf16 rounding
    # moves a few LSH codes of a long text, so there the two precisions agree to 0.998 (docs/api.md)
    _agree(runs["auto"], hybrid, long_floor=0.998)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_fp16_agrees_with_the_cpu(serve):
    _agree(_served(serve, runtime="torch", device="cpu", dense_dtype="fp32"),
           _served(serve, runtime="torch", device="cuda", dtype="auto"))
