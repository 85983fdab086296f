"""--dense-dtype: the served model's CPU GEMMs in bf16 (or fp32), what auto picks, and that a bf16 server
gives what the model gives directly in bf16, near fp32, and the same bits for a text alone or in a batch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from yoso_serve.model import linear, load_pretrained
from yoso_serve.service import ServeSettings
from yoso_serve.service.cli import load_settings

SHORT, LONG = "the quick brown fox", "jumps over the lazy dog and keeps running far away from the river bank"

needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no oneDNN bf16 GEMM (no AVX-512)")


def direct(model_dir, text: str, dense: str) -> np.ndarray:
    model = load_pretrained(model_dir)
    linear.set_dense_dtype(model, dense)
    ids = torch.tensor(model.tokenizer.encode([text]))
    with torch.inference_mode():
        return torch.nn.functional.normalize(model.embed(ids, torch.ones_like(ids)), dim=-1)[0].numpy()


@needs_bf16
def test_bf16_server_serves_the_bf16_model_and_stays_near_fp32(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, dense_dtype="bf16") as c:
            both = await c.post("/embed", json={"inputs": [SHORT, LONG]})
            alone = [await c.post("/embed", json={"inputs": t}) for t in (SHORT, LONG)]
            crowd = await asyncio.gather(*(c.post("/embed", json={"inputs": t}) for t in [SHORT, LONG] * 3))
            exact = [await c.post("/embed", json={"inputs": t, "hashes": 0}) for t in ([SHORT, LONG], SHORT)]
            return (await c.get("/info")).json(), both, alone, crowd, exact

    info, both, alone, crowd, exact = asyncio.run(main())
    assert np.array_equal(np.array(exact[0].json()[0]), np.array(exact[1].json()[0]))  # exact mode too
    assert info["backend"]["dense"] == "bf16"
    served = np.array(both.json())
    for row, text, one in zip(served, [SHORT, LONG], alone):
        np.testing.assert_allclose(row, direct(tiny_dir, text, "bf16"), rtol=0, atol=1e-6)
        assert np.array_equal(row, np.array(one.json()[0]))  # padded beside a longer text or alone: same bits
        fp32 = direct(tiny_dir, text, "fp32")
        assert float(row @ fp32) > 0.999 and not np.allclose(row, fp32, atol=1e-7)
    for r, text in zip(crowd, [SHORT, LONG] * 3):
        assert np.array_equal(np.array(r.json()[0]), served[[SHORT, LONG].index(text)])


@needs_bf16
def test_bf16_default_model_gives_a_text_the_same_bits_in_a_batch_of_any_size(default_dir, serve):
    """The bundled model's FFN output layer multiplies over K 1536, where AMX's bf16 GEMM rounds a row by how
    many rows share the call: a batch of 2, 8 or 24 texts (up to 300 rows) must still give each text what it
    gets alone, sampled and exact."""
    texts = [SHORT, LONG, "stock prices fell sharply today", "a cat sleeps on the sofa"]

    async def main():
        async with serve(default_dir, dense_dtype="bf16") as c:
            out = {}
            for hashes in (32, 0):
                alone = [(await c.post("/embed", json={"inputs": t, "hashes": hashes})).json()[0] for t in texts]
                batches = [(await c.post("/embed", json={"inputs": inputs, "hashes": hashes})).json()
                           for inputs in (texts[:2], texts * 2, texts * 6)]
                out[hashes] = alone, batches
            return out

    for alone, batches in asyncio.run(main()).values():
        for batch in batches:
            for i, row in enumerate(batch):
                assert np.array_equal(np.array(row), np.array(alone[i % len(texts)]))


def test_int8_default_model_gives_a_text_the_same_bits_in_a_batch_of_any_size(default_dir, serve):
    """Int8 dense layers quantize each row on its own and sum in int32: a text's bits in a batch of 2, 8 or
    24 texts are its bits alone, and /info says int8 and which GEMM route serves it."""
    texts = [SHORT, LONG, "stock prices fell sharply today", "a cat sleeps on the sofa"]

    async def main():
        async with serve(default_dir, dense_dtype="int8") as c:
            alone = [(await c.post("/embed", json={"inputs": t})).json()[0] for t in texts]
            batches = [(await c.post("/embed", json={"inputs": inputs})).json()
                       for inputs in (texts[:2], texts * 2, texts * 6)]
            return (await c.get("/info")).json(), alone, batches

    info, alone, batches = asyncio.run(main())
    assert info["backend"]["dense"] == "int8"
    from yoso_serve.kernels import int8_gemm

    assert info["backend"]["int8_gemm"] == int8_gemm() in ("int_mm", "u8s8")
    for batch in batches:
        for i, row in enumerate(batch):
            assert np.array_equal(np.array(row), np.array(alone[i % len(texts)]))


def test_fp32_server_says_so(tiny_dir, serve):
    async def main():
        async with serve(tiny_dir, chunk_overlap=16, dense_dtype="fp32") as c:
            return (await c.get("/info")).json(), await c.post("/embed", json={"inputs": SHORT})

    info, r = asyncio.run(main())
    assert info["backend"]["dense"] == "fp32" and "int8_gemm" not in info["backend"]
    np.testing.assert_allclose(r.json()[0], direct(tiny_dir, SHORT, "fp32"), rtol=0, atol=1e-6)


def test_auto_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(linear, "native_bf16", lambda native=native: native)
        assert load_settings([]).resolved_dense_dtype() == expected
        assert load_settings(["--dense-dtype", "fp32"]).resolved_dense_dtype() == "fp32"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert load_settings(["--dense-dtype", "bf16"]).resolved_dense_dtype() == "bf16"  # asked for: whatever auto says


def test_bf16_without_a_bf16_gemm_fails_at_start_naming_the_fix(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="--dense-dtype bf16 but this CPU has no bf16 GEMM.*--dense-dtype fp32"):
        ServeSettings(dense_dtype="bf16")
    assert ServeSettings(dense_dtype="auto").dense_dtype == "auto"  # auto never fails: it falls back to fp32
