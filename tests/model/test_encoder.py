"""The encoder's own behaviour: real padding masks, per-call hashes, chunked FFN, long inputs, errors."""

from __future__ import annotations

import functools

import pytest
import torch

LENGTHS = [7, 23, 16]


@pytest.mark.parametrize("hashes", [0, 8])
@pytest.mark.parametrize("conv_window", [None, 3])
def test_padding_does_not_change_a_text(hashes, conv_window, kit):
    model = kit.tiny_model(conv_window=conv_window)
    seqs = kit.random_ids(LENGTHS)
    ids, mask = kit.pad_batch(seqs)
    with torch.no_grad():
        batched = model.last_hidden(ids, mask, hashes=hashes)
        pooled = model.embed(ids, mask, hashes=hashes)
        for row, seq in enumerate(seqs):
            alone = model.last_hidden(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), hashes=hashes)
            torch.testing.assert_close(batched[row, : len(seq)], alone[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pooled[row], alone[0].mean(dim=0), atol=1e-5, rtol=1e-5)


def test_padding_is_masked_for_real(kit):
    """Changing what sits under the padding must not move the real tokens' outputs."""
    model = kit.tiny_model()
    ids, mask = kit.pad_batch(kit.random_ids([5, 12]))
    garbage = ids.clone()
    garbage[0, 5:] = torch.arange(5, 12) + 30
    with torch.no_grad():
        a = model.last_hidden(ids, mask, hashes=0)
        b = model.last_hidden(garbage, mask, hashes=0)
        unmasked = model.last_hidden(garbage, torch.ones_like(mask), hashes=0)
    torch.testing.assert_close(a[0, :5], b[0, :5], atol=1e-6, rtol=0)
    assert (unmasked[0, :5] - a[0, :5]).abs().max() > 1e-3  # the mask is what protects them


def test_hashes_chosen_per_call_without_rebuilding(kit):
    # Gaussian hyperplanes: an unbiased estimator of the exact mode (the fast rotation is biased
    # when hash_code_len is close to the head size, as here: 6 bits of an 8-dim rotation).
    model = kit.tiny_model(use_expectation=False, use_fast_hash=False)
    ids, mask = kit.pad_batch(kit.random_ids([40, 40], seed=3))
    with torch.no_grad():
        exact = model.last_hidden(ids, mask, hashes=0)
        default = model.last_hidden(ids, mask)  # use_expectation False → num_hash = 16 hashes
        again = model.last_hidden(ids, mask, hashes=16)
        errors = {m: (model.last_hidden(ids, mask, hashes=m) - exact).norm().item() for m in (1, 4, 64, 512)}
    assert torch.equal(default, again)  # deterministic: seeded per (hash_seed, layer)
    assert errors[512] < errors[64] < errors[4] < errors[1]
    assert errors[512] < 0.25 * errors[1]


def test_hash_seed_changes_lsh_but_not_exact(kit):
    a, b = kit.tiny_model(hash_seed=0), kit.tiny_model(hash_seed=1)
    ids, mask = kit.pad_batch(kit.random_ids([30]))
    with torch.no_grad():
        assert torch.equal(a.last_hidden(ids, mask, hashes=0), b.last_hidden(ids, mask, hashes=0))
        assert not torch.allclose(a.last_hidden(ids, mask, hashes=4), b.last_hidden(ids, mask, hashes=4))


def test_default_hashes_follow_use_expectation(kit):
    assert kit.tiny_model(use_expectation=True).config.default_hashes == 0
    assert kit.tiny_model(use_expectation=False, num_hash=5).config.default_hashes == 5


def test_chunked_feed_forward_matches_unchunked(kit):
    plain = kit.tiny_model(seed=1)
    chunked = kit.tiny_model(seed=1, chunk_size_feed_forward=7)
    assert chunked.config.ffn_chunk_size(50) == 7
    ids, mask = kit.pad_batch(kit.random_ids([50, 31]))
    with torch.no_grad():
        torch.testing.assert_close(chunked.last_hidden(ids, mask, hashes=4), plain.last_hidden(ids, mask, hashes=4),
                                   atol=1e-6, rtol=1e-6)


def test_16k_token_forward_runs(kit):
    n = 16384
    model = kit.tiny_model(num_hidden_layers=1, max_position_embeddings=n)
    assert model.config.ffn_chunk_size(n) > 0  # the automatic chunking is on at this length
    ids = torch.tensor(kit.random_ids([n], seed=5))
    with torch.inference_mode():
        out = model.last_hidden(ids, torch.ones_like(ids), hashes=4)
    assert out.shape == (1, n, 32)
    assert torch.isfinite(out).all()
    # post-LayerNorm output: each position has (about) zero mean and unit variance before the affine
    assert out.std(dim=-1).mean().item() == pytest.approx(1.0, abs=0.1)


def test_embed_pooling_modes(kit):
    model = kit.tiny_model()
    ids, mask = kit.pad_batch(kit.random_ids([4, 9]))
    with torch.no_grad():
        hidden = model.last_hidden(ids, mask)
        torch.testing.assert_close(model.embed(ids, mask, pooling="cls"), hidden[:, 0])
        torch.testing.assert_close(model.embed(ids, mask)[0], hidden[0, :4].mean(dim=0))
    with pytest.raises(ValueError, match="pooling"):
        model.embed(ids, mask, pooling="max")


def test_encoder_input_errors(kit):
    model = kit.tiny_model()
    too_long = torch.ones(1, 129, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.last_hidden(too_long, torch.ones_like(too_long))
    ids, mask = kit.pad_batch(kit.random_ids([5]))
    with pytest.raises(ValueError, match="hashes"):
        model.last_hidden(ids, mask, hashes=-1)
    with pytest.raises(ValueError, match="attention_mask shape"):
        model.last_hidden(ids, mask[:, :3])
    with pytest.raises(ValueError, match="no classification head"):
        model.classify(ids, mask)
    with pytest.raises(ValueError, match="no masked-LM head"):
        model.mlm_logits(ids, mask)


def test_linear_takes_onednn_only_for_cpu_fp32_inference(monkeypatch):
    """The encoder's Linear: oneDNN for frozen fp32 CPU inference, within fp32 rounding of F.linear and
    row-independent; F.linear (with its gradient) for training, other dtypes and tracing."""
    from yoso_serve.model import linear

    if linear.ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    def counted_binary(*args):
        calls.append(args[0].shape)
        return real.binary(*args)

    real = linear.ONEDNN_LINEAR
    counted.binary = counted_binary
    monkeypatch.setattr(linear, "ONEDNN_LINEAR", counted)
    torch.manual_seed(0)
    lin = linear.Linear(48, 80)
    x = torch.randn(3, 40, 48)[:, ::2]  # a strided view, as the chunked FFN's slices are
    with torch.no_grad():
        fast = lin(x)
        ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(lin(x[1:2]), fast[1:2])  # a row alone gives the bits it gives in a batch
        assert len(calls) == 2
        lin.bias = None
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-5, rtol=1e-5)
        assert len(calls) == 3
        assert lin.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16 and len(calls) == 3
        lin.float()
        lin.bias = torch.nn.Parameter(torch.randn(80))
        ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
        # the epilogues: GELU (erf) and ReLU as aten computes them, bit for bit; the residual add
        for name, act in (("gelu", torch.nn.functional.gelu), ("relu", torch.nn.functional.relu)):
            assert torch.equal(lin.activated(x, name, act), act(lin(x)))
            torch.testing.assert_close(lin.activated(x, name, act), act(ref), atol=1e-5, rtol=1e-5)
        tanh = linear.activation("gelu_new")
        assert torch.equal(lin.activated(x, "gelu_new", tanh), tanh(lin(x)))  # not fused: a pass of its own
        other = torch.randn(3, 40, 80)[:, ::2]
        assert torch.equal(lin.plus(x, other), lin(x) + other)
        torch.testing.assert_close(lin.plus(x, other), ref + other, atol=1e-5, rtol=1e-5)
        calls.clear()
    out = lin(x) + lin.plus(x, x[..., :1]) + lin.activated(x, "gelu", torch.nn.functional.gelu)  # training:
    out.sum().backward()  # autograd's F.linear
    assert not calls and lin.weight.grad is not None
    with torch.no_grad():
        torch.jit.trace(lin, x, check_trace=False)  # tracing (the ONNX exporter's route) records F.linear
    assert not calls


def _bf16(t):
    return None if t is None else t.bfloat16().float()


def test_linear_in_bf16_multiplies_rounded_operands_and_keeps_rows_independent():
    """set_dense_dtype(·, "bf16"): the inference GEMM is F.linear of the bf16-rounded input, weights and
    bias (fp32 sums), rounded to bf16 and returned as fp32; the residual add of ``plus`` is fp32; a row gives
    the same bits alone or in a batch; the weights' bf16 copy follows weight updates; anything with a
    gradient still runs fp32 F.linear; "fp32" restores the fp32 path bit for bit."""
    from yoso_serve.model import linear

    if not linear.bf16_gemms():
        pytest.skip("this torch build or CPU has no oneDNN bf16 linear")
    torch.manual_seed(0)
    lin = linear.Linear(48, 80)
    x = torch.randn(3, 40, 48)[:, ::2]
    with torch.no_grad():
        fp32 = lin(x)
        linear.set_dense_dtype(lin, "bf16")
        out = lin(x)
        assert out.dtype == torch.float32 and torch.equal(out, out.bfloat16().float())  # rounded to bf16
        ref = torch.nn.functional.linear(_bf16(x), _bf16(lin.weight), _bf16(lin.bias))
        torch.testing.assert_close(out, ref, rtol=2 ** -8, atol=1e-4)  # one bf16 rounding of the fp32 sum
        assert (out - fp32).abs().max() > 1e-4  # it does take the bf16 path
        assert torch.equal(lin(x[1:2]), out[1:2]) and torch.equal(lin(x[:, 5:6]), out[:, 5:6])
        act = lin.activated(x, "gelu", torch.nn.functional.gelu)
        assert act.dtype == torch.bfloat16  # stays bf16 for the next GEMM
        torch.testing.assert_close(act.float(), torch.nn.functional.gelu(ref), rtol=2 ** -7, atol=1e-3)
        other = torch.randn(3, 20, 80) * 100  # the residual stream: large, and kept exact
        torch.testing.assert_close(lin.plus(x, other), out + other, rtol=0, atol=1e-4)
        nxt = linear.Linear(80, 48)
        linear.set_dense_dtype(nxt, "bf16")
        torch.testing.assert_close(nxt(act), nxt(act.float()), rtol=0, atol=0)  # a bf16 input is taken as is
        lin.weight.mul_(2)  # in place: the bf16 copy must follow
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(_bf16(x), _bf16(lin.weight), _bf16(lin.bias)),
                                   rtol=2 ** -8, atol=1e-4)
        lin.weight.div_(2)
    y = lin(x)  # training: fp32 F.linear with its gradient
    torch.testing.assert_close(y, fp32, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert lin.weight.grad is not None
    with torch.no_grad():
        linear.set_dense_dtype(lin, "fp32")
        assert torch.equal(lin(x), fp32)
    with pytest.raises(ValueError, match="fp32"):
        linear.set_dense_dtype(lin, "fp16")


@pytest.mark.parametrize("k", [768, 1536])
@pytest.mark.parametrize("blocked", [True, False], ids=["k-blocked", "one-gemm"])
def test_linear_in_bf16_over_a_long_k_gives_a_row_the_same_bits_at_any_row_count(k, blocked, monkeypatch):
    """K above BF16_SAFE_K (the FFN's output layer: 1536): one GEMM per K-block, summed in fp32, so that a
    row's bits do not depend on how many rows share the call (one GEMM over K 1536 with AMX gave a few rows
    in every hundred another bf16 rounding from 33 rows up); or, on CPUs where one GEMM keeps them
    (bf16_k_block() None: AVX512-BF16 without AMX), one GEMM, a single row going in as two; forward, plus and
    activated; near the one rounding of the whole product."""
    from yoso_serve.model import linear

    if not linear.bf16_gemms():
        pytest.skip("this torch build or CPU has no oneDNN bf16 linear")
    if not blocked and linear.bf16_k_block() is not None:
        pytest.skip("this CPU runs long-K bf16 GEMMs per K-block (AMX, or no AVX512-BF16)")
    monkeypatch.setattr(linear, "BF16_K_BLOCK", linear.BF16_SAFE_K if blocked else None)
    assert k > linear.BF16_SAFE_K and linear.k_blocked(k) == blocked
    torch.manual_seed(0)
    lin = linear.Linear(k, 96)
    linear.set_dense_dtype(lin, "bf16")
    rows = 420
    x, other = torch.randn(rows, k), torch.randn(rows, 96) * 10
    gelu = torch.nn.functional.gelu
    with torch.no_grad():
        ops = {"forward": lambda a, o: lin(a), "plus": lin.plus,
               "activated": lambda a, o: lin.activated(a, "gelu", gelu)}
        alone = {name: torch.cat([op(x[r:r + 1], other[r:r + 1]) for r in range(rows)]) for name, op in ops.items()}
        for m in [*range(2, 72), 96, 131, 192, 209, 257, 384, rows]:
            for name, op in ops.items():
                assert torch.equal(op(x[:m], other[:m]), alone[name][:m]), (name, m)
        assert alone["activated"].dtype == torch.bfloat16
        ref = torch.nn.functional.linear(_bf16(x), _bf16(lin.weight), _bf16(lin.bias))
        for got, want in ((alone["forward"], ref), (alone["plus"], ref + other)):  # only the K-blocks' roundings apart
            assert float((got - want).norm() / want.norm()) < 2 ** -9
            assert float((got - want).abs().max()) < 4 * 2 ** -8 * float(ref.abs().max())
        before = other.clone()
        lin.plus(x, other)
        assert torch.equal(other, before)  # the residual it adds to is left as it was


def test_native_bf16_reads_the_cpu_flags(monkeypatch, tmp_path):
    from yoso_serve.model import linear

    info = tmp_path / "cpuinfo"
    real = linear.Path

    def fake(path):
        return info if str(path) == "/proc/cpuinfo" else real(path)

    monkeypatch.setattr(linear, "Path", fake)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw\n")
    assert not linear.native_bf16()
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    assert linear.native_bf16()
    info.write_text("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert linear.native_bf16()
    info.unlink()
    assert not linear.native_bf16()


def test_bf16_k_block_reads_the_cpu_flags(monkeypatch, tmp_path):
    """One GEMM over a long K only on AVX512-BF16 without AMX; K-blocks with AMX, without bf16, and unknown."""
    from yoso_serve.model import linear

    info = tmp_path / "cpuinfo"
    real = linear.Path
    monkeypatch.setattr(linear, "Path", lambda path: info if str(path) == "/proc/cpuinfo" else real(path))
    for flags, block in (("fpu avx512f avx512_bf16 avx512_vnni", None), ("avx512_bf16 amx_bf16 amx_tile", 384),
                         ("avx512_bf16 amx_tile", 384), ("fpu avx2 avx512f", 384)):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert linear.bf16_k_block() == block, flags
    info.unlink()
    assert linear.bf16_k_block() == 384


def test_fp32_packed_reads_the_cpu_flags(monkeypatch, tmp_path):
    """Packed fp32 weights and aten's GELU pass on AVX2 CPUs without AVX-512 only; not where the flags are unknown."""
    from yoso_serve.model import linear

    info = tmp_path / "cpuinfo"
    real = linear.Path
    monkeypatch.setattr(linear, "Path", lambda path: info if str(path) == "/proc/cpuinfo" else real(path))
    for flags, packed in (("fpu avx2 fma", True), ("fpu avx2 avx512f avx512bw", False), ("fpu sse4_2", False)):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert linear.fp32_packed() == packed, flags
    info.unlink()
    assert not linear.fp32_packed()


def test_linear_with_packed_fp32_weights(monkeypatch):
    """The packed path: within fp32 rounding of F.linear, a row's bits at any row count (one row alone too, where
    this CPU takes that path), GELU as aten's pass over the GEMM's output, the residual add, the packed copy made
    again when the weights change; Q, K, V as one GEMM with their own bits."""
    from yoso_serve.model import linear

    if linear.ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    alone = linear.fp32_packed()  # the CPU this path is taken on: there a single row has its batch bits too
    monkeypatch.setattr(linear, "FP32_PACKED", True)
    torch.manual_seed(0)
    lin = linear.Linear(384, 1536)
    x, other = torch.randn(300, 384), torch.randn(300, 1536)
    gelu = torch.nn.functional.gelu
    with torch.no_grad():
        full = lin(x)
        torch.testing.assert_close(full, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        for rows in (1, 2, 7, 128) if alone else (2, 7, 128):
            assert torch.equal(lin(x[:rows]), full[:rows]), rows
        assert torch.equal(lin.activated(x, "gelu", gelu), gelu(full))
        summed = lin.plus(x, other)
        torch.testing.assert_close(summed, full + other, atol=1e-5, rtol=1e-5)
        assert torch.equal(lin.plus(x[:7], other[:7]), summed[:7])
        lin.weight.mul_(2)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        # Q, K, V side by side: one GEMM, each output the bits of its own (where this CPU takes that path)
        same = torch.equal if alone else functools.partial(torch.allclose, atol=1e-5, rtol=1e-5)
        qkv = [linear.Linear(384, 384) for _ in range(3)]
        assert all(same(out, q(x)) for out, q in zip(linear.packed_side_by_side(qkv, x), qkv))
        qkv[1].weight.mul_(2)
        qkv[2].bias.add_(1)
        assert all(same(out, q(x)) for out, q in zip(linear.packed_side_by_side(qkv, x), qkv))
        hook = qkv[2].register_forward_hook(lambda *_: None)  # a hook sees its linear's own call
        assert linear.packed_side_by_side(qkv, x) is None
        hook.remove()
        linear.set_dense_dtype(qkv[0], "bf16")
        assert linear.packed_side_by_side(qkv, x) is None
        monkeypatch.setattr(linear, "FP32_PACKED", False)
        assert linear.packed_side_by_side(qkv[1:], x) is None
    monkeypatch.setattr(linear, "FP32_PACKED", True)
    with torch.inference_mode():  # weights made under inference_mode have no version counter
        made = [linear.Linear(384, 384) for _ in range(3)]
        assert torch.equal(made[0](x), linear.packed_side_by_side(made, x)[0])


def test_bf16_dense_model_stays_near_fp32_and_row_independent():
    """A whole model with bf16 dense layers: embeddings within 1e-3 cosine of fp32 in exact mode, and a text's
    vector the same alone or beside a longer one (padding)."""
    from yoso_serve.kernels import exact_bf16_dots
    from yoso_serve.model import EncoderConfig, EncoderModel
    from yoso_serve.model.linear import set_dense_dtype

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 linear")
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64, use_expectation=False, num_hash=8,
                           hash_code_len=4)
    model = EncoderModel(config).eval()
    ids = torch.randint(5, 100, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.inference_mode():
        fp32 = model.embed(ids, mask, hashes=0)
        set_dense_dtype(model, "bf16")
        bf16 = model.embed(ids, mask, hashes=0)
        assert torch.nn.functional.cosine_similarity(fp32, bf16).min() > 0.999
        assert not torch.equal(fp32, bf16)
        assert torch.equal(model.embed(ids[1:, :20], mask[1:, :20], hashes=0)[0], bf16[1])
        info = model.backend_info()
        assert info["dense"] == "bf16"
        assert info.get("exact_bf16_dots", False) == (info["backend"] == "cpp" and exact_bf16_dots())
        set_dense_dtype(model, "fp32")
        assert model.backend_info()["dense"] == "fp32" and "exact_bf16_dots" not in model.backend_info()
