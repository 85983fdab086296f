"""Int8 dense layers on CPU (``--dense-dtype int8``): per-output-channel int8 weights, activations quantized
per row as they come, products through oneDNN's int8 GEMM (int32 sums); the arithmetic
is :func:`yoso_serve.kernels.int8_linear`.

The layers fed by a LayerNorm (Q, K, V, FFN in) are smoothed (SmoothQuant's migration): in those inputs a few
fixed channels stand 5-18x above the rest and set every row's int8 step, so the other channels keep few levels
(docs/benchmarks.md, "int8 GEMMs"). The input is divided per channel by ``s`` and the weight's columns multiplied by
it, which leaves the product unchanged and moves part of the channel's range into the weights, quantized per output
channel. Each channel's range is calibrated once, when int8 is switched on, by an fp32 forward over seeded random
tokens: the channels that stand out do so for any text (random tokens gave the same gain as documentation text,
bench/int8_layers.py). ``s`` is rounded to a power of two, so dividing and multiplying by it are exact and a
last-bit difference in the calibration between machines almost never changes it.

On the AVX2 route (u8 × s8, kernels/dense_int8.py) FFN out's input, GELU's output, is shifted (:func:`shift_of`): it
never goes below -0.17, so each row plus 0.17 is quantized to [0, 127] rather than symmetrically, which lets that
layer keep ±127 weights there (±63 otherwise); the bias takes ``-0.17 · W.sum(1)`` back out. With VNNI the weights
are ±127 anyway and the symmetric rows keep the finer step (max / 127, not (max + 0.17) / 127), so no shift."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from yoso_serve.kernels import LayerNormArgs, int8_gemm, int8_linear, int8_linear_rows, int8_rows, weight_levels

from .derived import derived

SMOOTH_ALPHA = 0.5  # how much of a channel's range moves into the weights (SmoothQuant's α)
CALIBRATION = (16, 64, 0)  # texts, tokens each, seed of the random tokens the ranges are read from
GELU_SHIFT = 0.17  # the exact GELU's minimum is -0.16997 (at x = -0.7518)


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None,
                    levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) fp32, times ``smooth`` (in,) per input channel if given → (int8 (out, in), scale (out,)
    fp32): symmetric, one scale per output channel, to ±``levels``, by default ±127 or ±63 as the CPU's int8 GEMM
    takes them (:func:`yoso_serve.kernels.weight_levels`)."""
    w = weight.detach().float() if smooth is None else weight.detach().float() * smooth
    q, scale = int8_rows(w, levels or weight_levels())
    return q, scale[:, 0]


def int8_weights(lin: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weight_q, weight_scale, bias) for :func:`yoso_serve.kernels.int8_linear`: ``lin``'s weights times its
    smoothing vector, quantized (:func:`quantize_weight`; ±127 where its input is shifted), and its bias, less
    ``shift · (W · smooth).sum(1)`` where it is (:func:`shift_of`); kept on ``lin`` until the weights, the bias, the
    vector, the shift or the GEMM's route change."""
    shift = shift_of(lin)
    levels = 127 if shift is not None else weight_levels()

    def make():
        weight_q, weight_scale = quantize_weight(lin.weight, lin.int8_smooth, levels)
        bias = None if lin.bias is None else lin.bias.detach().float()
        if shift is not None:
            w = lin.weight.detach().float()
            w = w if lin.int8_smooth is None else w * lin.int8_smooth
            bias = -shift * w.sum(dim=1) + (0 if bias is None else bias)
        return weight_q, weight_scale, bias

    return derived(lin, "_int8_weight", [lin.weight, lin.bias, lin.int8_smooth], make, levels, shift)


def shift_of(lin: nn.Linear) -> float | None:
    """The shift ``lin``'s int8 input takes: its ``int8_shift`` (:func:`shift_int8`) on the u8 route, else None."""
    return lin.int8_shift if int8_gemm() == "u8s8" else None


def shift_int8(model: nn.Module) -> None:
    """Mark FFN out of every block whose FFN in ends in the exact GELU with its input's floor (:data:`GELU_SHIFT`:
    the shift it takes on the u8 route, :func:`shift_of`), and unmark it elsewhere."""
    for m in model.modules():
        inner, outer = getattr(m, "intermediate", None), getattr(m, "output", None)
        dense = getattr(outer, "dense", None)
        if inner is not None and hasattr(dense, "int8_shift"):
            dense.int8_shift = GELU_SHIFT if getattr(inner, "act_name", None) == "gelu" else None


def norm_fed(model: nn.Module) -> Iterator[tuple[nn.Module, list[tuple[nn.LayerNorm, list[nn.Linear]]]]]:
    """(encoder, [(LayerNorm, the linears its output feeds)]) of each post-LN BERT-shaped stack in ``model``: the
    embeddings' norm and each block's output norm feed the next block's Q, K, V; a block's attention norm feeds
    its FFN in. Reversible (pre-LN) stacks are left out."""
    for m in model.modules():
        stack = getattr(getattr(m, "encoder", None), "layer", None)
        if getattr(m, "embeddings", None) is None or not stack or stack[0].config.reversible:
            continue
        norms = [m.embeddings.LayerNorm, *(layer.output.LayerNorm for layer in stack)]
        pairs = []
        for norm, layer in zip(norms, stack):
            attn = layer.attention.self
            pairs += [(norm, [attn.query, attn.key, attn.value]),
                      (layer.attention.output.LayerNorm, [layer.intermediate.dense])]
        yield m, pairs


