"""The layer's finish after the attention op (kernels/finish.py): N-YOSO's row norm then YOSO-C's
convolution of the masked values. The C++ pass against a float64 oracle written from the formula
(not from the PyTorch ops it replaces), against the PyTorch twin, across thread counts, and the
model with it against the model on the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import finish
from yoso_serve.kernels.finish import attention_finish, attention_finish_ref


def oracle(context, v, weight, keep, normalize=True, eps=1e-12):
    """float64: out[b,h,n] = ctx/max(|ctx|, eps) + sum_t w[h,t] v[b,h,n+t-W/2] keep[b,n+t-W/2]."""
    ctx, v = context.double(), v.double()
    out = ctx / ctx.norm(dim=-1, keepdim=True).clamp_min(eps) if normalize else ctx.clone()
    if weight is None:
        return out
    b, h, n, d = v.shape
    w = weight.double().reshape(h, -1)
    half = w.shape[1] // 2
    kv = v if keep is None else v * keep.double()[:, None, :, None]
    for i in range(n):
        for t in range(w.shape[1]):
            j = i + t - half
            if 0 <= j < n:
                out[:, :, i] += w[None, :, t, None] * kv[:, :, j]
    return out


def inputs(b, h, n, d, window, seed=0, strided=True):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # (B, H, N, D) views of (B, N, H, D) memory, as a model's head split gives them
        ctx = torch.randn(b, n, h, d, generator=gen).transpose(1, 2)
        v = torch.randn(b, n, h, d, generator=gen).transpose(1, 2)
    else:
        ctx, v = torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)
    weight = None if window is None else torch.randn(h, 1, window, 1, generator=gen) * 0.2
    return ctx, v, weight


def ext_or_skip():
    from yoso_serve.kernels._build import cpu_extension

    ext = cpu_extension()
    if ext is None:
        pytest.skip("C++ extension not built")
    return ext


@pytest.mark.parametrize("b,h,n,d,window,strided", [
    (2, 3, 9, 8, 5, True), (1, 2, 3, 4, 7, False),  # window longer than the sequence
    (2, 4, 130, 32, 33, True), (1, 2, 70, 64, 9, True), (1, 1, 1, 1, 1, False),  # D = 32, 64: fixed-size bodies
])
@pytest.mark.parametrize("masked", [False, True])
def test_cpp_pass_matches_the_formula_and_the_pytorch_twin(b, h, n, d, window, strided, masked, monkeypatch):
    ext_or_skip()
    ctx, v, weight = inputs(b, h, n, d, window, strided=strided)
    keep = None
    if masked:
        keep = torch.arange(n)[None, :] < torch.tensor([max(1, n - 2 * i - 1) for i in range(b)])[:, None]
    want = oracle(ctx, v, weight, keep)
    ref = attention_finish_ref(ctx, v, weight, keep)
    monkeypatch.setattr(finish, "attention_finish_ref", None)  # the C++ pass must not fall back
    with torch.inference_mode():
        got = attention_finish(ctx.clone(), v, weight, keep)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_without_norm_or_conv_and_zero_rows():
    ext_or_skip()
    ctx, v, weight = inputs(1, 2, 6, 4, 3)
    ctx[:, :, 2] = 0.0  # a padded query row: stays zero under the norm, as F.normalize leaves it
    with torch.inference_mode():
        torch.testing.assert_close(attention_finish(ctx.clone(), v, None, None), oracle(ctx, v, None, None).float())
        torch.testing.assert_close(attention_finish(ctx.clone(), v, weight, None, normalize=False),
                                   oracle(ctx, v, weight, None, normalize=False).float())
        assert torch.equal(attention_finish(ctx.clone(), v, None, None)[:, :, 2], torch.zeros(1, 2, 4))


def test_fast_path_is_in_place_and_the_reference_path_is_not():
    ext_or_skip()
    ctx, v, weight = inputs(1, 2, 8, 4, 3)
    with torch.inference_mode():
        own = ctx.clone()
        assert attention_finish(own, v, weight, None) is own
        keep = ctx.clone()
        out = attention_finish(keep, v, weight, None, backend="torch")
        assert out is not keep and torch.equal(keep, ctx)


def test_gradients_take_the_pytorch_path_and_reach_the_conv_weight():
    ctx, v, weight = inputs(1, 2, 8, 4, 3)
    weight.requires_grad_(True)
    v.requires_grad_(True)
    attention_finish(ctx, v, weight, None).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0 and v.grad is not None


def test_bit_identical_across_thread_counts():
    ext_or_skip()
    ctx, v, weight = inputs(2, 12, 300, 32, 33)
    keep = torch.arange(300)[None, :] < torch.tensor([300, 170])[:, None]
    before = torch.get_num_threads()
    outs = []
    try:
        with torch.inference_mode():
            for threads in (1, 2, 4):
                torch.set_num_threads(threads)
                outs.append(attention_finish(ctx.clone(), v, weight, keep))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("b,h,n,d,window", [(2, 3, 130, 32, 9), (1, 2, 70, 64, 33), (2, 2, 5, 7, 3), (1, 1, 1, 4, 1)])
def test_bf16_values_give_the_bits_of_their_fp32_copies(b, h, n, d, window):
    """v in bf16 (as the bf16 projections give it) is read as its exact fp32 values: the same bits as its fp32
    copy, with and without the convolution, masked or not, across the task boundaries (64 rows)."""
    ext = ext_or_skip()
    ctx, v, weight = inputs(b, h, n, d, window)
    v16 = v.bfloat16()
    keep = torch.arange(n)[None, :] < torch.tensor([n, max(1, n // 3)][:b])[:, None]
    flat = weight.reshape(h, window).contiguous()
    for w, k in ((flat, keep), (flat, None), (None, keep)):
        got, expected = ctx.clone(), ctx.clone()
        ext.attention_finish(got, v16, w, k, True, 1e-12)
        ext.attention_finish(expected, v16.float(), w, k, True, 1e-12)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("b,h,n,d,window,strided", [(2, 3, 130, 32, 9, True), (1, 2, 70, 64, 33, False),
                                                     (2, 2, 5, 7, 3, True)])
def test_bf16_output_is_the_fp32_result_rounded(b, h, n, d, window, strided, monkeypatch):
    """out_dtype bf16 (what the YOSO core asks for when its values are bf16): the same pass writes each finished
    row rounded as .bfloat16() rounds it, ties to even included, in the fp32 result's layout."""
    ext_or_skip()
    ctx, v, weight = inputs(b, h, n, d, window, strided=strided)
    v16 = v.bfloat16()
    keep = torch.arange(n)[None, :] < torch.tensor([n, max(1, n // 3)][:b])[:, None]
    # a few context rows whose finished values land on bf16 ties: no conv, rows already of unit norm
    with torch.inference_mode():
        want = attention_finish(ctx.clone(), v16, weight, keep)
        monkeypatch.setattr(finish, "attention_finish_ref", None)  # the C++ pass must not fall back
        got = attention_finish(ctx.clone(), v16, weight, keep, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.stride() == want.stride()
        assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16))
        tie = torch.zeros(1, 1, 3, 4)
        tie[..., 0] = 1.0
        tie[0, 0, 1, :2] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])  # halfway: rounds to even
        tie[0, 0, 2, :2] = torch.tensor([-(1.0 + 2.0 ** -8), 2.0 ** -130])  # negative tie, a subnormal
        plain = attention_finish(tie.clone(), tie.bfloat16(), None, None, normalize=False)
        rounded = attention_finish(tie.clone(), tie.bfloat16(), None, None, normalize=False, out_dtype=torch.bfloat16)
        assert torch.equal(rounded.view(torch.int16), plain.bfloat16().view(torch.int16))


