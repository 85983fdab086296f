"""The clients people already use, unmodified, against real ``yoso-serve`` processes on 127.0.0.1:
huggingface_hub's InferenceClient (TEI's client), the openai SDK, LangChain's embedding classes, the
Python snippets of docs/api.md's "Clients" section, and Schemathesis over /openapi.json.

Nothing may leave the machine: every test here runs with connections and name lookups refused for
any host but the loopback one (``loopback_only``), and Schemathesis runs behind a dead proxy."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
TEXTS = ["a cat sleeps on the sofa", "stock prices fell sharply today"]
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Refuse every connection and name lookup that is not for the loopback address. (HF_HUB_OFFLINE
    cannot be the guard: huggingface_hub then refuses every URL, this server's included.)"""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address, *args):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOOPBACK:
            raise ConnectionRefusedError(f"test reached for the network: {address}")
        return real_connect(sock, address, *args)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK:
            raise socket.gaierror(f"test looked up a network name: {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture(scope="module")
def servers(yoso_server, tiny_classifier_dir):
    """The default model (no head) and a tiny model with a three-label classification head."""
    plain, plain_url = yoso_server.start("--max-client-batch-size", "16")
    try:
        head, head_url = yoso_server.start("--model", str(tiny_classifier_dir), "--runtime", "torch",
                                           "--chunk-overlap", "16", "--max-client-batch-size", "16")
    except BaseException:
        yoso_server.stop(plain)
        raise
    yield plain_url, head_url
    yoso_server.stop(head)
    yoso_server.stop(plain)


def embed(url: str, texts: list[str]) -> np.ndarray:
    return np.array(httpx.post(f"{url}/embed", json={"inputs": texts}, timeout=60).json())


def test_inference_client_feature_extraction_and_sentence_similarity(servers):
    from huggingface_hub import InferenceClient

    url, _ = servers
    client = InferenceClient(url)
    want = embed(url, TEXTS)
    one = client.feature_extraction(TEXTS[0])
    many = client.feature_extraction(TEXTS)
    raw = client.feature_extraction(TEXTS[0], normalize=False, truncate=True, truncation_direction="left")
    assert one.dtype == np.float32 and one.shape == (1, want.shape[1]) and many.shape == want.shape
    np.testing.assert_allclose(one[0], want[0], atol=1e-5)
    np.testing.assert_allclose(many, want, atol=1e-5)
    assert np.linalg.norm(raw[0]) != pytest.approx(1, abs=1e-3)
    np.testing.assert_allclose(raw[0] / np.linalg.norm(raw[0]), want[0], atol=1e-5)
    source = "a kitten naps on the couch"
    scores = client.sentence_similarity(source, TEXTS)
    np.testing.assert_allclose(scores, want @ embed(url, [source])[0], atol=1e-5)
    assert scores[0] > scores[1]


def test_inference_client_text_classification(servers):
    from huggingface_hub import InferenceClient

    _, url = servers
    client = InferenceClient(url)
    text = "the battery died after an hour"
    want = httpx.post(f"{url}/classify", json={"inputs": text}, timeout=60).json()[0]
    got = client.text_classification(text)
    assert [(p.label, pytest.approx(p.score, abs=1e-5)) for p in got] == [(w["label"], w["score"]) for w in want]
    top = client.text_classification(text, top_k=1, function_to_apply="sigmoid")
    logits = {w["label"]: w["score"] for w in httpx.post(
        f"{url}/classify", json={"inputs": text, "raw_scores": True}, timeout=60).json()[0]}
    assert len(top) == 1 and top[0].label == max(logits, key=logits.get)
    assert top[0].score == pytest.approx(1 / (1 + np.exp(-logits[top[0].label])), abs=1e-5)
    # zero-shot: the Inference API's body, answered from /classify with labels
    labels = ["hardware problem", "billing", "praise"]
    zero = client.zero_shot_classification(text, labels, hypothesis_template="a complaint about {}")
    want = httpx.post(f"{url}/classify", json={"inputs": text, "labels": [f"a complaint about {x}" for x in labels]},
                      timeout=60).json()[0]
    assert [(p.label, pytest.approx(p.score, abs=1e-5)) for p in zero] == [
        (w["label"].removeprefix("a complaint about "), w["score"]) for w in want]
    # the embedding-model server answers text_classification's body with a clear 422
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError, match="422"):
        InferenceClient(servers[0]).text_classification(text)