def input_ranges(encoder: nn.Module, norms: list[nn.LayerNorm]) -> dict[nn.LayerNorm, torch.Tensor]:
    """Each of ``norms``' largest |output| per channel over an fp32, exact-mode forward of ``encoder`` on
    CALIBRATION's seeded random tokens (the linears' dense dtype is set aside meanwhile)."""
    texts, tokens, seed = CALIBRATION
    vocab = encoder.config.vocab_size
    ids = torch.randint(min(1000, vocab // 2), vocab, (texts, tokens), generator=torch.Generator().manual_seed(seed))
    ranges: dict[nn.LayerNorm, torch.Tensor] = {}

    def record(norm, _inputs, out):
        ranges[norm] = out.detach().float().reshape(-1, out.shape[-1]).abs().amax(dim=0)

    saved = {m: (m.bf16, m.int8) for m in encoder.modules() if hasattr(m, "int8")}
    hooks = [norm.register_forward_hook(record) for norm in norms]
    try:
        for m in saved:
            m.bf16 = m.int8 = False
        with torch.inference_mode():
            encoder(ids, hashes=0)
    finally:
        for hook in hooks:
            hook.remove()
        for m, (bf16, int8) in saved.items():
            m.bf16, m.int8 = bf16, int8
    return ranges


def smoothing(x_range: torch.Tensor, linears: list[nn.Linear], alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-channel ``s = max|x|^α / max|W|^(1-α)``, max|W| over every linear reading the input,
    rounded to a power of two."""
    w_max = torch.stack([lin.weight.detach().float().abs().amax(dim=0) for lin in linears]).amax(dim=0)
    s = x_range.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    return torch.exp2(torch.round(torch.log2(s.clamp_min(1e-5)))).contiguous()


def smooth_int8(model: nn.Module, alpha: float = SMOOTH_ALPHA, *, again: bool = False) -> None:
    """Give every LayerNorm-fed linear of ``model`` its smoothing vector (``Linear.int8_smooth``), calibrated
    once per model: a stack whose linears have theirs is left as it is unless ``again``."""
    for encoder, pairs in norm_fed(model):
        if not again and all(lin.int8_smooth is not None for _, group in pairs for lin in group):
            continue
        ranges = input_ranges(encoder, [norm for norm, _ in pairs])
        for norm, group in pairs:
            s = smoothing(ranges[norm], group, alpha)
            for lin in group:
                lin.int8_smooth = s


def project(linears: list[nn.Linear], x: torch.Tensor, *, bf16_out: bool = False) -> list[torch.Tensor]:
    """``[lin(x) for lin in linears]``; in int8, where all of them read ``x`` with one smoothing vector (Q, K, V),
    as one product: ``x`` quantized once and one GEMM over their weights side by side, the outputs views of it.
    The same bits as one at a time (a row's quantization and each output channel's sum do not change); with
    ``bf16_out`` rounded to bf16 as they are scaled back (a reader of bf16 takes half the bytes). In bf16,
    ``x`` is rounded to bf16 once for all of them (each would round it alike), and with ``bf16_out`` the outputs
    are the GEMMs' own bf16 results (``Linear.bf16_product``: the same values, no fp32 copies)."""
    first = linears[0]
    if all(lin.bf16 and not lin.int8 for lin in linears) and first._fast(x):
        x = x.bfloat16()
        if bf16_out:
            return [lin.bf16_product(x) for lin in linears]
    if (not (all(lin.int8 for lin in linears) and first._fast(x)) or len({lin.bias is None for lin in linears}) > 1
            or any(lin.int8_smooth is not first.int8_smooth or lin.int8_shift is not None for lin in linears)):
        return [lin(x) for lin in linears]
    parts = [int8_weights(lin) for lin in linears]
    key = tuple(id(q) for q, _, _ in parts)  # the cache holds the parts: their ids are not reused
    if getattr(first, "_int8_fused_key", None) != key:
        bias = None if first.bias is None else torch.cat([b for _, _, b in parts])
        first._int8_fused = (torch.cat([q for q, _, _ in parts]), torch.cat([s for _, s, _ in parts]), bias, parts)
        first._int8_fused_key = key
    weight_q, weight_scale, bias, _ = first._int8_fused
    out = int8_linear(x.float(), weight_q, weight_scale, bias, smooth=first.int8_smooth,
                      out_dtype=torch.bfloat16 if bf16_out else torch.float32)
    return list(out.split([lin.out_features for lin in linears], dim=-1))


def int8_feed_forward(intermediate: nn.Module, output: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A block's feed-forward, ``output(intermediate(x), x)``, where both linears run in int8 at inference: the
    GELU output is quantized for FFN out in the pass that scales FFN in's sums back, the bits of the two passes
    without the (rows, intermediate) fp32 tensor between them. None where that does not apply (another dtype or
    activation, FFN out smoothed, training, or the C++ passes not built): the caller runs the block as it is."""
    inner, outer = intermediate.dense, output.dense
    if not (inner.int8 and outer.int8 and outer.int8_smooth is None and intermediate.act_name == "gelu"
            and not output.training and inner._fast(x)):
        return None
    rows = int8_linear_rows(x, *int8_weights(inner), smooth=inner.int8_smooth, gelu=True, shift=shift_of(outer))
    if rows is None:
        return None
    norm = LayerNormArgs.of(output.LayerNorm)  # applied as the sums are scaled back
    out = int8_linear(rows, *int8_weights(outer), start=x, norm=norm)
    return out if norm is not None else output.LayerNorm(out)
