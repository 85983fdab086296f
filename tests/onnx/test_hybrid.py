"""``--runtime hybrid`` (ONNX Runtime for the served hash count, torch for the others): routing by hash
count, the export cache, start-time checks and load failures that never fall back to torch, what
/info, the metric and ``--prepare`` say; and the default, auto, which serves torch and exports nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from yoso_serve.model import load_pretrained, save_pretrained
from yoso_serve.model import export_cache as cache_module
from yoso_serve.model.export_cache import cached_export, export_key
from yoso_serve.model.hybrid import HybridEncoderModel
from yoso_serve.model.onnx_runtime import load_onnx
from yoso_serve.service import ServeSettings, create_app
from yoso_serve.service.cli import load_settings
from yoso_serve.service.loading import load_served_model

TEXTS = ["the quick brown fox", "jumps over the lazy dog and keeps running far away", "short"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private YOSO_CACHE_DIR; returns the folder exports go to (``<cache>/onnx``)."""
    monkeypatch.setenv("YOSO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "onnx"


def test_the_served_count_runs_on_onnxruntime_any_other_count_on_torch(tiny_model, lsh_dir, padded):
    onnx_model = load_onnx(lsh_dir)
    hybrid = HybridEncoderModel(tiny_model, onnx_model)
    cfg = tiny_model.config
    ids, mask = padded([9, 37, 2], pad=cfg.pad_token_id, vocab=cfg.vocab_size, seed=3)
    with torch.inference_mode():
        for hashes in (None, 16):  # None resolves to the model's default, the exported 16
            assert hybrid.runs_on_onnx(hashes)
            assert torch.equal(hybrid.embed(ids, mask, hashes=hashes), onnx_model.embed(ids, mask))
            assert torch.equal(hybrid.last_hidden(ids, mask, hashes=hashes), onnx_model.last_hidden(ids, mask))
            assert torch.equal(hybrid.classify(ids, mask, hashes=hashes), onnx_model.classify(ids, mask))
        torch.testing.assert_close(hybrid.embed(ids, mask), tiny_model.embed(ids, mask), atol=1e-3, rtol=0)
        for hashes in (0, 8):  # exact YOSO-E and another LSH count: the torch model, bit for bit
            assert not hybrid.runs_on_onnx(hashes)
            assert torch.equal(hybrid.embed(ids, mask, hashes=hashes), tiny_model.embed(ids, mask, hashes=hashes))
            assert torch.equal(hybrid.classify(ids, mask, hashes=hashes),
                               tiny_model.classify(ids, mask, hashes=hashes))
        exact = hybrid.embed(ids, mask, hashes=0)
        assert not torch.allclose(exact, hybrid.embed(ids, mask), atol=1e-3)  # two paths, really taken
        assert torch.equal(hybrid.embed(ids, mask, hashes=0), exact)  # and the same one every time
    assert hybrid.config is tiny_model.config and hybrid.tokenizer is tiny_model.tokenizer
    assert hybrid.has_classifier and hybrid.id2label == tiny_model.id2label


def test_the_export_is_written_once_and_then_reused(torch_dir, cache, monkeypatch):
    calls = []
    real_export = cache_module.export_onnx
    monkeypatch.setattr(cache_module, "export_onnx",
                        lambda *args, **kwargs: calls.append(kwargs["hashes"]) or real_export(*args, **kwargs))
    first = cached_export(load_pretrained(torch_dir), torch_dir, 16)
    assert calls == [16] and first == cache / export_key(torch_dir, 16)
    assert [p.name for p in cache.iterdir()] == [first.name]  # no scratch folder left beside it
    assert stat.S_IMODE(first.stat().st_mode) == 0o755  # readable by the user a server runs as
    stamp = (first / "model.onnx").stat().st_mtime_ns
    again = cached_export(load_pretrained(torch_dir), torch_dir, 16)
    assert again == first and calls == [16] and (first / "model.onnx").stat().st_mtime_ns == stamp
    assert load_onnx(first).fixed_hashes == 16


def test_the_cache_key_follows_the_checkpoint_bytes_and_what_shapes_the_graph(torch_dir, tmp_path, monkeypatch):
    key = export_key(torch_dir, 16)
    assert len(key) == 32 and export_key(torch_dir, 16) == key
    assert len({key, export_key(torch_dir, 8), export_key(torch_dir, 0), export_key(torch_dir, 16, opset=18)}) == 4
    copy = shutil.copytree(torch_dir, tmp_path / "copy")
    assert export_key(copy, 16) == key  # the bytes, not the path
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "hash_seed": 12}))
    changed_config = export_key(copy, 16)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert len({key, changed_config, export_key(copy, 16)}) == 3
    monkeypatch.setattr(cache_module, "package_version", lambda: "99.0.0")
    assert export_key(torch_dir, 16) != key  # a new release of the package exports afresh


