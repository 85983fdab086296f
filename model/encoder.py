"""The YOSO encoder: embeddings and post-LayerNorm BERT blocks whose attention is YOSO (or another core).

Module and parameter names follow transformers' ``YosoModel`` so that state dicts match
key for key (``embeddings.word_embeddings.weight``, ``encoder.layer.3.attention.self.query.weight``,
``encoder.layer.3.attention.self.conv.weight`` ...). Two deliberate differences from
transformers' code: padding is really masked (a key-padding mask reaches the attention op,
padded queries give zero rows), so a text's output is the same alone or padded inside a
batch; and the hash projections are seeded per (config.hash_seed, layer), so outputs are
deterministic for a given hash count, which is chosen per call.

The attention between the Q/K/V linears and the output projection is a core picked from
``config.attention_type`` through the registry in :mod:`.attention` (YOSO by default; softmax,
Linformer, Reformer, linear, sparse, Nyström otherwise). ``hashes`` belongs to YOSO alone: a
model of another type accepts ``hashes=None`` or ``0`` (its default_hashes, "no hashing") and
raises ValueError for any other count, rather than silently ignoring a request for a
cost/accuracy trade-off it does not have. ``config.reversible`` runs the stack as Reformer's
reversible layers (:mod:`.reversible`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.kernels import sum_parts

from .attention import build_attention
from .config import EncoderConfig
from .dense_int8 import int8_feed_forward, int8_linear, int8_weights, project, smooth_int8
from .hashes import resolve_hashes
from .reversible import ReversibleBlock, reversible_stack

# Position ids start here, as in transformers' YOSO (rows 0 and 1 of the table are unused).
POSITION_OFFSET = 2


def activation(name: str):
    """The activation function named by ``hidden_act`` (transformers' names)."""
    tanh_gelu = functools.partial(F.gelu, approximate="tanh")  # a partial, not a lambda: picklable
    table = {"gelu": F.gelu, "gelu_new": tanh_gelu, "gelu_pytorch_tanh": tanh_gelu, "gelu_fast": tanh_gelu,
             "relu": F.relu, "silu": F.silu, "swish": F.silu, "tanh": torch.tanh}
    if name not in table:
        raise ValueError(f"hidden_act must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _onednn_linear():
    """oneDNN's fp32 linear (the op torch's own CPU compiler emits), or None where this torch lacks it."""
    try:
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = _onednn_linear()


# The longest K one bf16 GEMM call takes (Linear's bf16 path): measured on a Xeon with AMX (torch 2.13.0,
# 2 threads), K 384 gave every row the same bits at any row count from 1 to 1100, while K 768 and 1536 gave
# three or four different roundings by row count (AVX512-BF16 without AMX: the same bits from 2 rows up).
BF16_K_BLOCK = 384

# Activations oneDNN applies inside the GEMM with aten's exact formula (bit-identical outputs; its tanh
# GELU differs from aten's by up to 1.5e-4 relative, so those stay a separate pass).
FUSED_ACTIVATIONS = {"gelu": ("gelu", "none"), "relu": ("relu", "")}


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX-BF16: Zen 4, Cooper Lake, Sapphire
    Rapids and later), where oneDNN's bf16 GEMM runs about twice as fast as fp32 (bench/linear.py). Read
    from /proc/cpuinfo's flags; False where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose inference forward on CPU in fp32
    runs oneDNN's GEMM instead of aten's BLAS call, optionally with the activation or the residual
    add applied in the GEMM's epilogue. Same precision (fp32 products and sums, no reduced-precision
    mode), results within fp32 rounding of aten's, and row-independent as aten's (a text's rows give
    the same bits alone or in a batch). Why: on an AMD EPYC (Zen 4, 2 cores) the MKL sgemm behind aten
    ran the model's shapes at 87–154 GFLOP/s and oneDNN at 120–185 (bench/linear.py); these GEMMs are
    ~75 % of a short-text forward, and the separate GELU pass over the (rows, 1536) output another ~20 %. Anything
    with a gradient, another device or dtype, and tracing or export (ONNX) take the plain ``F.linear``.

    With ``bf16`` set (:func:`set_dense_dtype`; the server's ``--dense-dtype``), that same inference path
    multiplies in bf16 (oneDNN, fp32 accumulation) with a bf16 copy of the weights: inputs and outputs are
    rounded to bf16, outputs come back as fp32 (the residual add of :meth:`plus` in fp32), except those of
    :meth:`activated` and :meth:`bf16_product`, which stay bf16 for readers that take bf16. About 1.7x the GEMM
    speed where the CPU has bf16 instructions (:func:`native_bf16`); the model's outputs move by about
    1e-3 relative (docs/benchmarks.md, "bf16 GEMMs").

    A bf16 GEMM whose inputs are longer than :data:`BF16_K_BLOCK` runs as GEMMs over K-blocks of that
    length, their bf16 outputs summed in fp32 in a fixed order: with AMX, oneDNN blocks a longer K by the
    number of rows, so a row's bits depended on what else was in the batch; over one block they do not."""

    bf16 = False  # per instance: set_dense_dtype
    int8 = False  # per instance: set_dense_dtype (model/dense_int8.py)
    int8_smooth: torch.Tensor | None = None  # per instance: dense_int8.smooth_int8 (x / smooth, W · smooth)

    def _fast(self, x: torch.Tensor) -> bool:
        return (ONEDNN_LINEAR is not None and x.device.type == "cpu"
                and (x.dtype == torch.float32 or (self.bf16 and x.dtype == torch.bfloat16))
                and self.weight.dtype == torch.float32 and x.dim() >= 2
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export()
                and not torch.compiler.is_compiling())

    def _operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, weight, bias) for oneDNN: as they are, or in bf16 with the weights' bf16 copy (made again
        whenever the fp32 weights changed)."""
        if not self.bf16:
            return x, self.weight, self.bias
        key = (self.weight._version, self.weight.data_ptr(),
               None if self.bias is None else (self.bias._version, self.bias.data_ptr()))
        if getattr(self, "_bf16_key", None) != key:
            weight = self.weight.detach().bfloat16()
            if self.in_features > BF16_K_BLOCK:  # one contiguous weight block per K-block
                weight = [w.contiguous() for w in weight.split(BF16_K_BLOCK, dim=1)]
            self._bf16 = (weight, None if self.bias is None else self.bias.detach().bfloat16())
            self._bf16_key = key
        return x.bfloat16(), *self._bf16

    def _int8(self, x: torch.Tensor, start: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
        """The int8 product, weights quantized again whenever they or the smoothing vector changed."""
        weight_q, weight_scale = int8_weights(self)
        return int8_linear(x.float(), weight_q, weight_scale, self.bias, smooth=self.int8_smooth, start=start,
                           gelu=gelu)

    def _gemm(self, x: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """``self(x)`` on oneDNN, fp32 out, plus ``start`` (fp32) if given: one GEMM, or in bf16 over a K longer
        than BF16_K_BLOCK one GEMM per K-block, their bf16 outputs summed in fp32 in order after ``start``."""
        if self.int8:
            return self._int8(x, start)
        x, weight, bias = self._operands(x)
        if not isinstance(weight, list):
            out = ONEDNN_LINEAR(x, weight, bias, "none", [], "")
            return out.float() if start is None else sum_parts([out], start)
        return sum_parts([ONEDNN_LINEAR(xj, wj, bias if j == 0 else None, "none", [], "")
                          for j, (xj, wj) in enumerate(zip(x.split(BF16_K_BLOCK, dim=-1), weight))], start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast(x):
            return self._gemm(x)
        return F.linear(x, self.weight, self.bias)

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` in bf16 mode as the GEMM's own bf16 output (same values, half the bytes); fp32 if K-blocked."""
        x, weight, bias = self._operands(x)
        return self._gemm(x) if isinstance(weight, list) else ONEDNN_LINEAR(x, weight, bias, "none", [], "")

    def activated(self, x: torch.Tensor, name: str, act) -> torch.Tensor:
        """``act(self(x))``, where ``act`` is the activation ``hidden_act`` = ``name`` names (bf16 in bf16 mode)."""
        if self.int8 and self._fast(x):  # exact GELU fused into the int8 epilogue; others after it
            return self._int8(x, gelu=True) if name == "gelu" else act(self._gemm(x))
        if name in FUSED_ACTIVATIONS and self._fast(x):
            if self.bf16 and self.in_features > BF16_K_BLOCK:  # K-blocked: the sum first, then the activation
                return act(self._gemm(x)).bfloat16()
            attr, algorithm = FUSED_ACTIVATIONS[name]
            return ONEDNN_LINEAR(*self._operands(x), attr, [], algorithm)
        return act(self(x))

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) + other`` (``other`` shaped like the output; fp32 out)."""
        if self._fast(x) and other.shape == (*x.shape[:-1], self.out_features) and other.dtype == torch.float32:
            if self.bf16 or self.int8:  # the residual stream stays fp32: only the GEMM's output is rounded
                return self._gemm(x, start=other)
            return ONEDNN_LINEAR.binary(x, other, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + other


DENSE_DTYPES = ("fp32", "bf16", "int8")


def set_dense_dtype(module: nn.Module, dtype: str) -> None:
    """Run the CPU inference GEMMs of every :class:`Linear` in ``module`` in ``dtype`` ("fp32", "bf16" or "int8")."""
    if dtype not in DENSE_DTYPES:
        raise ValueError(f"dense dtype must be one of {DENSE_DTYPES}, got {dtype!r}")
    for m in module.modules():
        if isinstance(m, Linear):
            m.bf16, m.int8 = dtype == "bf16", dtype == "int8"
    if dtype == "int8":
        smooth_int8(module)


def layer_seed(hash_seed: int, layer_index: int) -> int:
    """Seed of one layer's hash projections: distinct per layer (< 65536 layers), fixed per model."""
    return (int(hash_seed) << 16) + int(layer_index)


