"""hashes="auto" over real HTTP: each input (each window, when chunked) runs exact below the crossover
and the model's count from it, by its own length; the oracle is the model called directly at that count."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from yoso_serve.model import load_pretrained
from yoso_serve.model.hashes import AUTO_EXACT_BELOW
from yoso_serve.service.cli import load_settings

SHORT, LONG = "the quick brown fox", "jumps over the lazy dog and keeps running far away"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_pretrained(tiny_dir)


def oracle(model, ids, hashes):
    """Pooled, unnormalised vector of one sequence of ids, alone, at ``hashes``."""
    t = torch.tensor([ids])
    with torch.inference_mode():
        return model.embed(t, torch.ones_like(t), hashes=hashes)[0].numpy()


def unit(x):
    return x / np.linalg.norm(x)


def test_auto_is_exact_below_the_crossover_by_each_inputs_own_length(tiny_dir, tiny, serve, metric):
    short_ids, long_ids = tiny.tokenizer.encode([SHORT, LONG])
    crossover = len(long_ids)  # SHORT is below it, LONG is at it (auto runs LSH from the crossover on)
    assert len(short_ids) < crossover

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, max_wait_ms=30, auto_exact_below=crossover) as c:
            out = {"mixed": await c.post("/embed", json={"inputs": [SHORT, LONG]}),
                   "asked_auto": await c.post("/embed", json={"inputs": [LONG, SHORT], "hashes": "auto"}),
                   "explicit": await c.post("/embed", json={"inputs": SHORT, "hashes": 8})}
            # one input per request, sent together: the batcher may only group inputs of one count
            out["crowd"] = await asyncio.gather(*(c.post("/embed", json={"inputs": t})
                                                  for t in [SHORT, LONG, SHORT, LONG, SHORT, LONG]))
            out["info"] = (await c.get("/info")).json()
            out["ran"] = {h: metric(c, "yoso_inputs_by_hashes_total", hashes=h) for h in ("0", "8")}
            out["metrics"] = (await c.get("/metrics")).text
            return out

    out = asyncio.run(main())
    short_exact, long_lsh = unit(oracle(tiny, short_ids, 0)), unit(oracle(tiny, long_ids, 8))
    assert out["mixed"].status_code == 200 and out["mixed"].headers["x-hashes"] == "0,8"
    np.testing.assert_allclose(out["mixed"].json(), [short_exact, long_lsh], atol=1e-5)
    assert out["asked_auto"].headers["x-hashes"] == "8,0"
    np.testing.assert_allclose(out["asked_auto"].json(), [long_lsh, short_exact], atol=1e-5)
    # an explicit count is honoured whatever the length
    assert out["explicit"].headers["x-hashes"] == "8"
    np.testing.assert_allclose(out["explicit"].json()[0], unit(oracle(tiny, short_ids, 8)), atol=1e-5)
    assert not np.allclose(short_exact, unit(oracle(tiny, short_ids, 8)), atol=1e-3)  # the counts differ for real
    for r, text in zip(out["crowd"], [SHORT, LONG] * 3):
        assert r.headers["x-hashes"] == ("0" if text == SHORT else "8")
        np.testing.assert_allclose(r.json()[0], short_exact if text == SHORT else long_lsh, atol=1e-5)
    info = out["info"]
    assert (info["hashes"], info["auto_exact_below"], info["default_hashes"]) == ("auto", crossover, 8)
    # warm-up (one short text) + mixed 1 + asked_auto 1 + crowd 3 run exact; explicit runs at 8 too, and so
    # does the admission's speed probe (the second warm-up batch, 512 tokens: above the crossover)
    assert out["ran"] == {"0": 6.0, "8": 7.0}
    assert 'hashes_policy="auto"' in out["metrics"] and f'auto_exact_below="{crossover}"' in out["metrics"]


def test_a_fixed_server_count_still_lets_a_request_ask_for_auto(tiny_dir, tiny, serve):
    short_ids = tiny.tokenizer.encode([SHORT])[0]

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, hashes=8, auto_exact_below=32) as c:
            return (await c.post("/embed", json={"inputs": SHORT}),
                    await c.post("/embed", json={"inputs": SHORT, "hashes": "auto"}), (await c.get("/info")).json())

    default, auto, info = asyncio.run(main())
    assert default.headers["x-hashes"] == "8" and auto.headers["x-hashes"] == "0"
    np.testing.assert_allclose(auto.json()[0], unit(oracle(tiny, short_ids, 0)), atol=1e-5)
    assert info["hashes"] == 8 and info["default_hashes"] == 8


def test_a_chunked_documents_windows_resolve_one_by_one(tiny_dir, tiny, serve):
    tok = tiny.tokenizer
    doc = " ".join(["hello"] * 66)
    ids = tok.encode([doc], add_special_tokens=False)[0]
    assert len(ids) == 66  # windows of 62 sharing 16: [0, 62) with 64 tokens, [46, 66) with 22

    async def main():
        async with serve(tiny_dir, chunk_overlap=16, auto_exact_below=30) as c:
            return await c.post("/embed", json={"inputs": [SHORT, doc], "long_input": "chunk"})

    r = asyncio.run(main())
    assert r.status_code == 200 and r.headers["x-hashes"] == "0,8+0"
    want = (62 * oracle(tiny, tok.wrap(ids[0:62]), 8) + 4 * oracle(tiny, tok.wrap(ids[46:66]), 0)) / 66
    np.testing.assert_allclose(r.json()[1], unit(want), atol=1e-5)


@pytest.mark.parametrize("hashes", [True, "fast", 2.5])
def test_a_hash_count_that_is_neither_an_int_nor_auto_is_a_422(tiny_dir, serve, hashes):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16) as c:
            return await c.post("/embed", json={"inputs": SHORT, "hashes": hashes})

    r = asyncio.run(main())
    assert r.status_code == 422
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "hashes", error
    assert "Traceback" not in r.text


def test_auto_and_its_crossover_are_settings(monkeypatch, capsys):
    s = load_settings([])
    assert s.hashes == "auto" and s.auto_exact_below == AUTO_EXACT_BELOW
    monkeypatch.setenv("YOSO_AUTO_EXACT_BELOW", "100")
    monkeypatch.setenv("YOSO_HASHES", "32")
    s = load_settings([])
    assert s.auto_exact_below == 100 and s.hashes == 32
    assert load_settings(["--hashes", "auto", "--auto-exact-below", "0"]).hashes == "auto"
    with pytest.raises(SystemExit) as info:
        load_settings(["--auto-exact-below", "-5"])
    assert info.value.code == 2 and "--auto-exact-below / YOSO_AUTO_EXACT_BELOW" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(["--hashes", "fast"])
    assert "--hashes / YOSO_HASHES" in capsys.readouterr().err
