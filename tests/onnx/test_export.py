"""The exported directory and graph, the traceable attention against the kernels' oracles, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
import torch
from onnx import numpy_helper

from yoso_serve.kernels import hash_codes
from yoso_serve.kernels.hashing import projection_planes
from yoso_serve.kernels.yoso import YosoExactFn, lsh_cumulate
from yoso_serve.model import EncoderConfig, TextTokenizer
from yoso_serve.model.encoder import layer_seed
from yoso_serve.model.export import exact_cumulate_onnx, export_onnx, hash_codes_onnx, lsh_cumulate_onnx
from yoso_serve.model.onnx_runtime import OnnxModelError, load_onnx
from yoso_serve.model.train.export_onnx import main_export_onnx


def test_out_dir_holds_graph_config_and_tokenizer(lsh_dir, tiny_model):
    assert {p.name for p in lsh_dir.iterdir()} >= {"model.onnx", "config.json", "tokenizer.json"}
    raw = json.loads((lsh_dir / "config.json").read_text())
    assert raw["onnx"]["hashes"] == 16 and raw["onnx"]["opset"] == 17
    assert [i["name"] for i in raw["onnx"]["inputs"]] == ["input_ids", "attention_mask"]
    assert raw["onnx"]["outputs"] == [
        {"name": "last_hidden_state", "shape": ["batch", "sequence", 32], "dtype": "float32"},
        {"name": "embedding", "shape": ["batch", 32], "dtype": "float32"},
        {"name": "logits", "shape": ["batch", 3], "dtype": "float32"}]
    config = EncoderConfig.from_dict(raw)  # still a transformers-style config the model package reads
    assert config.default_hashes == 16 and config.id2label == tiny_model.config.id2label
    assert TextTokenizer.from_dir(lsh_dir).encode(["hello world"]) == tiny_model.tokenizer.encode(["hello world"])


def test_exact_export_states_zero_hashes(exact_dir):
    raw = json.loads((exact_dir / "config.json").read_text())
    assert raw["onnx"]["hashes"] == 0 and raw["use_expectation"] is True
    ops = {node.op_type for node in onnx.load(str(exact_dir / "model.onnx")).graph.node}
    assert {"Acos", "Pow"} <= ops and "ScatterND" not in ops


def test_graph_uses_standard_ops_and_stores_the_seeded_projections(lsh_dir, tiny_model):
    graph = onnx.load(str(lsh_dir / "model.onnx")).graph
    onnx.checker.check_model(onnx.load(str(lsh_dir / "model.onnx")))
    assert all(node.domain in ("", "ai.onnx") for node in graph.node)  # no custom or contrib ops
    scatters = [n for n in graph.node if n.op_type == "ScatterND"]
    assert len(scatters) == 2  # one per layer (16 hashes of 6 bits fit one table group)
    assert all(a.s == b"add" for n in scatters for a in n.attribute if a.name == "reduction")
    assert {"Gather", "Greater", "MatMul", "ReduceSum"} <= {n.op_type for n in graph.node}
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    cfg = tiny_model.config
    for layer in range(cfg.num_hidden_layers):
        expected = projection_planes(layer_seed(cfg.hash_seed, layer), cfg.num_attention_heads, 16, cfg.hash_code_len,
                               cfg.head_dim, True, torch.device("cpu"))
        assert torch.equal(torch.tensor(inits[f"attention.{layer}.projection"]), expected)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}


def test_hash_codes_equal_the_kernel_codes():
    x = torch.nn.functional.normalize(torch.randn(2, 3, 137, 48, generator=torch.Generator().manual_seed(0)), dim=-1)
    for fast in (True, False):
        projection = projection_planes(5, 3, 7, 9, 48, fast, torch.device("cpu"))
        expected = hash_codes(x, num_hashes=7, hash_bits=9, seed=5, fast_hash=fast)  # (B, H, m, N)
        assert torch.equal(hash_codes_onnx(x, projection, 9), expected.permute(0, 1, 3, 2).long())
        # int8: the graph quantizes the raw rows as the kernels do (the int8 planes are the initializer)
        raw = x * torch.rand(2, 3, 137, 1, generator=torch.Generator().manual_seed(1)) * 5
        planes = projection_planes(5, 3, 7, 9, 48, fast, torch.device("cpu"), True)
        expected = hash_codes(raw, num_hashes=7, hash_bits=9, seed=5, fast_hash=fast, int8=True)
        assert torch.equal(hash_codes_onnx(raw, planes, 9, int8=True), expected.permute(0, 1, 3, 2).long())


@pytest.mark.parametrize("group", [1, 3, 8])
def test_lsh_cumulation_equals_the_kernel_with_masked_keys_and_queries(group):
    gen = torch.Generator().manual_seed(1)
    bh, n, m, d, bits = 6, 53, 8, 16, 3  # 8 buckets: many keys share one, and hashes collide
    q_codes = torch.randint(0, 1 << bits, (bh, m, n), generator=gen, dtype=torch.int32)
    k_codes = torch.randint(0, 1 << bits, (bh, m, n), generator=gen, dtype=torch.int32)
    v = torch.randn(bh, n, d, generator=gen)
    keep = (torch.rand(bh, n, generator=gen) > 0.3).float()
    masked = (keep == 0)[:, None, :]
    expected = lsh_cumulate(q_codes.masked_fill(masked, -1), k_codes.masked_fill(masked, -1), v, bits)
    got = lsh_cumulate_onnx(q_codes.long().transpose(1, 2), k_codes.long().transpose(1, 2), v * keep[..., None],
                            bits, group) * keep[..., None]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_exact_cumulation_equals_the_kernel():
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.nn.functional.normalize(torch.randn(4, 61, 24, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(4, 61, 24, generator=gen)
    keep = (torch.rand(4, 61, generator=gen) > 0.2).float()
    torch.testing.assert_close(exact_cumulate_onnx(q, k, v, keep, 7), YosoExactFn.apply(q, k, v, keep, 7),
                               atol=1e-5, rtol=1e-5)


def test_cli_exports_exact_and_fixed_hash_counts(tiny_model, tmp_path, capsys):
    from yoso_serve.model import save_pretrained

    ckpt = save_pretrained(tiny_model, tmp_path / "ckpt")
    assert main_export_onnx(["--model", str(ckpt), "--out", str(tmp_path / "exact"), "--exact"]) == 0
    assert "hashes 0" in capsys.readouterr().out
    assert load_onnx(tmp_path / "exact").fixed_hashes == 0
    from yoso_serve.model.train.cli import main as yoso_train  # the same command as a yoso-train subcommand

    assert yoso_train(["export-onnx", "--model", str(ckpt), "--out", str(tmp_path / "h3"), "--hashes", "3"]) == 0
    assert load_onnx(tmp_path / "h3").fixed_hashes == 3
    with pytest.raises(SystemExit):  # --hashes and --exact exclude each other
        main_export_onnx(["--model", str(ckpt), "--out", str(tmp_path / "x"), "--exact", "--hashes", "4"])
    assert main_export_onnx(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "y")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main_export_onnx(["--model", str(ckpt), "--out", str(tmp_path / "z"), "--hashes", "-1"]) == 2
    assert "hashes must be an int >= 0" in capsys.readouterr().err


def test_module_entry_point_runs(tiny_model, tmp_path):
    from yoso_serve.model import save_pretrained

    ckpt = save_pretrained(tiny_model, tmp_path / "ckpt")
    done = subprocess.run([sys.executable, "-m", "yoso_serve.model.train.export_onnx", "--model", str(ckpt), "--out",
                           str(tmp_path / "out"), "--hashes", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert load_onnx(tmp_path / "out").fixed_hashes == 2


def test_runtime_refuses_other_hash_counts_and_bad_dirs(lsh_dir, tiny_model, tmp_path):
    model = load_onnx(lsh_dir)
    ids = torch.tensor([[101, 2000, 102]])
    torch.testing.assert_close(model.embed(ids, hashes=16), model.embed(ids))
    with pytest.raises(ValueError, match="hashes must be 16, the count this ONNX model was exported with"):
        model.embed(ids, hashes=8)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        model.embed(torch.ones(1, 161, dtype=torch.long))
    with pytest.raises(ValueError, match="pooling must be one of"):
        model.embed(ids, pooling="max")
    with pytest.raises(OnnxModelError, match="float32"):
        model.to("cpu", torch.float16)
    assert model.backend_info()["providers"] == ["CPUExecutionProvider"]
    from yoso_serve.model import save_pretrained

    with pytest.raises(OnnxModelError, match="not an exported model"):
        load_onnx(save_pretrained(tiny_model, tmp_path / "torch-only"))
    with pytest.raises(OnnxModelError, match="no config.json"):
        load_onnx(tmp_path)


def test_cuda_needs_the_cuda_provider():
    import onnxruntime

    from yoso_serve.model.onnx_runtime import providers_for

    assert providers_for("cpu") == ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():  # onnxruntime-gpu installed
        assert providers_for("cuda") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        with pytest.raises(OnnxModelError, match="onnxruntime-gpu"):
            providers_for("cuda")
    with pytest.raises(OnnxModelError, match="device must be one of"):
        providers_for("mps")


def test_other_attention_types_are_refused(tmp_path):
    from yoso_serve.model import EncoderModel

    model = EncoderModel(EncoderConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=32, attention_type="softmax"))
    with pytest.raises(ValueError, match="attention_type 'softmax'"):
        export_onnx(model, tmp_path)
    with pytest.raises(ValueError, match="opset must be >= 16"):
        export_onnx(EncoderModel(EncoderConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32,
                                               max_position_embeddings=32)), tmp_path, opset=13)


class _Cumulate(torch.nn.Module):
    def forward(self, q_codes, k_codes, v):
        return lsh_cumulate_onnx(q_codes, k_codes, v, 2, 4)


def test_crowded_buckets_keep_every_add_under_the_runtime_session_options(tmp_path):
    """Four buckets, 20 000 keys: every table row takes thousands of adds, so any lost update shows."""
    import warnings

    import onnxruntime

    from yoso_serve.model.onnx_runtime import session_options

    gen = torch.Generator().manual_seed(3)
    bh, n, m, d = 1, 40000, 4, 32  # one batch·head: every thread adds into the same 16 rows
    q_codes = torch.randint(0, 4, (bh, m, n), generator=gen, dtype=torch.int32)
    k_codes = torch.randint(0, 4, (bh, m, n), generator=gen, dtype=torch.int32)
    v = torch.randn(bh, n, d, generator=gen)
    args = (q_codes.long().transpose(1, 2).contiguous(), k_codes.long().transpose(1, 2).contiguous(), v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Cumulate(), args, str(tmp_path / "c.onnx"), dynamo=False, opset_version=17,
                          input_names=["q", "k", "v"])
    session = onnxruntime.InferenceSession(str(tmp_path / "c.onnx"), session_options("cpu"),
                                           providers=["CPUExecutionProvider"])
    expected = lsh_cumulate(q_codes, k_codes, v, 2)
    for _ in range(20):  # a race shows on some runs only
        (got,) = session.run(None, {"q": args[0].numpy(), "k": args[1].numpy(), "v": v.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), expected, atol=2e-3, rtol=1e-4)