class YosoEmbeddings(nn.Module):
    """Word + position (offset 2) + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.max_positions = config.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, N) int64, token_type_ids (B, N) int64 or None → (B, N, hidden)."""
        n = input_ids.shape[1]
        if n > self.max_positions:
            raise ValueError(f"sequence length {n} exceeds max_position_embeddings ({self.max_positions})")
        # Right padding is assumed: position i of every row is token i of its text.
        positions = torch.arange(POSITION_OFFSET, n + POSITION_OFFSET, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)[None]
        return self.dropout(self.LayerNorm(x))


def yoso_conv(heads: int, window: int) -> nn.Conv2d:
    """YOSO-C: depthwise along the sequence, one (window × 1) kernel per head (transformers' shape and key)."""
    return nn.Conv2d(heads, heads, kernel_size=(window, 1), padding=(window // 2, 0), bias=False, groups=heads)


class YosoSelfAttention(nn.Module):
    """Q/K/V projections, the attention core (YOSO: with N-YOSO's norm), optional YOSO-C conv."""

    def __init__(self, config: EncoderConfig, layer_index: int):
        super().__init__()
        self.config = config
        self.heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = Linear(config.hidden_size, config.hidden_size)
        self.key = Linear(config.hidden_size, config.hidden_size)
        self.value = Linear(config.hidden_size, config.hidden_size)
        # parameter-free for yoso, so the state-dict keys stay transformers'
        self.core = build_attention(config, layer_seed(config.hash_seed, layer_index))
        self.conv = yoso_conv(self.heads, config.conv_window) if config.conv_window is not None else None

    @property
    def seed(self) -> int:
        """The layer's hash seed; setting it re-points YOSO's hashing (the distiller resamples per step)."""
        return self.core.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self.core.seed = int(value)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.head_dim).transpose(1, 2)  # (B, H, N, d)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None, hashes: int,
                bf16_context: bool = False) -> torch.Tensor:
        """hidden (B, N, hidden), mask (B, N) bool or None, hashes ≥ 0 (0 = exact) → (B, N, hidden); with
        ``bf16_context`` (its reader rounds it anyway) a core that ``reads_bf16`` gets bf16 Q/K/V, gives bf16."""
        bf16 = bf16_context and self.core.reads_bf16()
        q, k, v = (self.split_heads(t) for t in project([self.query, self.key, self.value], hidden, bf16_out=bf16))
        if self.core.uses_hashes:  # YOSO; its core also adds the YOSO-C convolution (one pass on CPU)
            context = self.core(q, k, v, mask, hashes=hashes, conv=self.conv)  # (B, H, N, d)
        else:  # config validation keeps YOSO-C (conv_window) to attention_type yoso
            context = self.core(q, k, v, mask)
        b, _, n, _ = context.shape
        return context.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)  # (B, N, hidden)


