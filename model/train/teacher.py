"""The distillation teacher: a plain BERT forward with softmax attention, from weights on disk.

Reads any BERT-family directory (``config.json`` + ``model.safetensors`` or
``pytorch_model.bin``, keys with or without a ``bert.`` prefix) or a
sentence-transformers directory (the transformer in its root or in ``0_Transformer/``,
pooling from ``1_Pooling/config.json``). transformers is never imported: it is a dev
extra, and the runtime must not need it.

Documents longer than the teacher's positions are encoded in overlapping windows
(:meth:`BertTeacher.windowed_hidden`): every token takes its vector from the window in
which it sits farthest from an edge, so each target has the most context the teacher can see.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..encoder import Linear  # oneDNN on CPU at inference: the teacher only ever runs frozen

_ACTS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu}
_PREFIXES = ("bert.", "model.", "roberta.", "encoder_model.")


class _Layer(nn.Module):
    """One post-LN BERT block; parameter names follow transformers' ``BertLayer``."""

    def __init__(self, hidden: int, heads: int, inter: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.query = Linear(hidden, hidden)
        self.attention.self.key = Linear(hidden, hidden)
        self.attention.self.value = Linear(hidden, hidden)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(hidden, hidden)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(hidden, inter)
        self.output = nn.Module()
        self.output.dense = Linear(inter, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        if act not in _ACTS:
            raise ValueError(f"teacher hidden_act must be one of {sorted(_ACTS)}, got {act!r}")
        self.act = _ACTS[act]
        self.act_name = act

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: (B, N, hidden); bias: (B, 1, 1, N) additive mask (0 or -inf-like)."""
        b, n, d = x.shape
        sa = self.attention.self
        # (B, N, hidden) -> (B, heads, N, head_dim)
        q, k, v = (lin(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for lin in (sa.query, sa.key, sa.value))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        ctx = ctx.transpose(1, 2).reshape(b, n, d)  # back to (B, N, hidden)
        x = self.attention.output.LayerNorm(self.attention.output.dense.plus(ctx, x))
        inner = self.intermediate.dense.activated(x, self.act_name, self.act)
        return self.output.LayerNorm(self.output.dense.plus(inner, x))


class BertTeacher(nn.Module):
    """A frozen BERT encoder with softmax attention; ``embed`` pools like the source model."""

    def __init__(self, config: dict, pooling: str = "mean") -> None:
        super().__init__()
        h = config["hidden_size"]
        self.config = config
        self.pooling = pooling
        self.max_positions = int(config["max_position_embeddings"])
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config["vocab_size"], h)
        self.embeddings.position_embeddings = nn.Embedding(self.max_positions, h)
        self.embeddings.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), h)
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=config.get("layer_norm_eps", 1e-12))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            _Layer(h, config["num_attention_heads"], config["intermediate_size"],
                   config.get("layer_norm_eps", 1e-12), config.get("hidden_act", "gelu"))
            for _ in range(config["num_hidden_layers"])
        )

    @classmethod
    def from_dir(cls, path: str | Path, *, device: str | torch.device = "cpu") -> "BertTeacher":
        """Load a BERT-family or sentence-transformers directory (eval mode, no grad)."""
        root = Path(path)
        if not (root / "config.json").is_file() and (root / "0_Transformer" / "config.json").is_file():
            root = root / "0_Transformer"
        if not (root / "config.json").is_file():
            raise ValueError(f"teacher directory {path} has no config.json")
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"teacher position_embedding_type must be 'absolute', got "
                             f"{config['position_embedding_type']!r}")
        teacher = cls(config, pooling=_st_pooling(Path(path)))
        teacher.load_state_dict(_read_weights(root), strict=True)
        return teacher.to(device).eval().requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (B, N) int64, N ≤ max_positions → last hidden state (B, N, hidden) fp32."""
        b, n = input_ids.shape
        if n > self.max_positions:
            raise ValueError(f"teacher input has {n} tokens, more than its max_position_embeddings "
                             f"({self.max_positions}); use windowed_hidden")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        emb = self.embeddings
        pos = torch.arange(n, device=input_ids.device)
        x = emb.word_embeddings(input_ids) + emb.position_embeddings(pos)[None] \
            + emb.token_type_embeddings(torch.zeros_like(input_ids))
        x = emb.LayerNorm(x)
        # finite large negative rather than -inf: a fully padded row must not turn into NaN
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled (B, hidden), not normalised; mean over real tokens or the CLS vector."""
        return pool(self(input_ids, attention_mask), attention_mask, self.pooling)

    def windowed_hidden(self, ids: list[int], *, cls_id: int, sep_id: int, window: int | None = None,
                        stride: int | None = None) -> torch.Tensor:
        """Targets for one wrapped sequence ``[CLS] t1..tn [SEP]`` of any length → (n + 2, hidden).

        Content is cut into windows of ``window - 2`` tokens (each re-wrapped in CLS/SEP)
        starting every ``stride`` tokens (default: half a window, so windows overlap by half).
        CLS takes the first window's CLS, SEP the last window's SEP.
        """
        window = window or self.max_positions
        if window < 3 or window > self.max_positions:
            raise ValueError(f"window must be in 3..{self.max_positions}, got {window}")
        content = ids[1:-1]
        size = window - 2
        stride = stride or max(1, size // 2)
        if stride > size:
            raise ValueError(f"stride ({stride}) must not exceed the window content ({size})")
        n = len(content)
        last = max(0, n - size)
        starts = sorted({*range(0, last, stride), last})
        device = self.embeddings.word_embeddings.weight.device
        batch = torch.tensor([[cls_id, *content[s:s + size], sep_id] for s in starts], device=device)
        hidden = self(batch)  # (W, size + 2, hidden)
        # centrality of content position p in window w: its distance to the nearer window
        # edge, where an edge that is also the document's edge hides no context (infinite)
        p = torch.arange(n, device=device)
        score = torch.full((len(starts), n), -1.0, device=device)
        for w, s in enumerate(starts):
            j = p[s:s + size] - s
            left = j.float() if s > 0 else torch.full_like(j, math.inf, dtype=torch.float)
            right = (size - 1 - j).float() if s + size < n else torch.full_like(j, math.inf, dtype=torch.float)
            score[w, s:s + size] = torch.minimum(left, right)
        best = score.argmax(0)  # (n,) window index per content position
        out = hidden.new_empty(n + 2, hidden.shape[-1])
        out[1:n + 1] = hidden[best, p - torch.tensor(starts, device=device)[best] + 1]
        out[0] = hidden[0, 0]
        out[n + 1] = hidden[-1, n - starts[-1] + 1]
        return out


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden: (B, N, D), attention_mask: (B, N) → (B, D) mean over real tokens, or position 0."""
    if pooling == "cls":
        return hidden[:, 0]
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, N, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def _st_pooling(root: Path) -> str:
    cfg = root / "1_Pooling" / "config.json"
    if not cfg.is_file():
        return "mean"
    data = json.loads(cfg.read_text(encoding="utf-8"))
    return "cls" if data.get("pooling_mode_cls_token") else "mean"


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    if (root / "model.safetensors").is_file():
        from safetensors.torch import load_file

        raw = load_file(str(root / "model.safetensors"))
    elif (root / "pytorch_model.bin").is_file():
        raw = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"teacher directory {root} has neither model.safetensors nor pytorch_model.bin")
    out = {}
    for key, value in raw.items():
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key.startswith(("embeddings.", "encoder.")) and not key.endswith("position_ids"):
            out[key] = value.float()
    return out