def test_bf16_output_on_the_reference_path():
    ctx, v, weight = inputs(1, 2, 8, 4, 3)
    with torch.inference_mode():
        out = attention_finish(ctx.clone(), v, weight, None, backend="torch", out_dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, attention_finish_ref(ctx, v, weight, None).bfloat16())


def test_bad_arguments_name_the_limit():
    ext = ext_or_skip()
    ctx, v, weight = inputs(1, 2, 8, 4, 3)
    with pytest.raises(RuntimeError, match="odd"):
        ext.attention_finish(ctx.clone(), v, torch.zeros(2, 4), None, True, 1e-12)
    with pytest.raises(RuntimeError, match="out16 must have out's shape"):
        ext.attention_finish(ctx.clone(), v, None, None, True, 1e-12, torch.zeros(1, 2, 7, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="keep must be"):
        ext.attention_finish(ctx.clone(), v, None, torch.ones(1, 7, dtype=torch.bool), True, 1e-12)
    with pytest.raises(RuntimeError, match="v must have out's shape"):
        ext.attention_finish(ctx.clone(), v[:, :, :4], None, None, True, 1e-12)
    with pytest.raises(RuntimeError, match="out must be Float, got BFloat16"):
        ext.attention_finish(ctx.bfloat16(), v, None, None, True, 1e-12)


def test_model_with_the_cpp_finish_matches_the_pytorch_path():
    ext_or_skip()
    from yoso_serve.model.config import EncoderConfig
    from yoso_serve.model.encoder import YosoEncoder

    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=96, conv_window=5)
    model = YosoEncoder(config).eval()
    for layer in model.encoder.layer:  # a convolution that contributes (a checkpoint's is trained)
        torch.nn.init.normal_(layer.attention.self.conv.weight, std=0.3)
    ids = torch.randint(5, 64, (3, 40))
    mask = torch.arange(40)[None, :] < torch.tensor([40, 23, 7])[:, None]
    with torch.inference_mode():
        fast = {h: model(ids, mask.long(), hashes=h) for h in (0, 8)}
        for layer in model.encoder.layer:
            layer.attention.self.core.backend = "torch"
        slow = {h: model(ids, mask.long(), hashes=h) for h in (0, 8)}
    for h in (0, 8):
        torch.testing.assert_close(fast[h], slow[h], rtol=1e-4, atol=1e-4)