def test_a_crash_leaves_nothing_and_a_concurrent_export_that_lands_first_wins(torch_dir, cache, monkeypatch):
    model = load_pretrained(torch_dir)
    target = cache / export_key(torch_dir, 16)

    def crashing(model, out_dir, **kwargs):
        (Path(out_dir) / "model.onnx").write_bytes(b"half a graph")
        raise RuntimeError("killed mid-export")

    monkeypatch.setattr(cache_module, "export_onnx", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        cached_export(model, torch_dir, 16)
    assert list(cache.iterdir()) == []

    def racing(model, out_dir, **kwargs):
        # another process renames its finished export into place while this one is still writing
        other = cache / ".other-process"
        other.mkdir()
        (other / "config.json").write_text("{}")
        (other / "model.onnx").write_bytes(b"theirs")
        os.replace(other, target)
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / "model.onnx").write_bytes(b"ours")

    monkeypatch.setattr(cache_module, "export_onnx", racing)
    assert cached_export(model, torch_dir, 16) == target
    assert (target / "model.onnx").read_bytes() == b"theirs"
    assert [p.name for p in cache.iterdir()] == [target.name]


def test_auto_serves_torch_and_exports_nothing(torch_dir, cache, caplog):
    with caplog.at_level(logging.INFO, logger="yoso_serve.service"):
        loaded = load_served_model(ServeSettings(model=torch_dir))
    assert loaded.runtime == "torch" and loaded.model.__class__.__name__ == "EncoderModel"
    assert loaded.reason.startswith("auto on cpu: torch") and "docs/benchmarks.md" in loaded.reason
    assert f"runtime torch: {loaded.reason}" in [r.getMessage() for r in caplog.records]
    assert not cache.parent.exists()  # nothing written into YOSO_CACHE_DIR
    assert load_served_model(ServeSettings(model=torch_dir, runtime="torch")).reason == "--runtime torch"


def test_hybrid_exports_the_served_count(torch_dir, cache):
    loaded = load_served_model(ServeSettings(model=torch_dir, runtime="hybrid", hashes=8))  # the served count
    assert loaded.runtime == "hybrid" and loaded.model.onnx_hashes == 8
    assert loaded.model.runs_on_onnx(8) and not loaded.model.runs_on_onnx(None)  # None: the model's 16
    assert loaded.model.export_dir.parent == cache and "8 hashes" in loaded.reason
    assert [p.name for p in cache.iterdir()] == [loaded.model.export_dir.name]


def test_hybrid_needs_onnxruntime_and_onnx_at_start(torch_dir, monkeypatch, capsys):
    assert ServeSettings(model=torch_dir, runtime="hybrid").runtime == "hybrid"
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now raises ImportError
    with pytest.raises(SystemExit) as exit_:
        load_settings(["--runtime", "hybrid", "--model", str(torch_dir)])
    assert exit_.value.code == 2
    assert ("  --runtime hybrid needs onnxruntime: pip install 'yoso-serve[onnx]'"
            in capsys.readouterr().err)
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ValidationError, match="needs onnxruntime and onnx: pip install"):
        ServeSettings(model=torch_dir, runtime="hybrid")
    monkeypatch.delitem(sys.modules, "onnxruntime")
    with pytest.raises(ValidationError, match="needs onnx: pip install"):
        ServeSettings(model=torch_dir, runtime="hybrid")
    assert ServeSettings(model=torch_dir).runtime == "auto"  # the default needs neither


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_type="softmax"), "attention_type 'softmax'"),
    (dict(use_expectation=True), "the served hash count is 0 (exact YOSO-E)"),
])
def test_hybrid_refuses_models_it_cannot_serve_at_load(make_tiny_model, tmp_path, cache, overrides, message):
    model_dir = save_pretrained(make_tiny_model(**overrides), tmp_path / "model")
    with pytest.raises(ValueError, match=r"--runtime hybrid: .*use --runtime torch") as failure:
        load_served_model(ServeSettings(model=model_dir, runtime="hybrid"))
    assert message in str(failure.value)
    assert not cache.exists()


def test_a_hybrid_export_that_cannot_be_prepared_fails_the_start(torch_dir, tmp_path, monkeypatch):
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("YOSO_CACHE_DIR", str(tmp_path / "not-a-folder"))  # the export cannot be written
    settings = ServeSettings(model=torch_dir, runtime="hybrid")
    with pytest.raises(RuntimeError, match="the ONNX export at 16 hashes could not be prepared in"):
        load_served_model(settings)

    fatal = []
    app = create_app(settings, on_fatal=fatal.append)  # what the CLI turns into exit 1

    async def start():
        async with app.router.lifespan_context(app):
            with pytest.raises(RuntimeError):
                await app.state.startup
            return app.state.engine

    engine = asyncio.run(start())
    assert engine.state == "failed" and "could not be prepared" in engine.failure
    assert len(fatal) == 1 and "YOSO_CACHE_DIR" in str(fatal[0])


