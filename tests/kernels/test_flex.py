"""Exact mode as one fused FlexAttention kernel (kernels/flex.py) and the YOSO core's use of it.

The kernel is compiled by torch.compile: inductor's C++ here (the GPU runs Triton, test_cuda.py). The
oracle is exact mode's own formula, E[B]·V on unit rows, compared after N-YOSO's row norm, which is
all the kernel promises. Each compilation costs seconds on 2 cores, so the cases share shapes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from yoso_testkit import pad_batch, random_ids, tiny_model

from yoso_serve.kernels import flex
from yoso_serve.kernels.exact import collision_probability
from yoso_serve.model.attention import yoso as yoso_core
from yoso_serve.model.attention.yoso import exact_kernel_info, set_exact_kernel, warm_exact_kernel

pytestmark = pytest.mark.skipif(flex.unavailable("cpu") is not None, reason=str(flex.unavailable("cpu")))


def oracle_rows(q, k, v, keep, tau):
    """normalize(E[B]·V) over the live keys, zero rows for masked queries: (B, H, N, D) fp64."""
    qn, kn = F.normalize(q.double(), dim=-1), F.normalize(k.double(), dim=-1)
    weights = collision_probability(qn, kn, tau) * keep[:, None, None, :]
    return F.normalize(weights @ v.double(), dim=-1) * keep[:, None, :, None]


def test_flex_rows_equal_exact_mode_after_the_row_norm_with_padding_and_masks():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 300, 32, generator=gen) for _ in range(3))
    keep = torch.ones(2, 300, dtype=torch.bool)
    keep[1, 170:] = False  # a shorter input padded in the batch (300 is itself padded to 512 inside)
    with torch.inference_mode():
        out = flex.exact_attention_flex(q, k, v, keep, 8)
    assert out.shape == v.shape and out.dtype == torch.float32
    assert torch.equal(out[1, :, 170:], torch.zeros_like(out[1, :, 170:]))  # masked queries: zero rows
    got = F.normalize(out.double(), dim=-1)
    torch.testing.assert_close(got, oracle_rows(q, k, v, keep.double(), 8), rtol=0, atol=2e-6)
    # the rows are E[B]·V divided by their weight sums: a masked key moves nothing
    v2 = v.clone()
    v2[1, :, 200:] = 1e6
    with torch.inference_mode():
        assert torch.equal(flex.exact_attention_flex(q, k, v2, keep, 8)[1], out[1])


def test_padded_lengths_and_buckets():
    assert [flex.padded_length(n) for n in (1, 256, 257, 4096)] == [256, 256, 512, 4096]
    assert list(flex.buckets(600)) == [256, 512, 768]
    with pytest.raises(ValueError, match="B, H, N, D"):
        flex.exact_attention_flex(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), None, 8)


def _pair(seed=0):
    """A tiny YOSO model with 32-wide heads and a padded batch of two inputs."""
    model = tiny_model(seed, hidden_size=64, num_attention_heads=2, conv_window=5)
    ids, mask = pad_batch(random_ids([90, 41], seed=seed))
    return model, ids, mask


def test_the_core_runs_flex_in_exact_inference_and_the_op_elsewhere(monkeypatch):
    model, ids, mask = _pair()
    with torch.inference_mode():
        op = model.last_hidden(ids, mask, hashes=0)
        lsh = model.last_hidden(ids, mask, hashes=16)
    set_exact_kernel(model, "flex")
    assert exact_kernel_info(model) == {"exact_kernel": "flex"}
    assert model.backend_info()["exact_kernel"] == "flex"
    calls = []
    real = flex.exact_attention_flex
    monkeypatch.setattr(flex, "exact_attention_flex", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        fused = model.last_hidden(ids, mask, hashes=0)
        assert torch.equal(model.last_hidden(ids, mask, hashes=16), lsh)  # LSH mode never takes it
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(fused, op, rtol=0, atol=2e-5)
    calls.clear()
    model.last_hidden(ids, mask, hashes=0).sum().backward()  # gradients wanted: the op and its backward
    assert calls == []
    set_exact_kernel(model, "op")
    assert exact_kernel_info(model) == {"exact_kernel": "op"}


def test_a_failing_kernel_is_logged_once_and_the_op_serves(monkeypatch, caplog):
    model, ids, mask = _pair(1)
    with torch.inference_mode():
        op = model.last_hidden(ids, mask, hashes=0)
    set_exact_kernel(model, "flex")

    def broken(*args):
        raise RuntimeError("triton: no kernel image\nsecond line")

    monkeypatch.setattr(flex, "exact_attention_flex", broken)
    monkeypatch.setattr(yoso_core, "_flex_failure", None)
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        out = model.last_hidden(ids, mask, hashes=0)
        again = model.last_hidden(ids, mask, hashes=0)
    assert torch.equal(out, op) and torch.equal(again, op)
    assert [r.getMessage() for r in caplog.records].count(
        "exact_kernel flex failed, exact mode runs the op from now on: RuntimeError: triton: no kernel image") == 1
    assert exact_kernel_info(model) == {"exact_kernel": "op",
                                        "exact_kernel_failure": "RuntimeError: triton: no kernel image"}
    assert warm_exact_kernel(model, 256) == 0


def test_set_exact_kernel_names_what_it_cannot_do(monkeypatch):
    model, _, _ = _pair()
    with pytest.raises(ValueError, match=r"one of \('op', 'flex'\), got 'fast'"):
        set_exact_kernel(model, "fast")
    monkeypatch.setattr(flex, "unavailable", lambda device: "torch.compile needs Triton")
    with pytest.raises(ValueError, match="exact kernel flex cannot run on cpu: torch.compile needs Triton"):
        set_exact_kernel(model, "flex")
    assert exact_kernel_info(model) == {"exact_kernel": "op"}


def test_warm_compiles_each_bucket_for_one_input_and_for_batches(monkeypatch):
    model, _, _ = _pair()
    assert warm_exact_kernel(model, 200) == 0  # the op runs: nothing to compile
    set_exact_kernel(model, "flex")
    seen = []
    real = flex.exact_attention_flex
    monkeypatch.setattr(flex, "exact_attention_flex", lambda *a: seen.append(tuple(a[0].shape)) or real(*a))
    assert warm_exact_kernel(model, 200) == 1
    assert seen == [(1, 2, 256, 32), (2, 2, 256, 32)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2), (torch.float32, 1e-5)])
def test_flex_on_cuda_equals_exact_mode(dtype, atol):
    """The Triton kernel, at the default model's head shape (12 heads of 32) and a length no bucket fits."""
    assert flex.unavailable("cuda") is None, flex.unavailable("cuda")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 12, 1000, 32, generator=gen) for _ in range(3))
    keep = torch.ones(3, 1000, dtype=torch.bool)
    keep[0, 611:] = False
    keep[2, 1:] = False  # one live token
    with torch.inference_mode():
        out = flex.exact_attention_flex(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), keep.cuda(), 8)
    want = oracle_rows(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), keep.double(), 8)
    torch.testing.assert_close(F.normalize(out.double(), dim=-1).cpu(), want, rtol=0, atol=atol)


def test_cuda_needs_triton_and_a_c_compiler(monkeypatch):
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else real_find(name))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "C compiler (CC, gcc or clang)" in flex.unavailable("cuda")
    monkeypatch.setenv("CC", "cc")
    assert flex.unavailable("cuda") is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else real_find(name))
    assert "needs Triton" in flex.unavailable("cuda")
    assert "not mps" in flex.unavailable("mps")