def test_openai_sdk_float_base64_and_dimensions(servers):
    from openai import OpenAI

    url, _ = servers
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    want = embed(url, TEXTS)
    default = client.embeddings.create(model="yoso", input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model="yoso", input=TEXTS[0], encoding_format="float")
    short = client.embeddings.create(model="yoso", input=TEXTS, dimensions=64)
    np.testing.assert_allclose([d.embedding for d in default.data], want, atol=1e-5)
    np.testing.assert_allclose(floats.data[0].embedding, want[0], atol=1e-5)
    cut = want[:, :64] / np.linalg.norm(want[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose([d.embedding for d in short.data], cut, atol=1e-5)
    assert default.model == "yoso" and default.usage.prompt_tokens > 0
    # yoso-serve's hashes through the SDK's extra_body, as docs/api.md says: /embed's vector at that count (not
    # the default's: a short text runs exact under auto)
    few = client.embeddings.create(model="yoso", input=TEXTS[0], encoding_format="float", extra_body={"hashes": 2})
    want_few = httpx.post(f"{url}/embed", json={"inputs": TEXTS[0], "hashes": 2}, timeout=60).json()[0]
    np.testing.assert_allclose(few.data[0].embedding, want_few, atol=1e-5)
    assert np.abs(np.array(want_few) - want[0]).max() > 1e-3
    import openai

    with pytest.raises(openai.UnprocessableEntityError, match="max_client_batch_size 16"):
        client.embeddings.create(model="yoso", input=["x"] * 17)


def test_langchain_embedding_classes(servers):
    from langchain_huggingface import HuggingFaceEndpointEmbeddings
    from langchain_openai import OpenAIEmbeddings

    url, _ = servers
    want = embed(url, TEXTS)
    tei = HuggingFaceEndpointEmbeddings(model=url)
    oai = OpenAIEmbeddings(model="yoso", base_url=f"{url}/v1", api_key="unused",
                           check_embedding_ctx_length=False, chunk_size=16, max_retries=0)
    np.testing.assert_allclose(tei.embed_documents(TEXTS), want, atol=1e-5)
    np.testing.assert_allclose(tei.embed_query(TEXTS[1]), want[1], atol=1e-5)
    np.testing.assert_allclose(oai.embed_documents(TEXTS * 10), np.concatenate([want] * 10), atol=1e-5)
    np.testing.assert_allclose(oai.embed_query(TEXTS[0]), want[0], atol=1e-5)


def client_snippets() -> list[str]:
    section = (ROOT / "docs" / "api.md").read_text().split("## Clients", 1)[1]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_docs_client_snippets_run_as_written(servers, capsys):
    snippets = client_snippets()
    assert len(snippets) == 5
    plain, head = servers
    for snippet in snippets:
        # the text_classification snippet needs the model with a classification head
        url = head if "classification head" in snippet else plain
        exec(compile(snippet.replace("http://localhost:8080", url), "<docs/api.md, Clients>", "exec"), {})
    printed = capsys.readouterr().out
    assert all(label in printed for label in LABELS)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain", "head"])
def test_schemathesis_finds_nothing(servers, which, tmp_path):
    """Every check (server errors, status codes, content types, headers, response schemas, Allow on 405,
    schema-invalid requests rejected and schema-valid ones accepted), a fixed seed and example budget."""
    url = servers[0] if which == "plain" else servers[1]
    dead_proxy = "http://127.0.0.1:9"
    env = {**os.environ, "HTTP_PROXY": dead_proxy, "HTTPS_PROXY": dead_proxy, "NO_PROXY": "127.0.0.1,localhost"}
    out = subprocess.run([str(Path(sys.executable).parent / "st"), "--no-color", "run", f"{url}/openapi.json",
                          "--checks", "all", "--max-examples", "12", "--seed", "19", "--workers", "1",
                          "--request-timeout", "60"], capture_output=True, text=True, timeout=420, env=env,
                         cwd=tmp_path)  # its state folder (.schemathesis) stays out of the checkout
    tail = out.stdout[-6000:]
    assert out.returncode == 0, tail
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", out.stdout).groups())
    assert generated == passed and generated > 300, tail