def test_the_cli_exits_1_when_the_hybrid_export_cannot_be_prepared(torch_dir, tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "YOSO_CACHE_DIR": str(tmp_path / "not-a-folder"), "YOSO_KERNEL_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-c", "from yoso_serve.service.cli import main; main()",
                          "--runtime", "hybrid", "--model", str(torch_dir), "--host", "127.0.0.1", "--port", str(port)],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "--runtime hybrid: the ONNX export at 16 hashes could not be prepared" in out.stderr


def test_onnx_still_needs_an_export(torch_dir, lsh_dir):
    assert ServeSettings(model=lsh_dir, runtime="onnx", auto_exact_below=0).runtime == "onnx"
    assert ServeSettings(model=lsh_dir, runtime="onnx", hashes=16).runtime == "onnx"
    # auto's exact crossover cannot be honoured by a graph fixed at 16 hashes: refused at start, not ignored
    with pytest.raises(ValidationError, match="--runtime onnx with --hashes auto: auto runs inputs under "
                                              "--auto-exact-below 288 tokens exact"):
        ServeSettings(model=lsh_dir, runtime="onnx")
    with pytest.raises(ValidationError, match="serve it with --runtime torch or hybrid"):
        ServeSettings(model=torch_dir, runtime="onnx")


def _session(model_dir, serve, **settings):
    async def main():
        async with serve(model_dir, **settings) as c:
            return {"info": await c.get("/info"), "metrics": await c.get("/metrics"),
                    "default": await c.post("/embed", json={"inputs": TEXTS}),
                    "exact": await c.post("/embed", json={"inputs": TEXTS, "hashes": 0}),
                    "eight": await c.post("/embed", json={"inputs": TEXTS, "hashes": 8}),
                    "sixteen": await c.post("/embed", json={"inputs": TEXTS, "hashes": 16})}

    return asyncio.run(main())


def test_the_app_serves_hybrid_and_says_so(torch_dir, cache, serve):
    # a crossover above every text: on hybrid as on torch, auto runs them exact (on torch; model/hashes.py)
    # and bf16 dense layers asked for (auto where this CPU has none): the torch half stays fp32, as the graph is
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    out = _session(torch_dir, serve, runtime="hybrid", auto_exact_below=10_000, dense_dtype="bf16" if bf16 else "auto")
    info = out["info"].json()
    assert info["runtime"] == "hybrid" and info["runtime_reason"].startswith("--runtime hybrid")
    assert info["hashes"] == "auto" and info["auto_exact_below"] == 10_000  # the crossover is the deployment's
    backend = info["backend"]
    assert backend["backend"] == "onnxruntime+torch" and backend["onnx_hashes"] == info["default_hashes"] == 16
    assert backend["onnxruntime"]["providers"] == ["CPUExecutionProvider"]
    assert backend["torch"]["backend"] in ("cpp", "torch") and backend["torch"]["dense"] == "fp32"
    assert Path(backend["export"]).parent == cache and (Path(backend["export"]) / "model.onnx").is_file()
    metrics = out["metrics"].text
    assert 'runtime="hybrid"' in metrics and 'backend="onnxruntime+torch"' in metrics
    # every hash count is still served: 16 by ONNX Runtime, the others by torch
    for name, hashes in (("default", "0"), ("exact", "0"), ("eight", "8"), ("sixteen", "16")):
        assert out[name].status_code == 200 and out[name].headers["x-hashes"] == hashes, out[name].text


def test_the_app_on_auto_serves_torch_says_why_and_exports_nothing(torch_dir, cache, serve, caplog):
    with caplog.at_level(logging.INFO, logger="yoso_serve.service"):
        out = _session(torch_dir, serve)
    info = out["info"].json()
    assert info["runtime"] == "torch" and info["runtime_reason"].startswith("auto on cpu: torch")
    assert info["backend"]["backend"] in ("cpp", "torch")
    assert 'runtime="torch"' in out["metrics"].text
    assert all(out[name].status_code == 200 for name in ("default", "exact", "eight"))
    assert [r.getMessage() for r in caplog.records].count(f"runtime torch: {info['runtime_reason']}") == 1
    assert not cache.parent.exists()


def test_prepare_writes_the_hybrid_export_once_and_exits_0(torch_dir, cache, capsys):
    from yoso_serve.service.cli import main

    def prepare(*flags):
        with pytest.raises(SystemExit) as exit_:
            main(["--prepare", "--model", str(torch_dir), "--log-level", "warning", *flags])
        assert exit_.value.code == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    auto = prepare()
    assert auto["runtime"] == "torch" and auto["onnx_export"] is None and not cache.exists()
    printed = [prepare("--runtime", "hybrid") for _ in range(2)]
    assert printed[0] == printed[1] and printed[0]["runtime"] == "hybrid"
    assert Path(printed[0]["onnx_export"]).parent == cache and len(list(cache.iterdir())) == 1
