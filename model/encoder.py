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

import torch
from torch import nn

from .attention import build_attention
from .config import EncoderConfig
from .dense_int8 import int8_feed_forward, project
from .hashes import resolve_hashes
from .linear import Linear, activation, packed_side_by_side
from .reversible import ReversibleBlock, reversible_stack

# Position ids start here, as in transformers' YOSO (rows 0 and 1 of the table are unused).
POSITION_OFFSET = 2


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
        qkv = [self.query, self.key, self.value]
        q, k, v = (self.split_heads(t) for t in packed_side_by_side(qkv, hidden) or project(qkv, hidden, bf16_out=bf16))
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
            return self.dense.plus(x, residual, self.LayerNorm)  # int8: the norm in the pass after the GEMM
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class YosoAttention(nn.Module):
    def __init__(self, config: EncoderConfig, layer_index: int):
        super().__init__()
        self.self = YosoSelfAttention(config, layer_index)
        self.output = DenseResidual(config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None, hashes: int) -> torch.Tensor:
        # the output GEMM rounds the context to bf16, or in int8 to 8 bits a row: a bf16 context costs next to nothing
        bf16 = self.output.dense.bf16 or self.output.dense.int8
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