class DenseResidual(nn.Module):
    """dense → dropout → LayerNorm(· + residual): the output half of BERT's sub-blocks."""

    def __init__(self, d_in: int, config: EncoderConfig):
        super().__init__()
        self.dense = Linear(d_in, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.dropout.p == 0 or not self.training:  # the add inside the GEMM where it can be
            return self.LayerNorm(self.dense.plus(x, residual))
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class YosoAttention(nn.Module):
    def __init__(self, config: EncoderConfig, layer_index: int):
        super().__init__()
        self.self = YosoSelfAttention(config, layer_index)
        self.output = DenseResidual(config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None, hashes: int) -> torch.Tensor:
        bf16 = self.output.dense.bf16 and not self.output.dense.int8  # the output GEMM rounds the context to bf16
        return self.output(self.self(hidden, mask, hashes, bf16_context=bf16), hidden)


class YosoIntermediate(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.act_name = config.hidden_act
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense.activated(x, self.act_name, self.act)


class YosoLayer(nn.Module):
    """Attention block then feed-forward block, the latter chunked along the sequence when long."""

    def __init__(self, config: EncoderConfig, layer_index: int):
        super().__init__()
        self.config = config
        self.attention = YosoAttention(config, layer_index)
        self.intermediate = YosoIntermediate(config)
        self.output = DenseResidual(config.intermediate_size, config)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = int8_feed_forward(self.intermediate, self.output, x)  # in int8: GELU's output quantized as it comes
        return self.output(self.intermediate(x), x) if fused is None else fused

    def chunked(self, fn, x: torch.Tensor) -> torch.Tensor:
        """fn over x (B, N, hidden), in sequence chunks when long (see EncoderConfig.ffn_chunk_size)."""
        chunk = self.config.ffn_chunk_size(x.shape[1])
        if not chunk or x.shape[1] <= chunk:
            return fn(x)
        # Position-wise, so chunks give the same numbers with a bounded (B, chunk, intermediate) peak.
        return torch.cat([fn(part) for part in x.split(chunk, dim=1)], dim=1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None, hashes: int) -> torch.Tensor:
        return self.chunked(self.feed_forward, self.attention(hidden, mask, hashes))

    def attention_branch(self, x: torch.Tensor, mask: torch.Tensor | None, hashes: int) -> torch.Tensor:
        """Reversible F(x): the attention sub-block's residual branch, LayerNorm first (pre-LN)."""
        out = self.attention.output
        return out.dropout(out.dense(self.attention.self(out.LayerNorm(x), mask, hashes)))

    def feed_forward_branch(self, x: torch.Tensor) -> torch.Tensor:
        """Reversible G(x): the feed-forward sub-block's residual branch, LayerNorm first (pre-LN)."""
        out = self.output
        return self.chunked(lambda part: out.dropout(out.dense(self.intermediate(out.LayerNorm(part)))), x)


class YosoLayerStack(nn.Module):
    """The ``encoder.layer.N`` stack (a separate module so the state-dict keys match transformers')."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.layer = nn.ModuleList([YosoLayer(config, i) for i in range(config.num_hidden_layers)])

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None, hashes: int, *,
                memory_saving: bool = True) -> torch.Tensor:
        """hidden (B, N, hidden) → (B, N, hidden); ``memory_saving`` only matters for reversible stacks."""
        if self.layer and self.layer[0].config.reversible:
            blocks = [ReversibleBlock(functools.partial(layer.attention_branch, mask=mask, hashes=hashes),
                                      layer.feed_forward_branch) for layer in self.layer]
            return reversible_stack(blocks, hidden, memory_saving=memory_saving)
        for layer in self.layer:
            hidden = layer(hidden, mask, hashes)
        return hidden


class YosoEncoder(nn.Module):
    """Embeddings + YOSO layers → last hidden states (transformers' ``YosoModel`` without its quirks)."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = YosoEmbeddings(config)
        self.encoder = YosoLayerStack(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # BERT's initialisation, so that a model built from a config alone is a sensible start.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])

    def resolve_hashes(self, hashes: int | None) -> int:
        """The hash count of a call: ``None`` → config.default_hashes; the rules are model/hashes.py's
        (an int ≥ 0; another attention_type takes None or 0)."""
        return resolve_hashes(self.config, hashes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, *, hashes: int | None = None) -> torch.Tensor:
        """input_ids (B, N) int64, attention_mask (B, N) 0/1 or bool (1 = real token) → (B, N, hidden)."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (B, N) with N >= 1, got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        mask = None if attention_mask is None else attention_mask.bool()
        hidden = self.embeddings(input_ids, token_type_ids)
        return self.encoder(hidden, mask, self.resolve_hashes(hashes))
