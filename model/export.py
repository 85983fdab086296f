"""ONNX export of a YOSO encoder: embedding and classification heads, dynamic batch and sequence.

The attention is rewritten with standard operators so that any ONNX runtime can run it:

* hash codes — ``MatMul`` of q̂ / k̂ with the seeded projections (stored as initializers, built by
  :mod:`yoso_serve.kernels.hashing`, so the codes are PyTorch's), ``Greater`` for the sign bits and ``Mul`` + ``ReduceSum`` with ``[1, 2, 4, …]`` for the weighted
  sum of bits;
* bucket cumulation — one table per (batch·head, hash): keys are added into their bucket's row with
  ``ScatterND(reduction="add")`` and queries read their row back with ``Gather``; padded keys add
  zeros and padded queries are zeroed, which is what the kernel's sink row does;
* exact mode (YOSO-E) — ``MatMul``, ``Acos``, ``Pow``: the dense expectation, O(N²) memory.

The hash count is fixed at export time (written to config.json's ``onnx`` section) because it sets
the graph's shapes and initializers; its command line, ``yoso-train export-onnx``, is model/train/export_onnx.py. The out directory holds ``model.onnx``, ``config.json`` and the
tokenizer files: :class:`yoso_serve.model.onnx_runtime.OnnxEncoderModel` serves it.
The graph is torch's TorchScript exporter's, which needs the ``onnx`` package to write the file;
``onnxruntime`` is only needed to run the result.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.kernels.finish import attention_finish_ref
from yoso_serve.kernels.hashing import projection_planes, quantize_rows

from .checkpoint import check_out_dir, load_pretrained
from .encoder import YosoSelfAttention
from .hashes import MAX_HASHES, resolve_hashes
from .encoder_model import EncoderModel

ONNX_FILE = "model.onnx"
DEFAULT_OPSET = 17  # ScatterND's add reduction needs ≥ 16; 17 adds LayerNormalization
try:  # the TorchScript exporter (dynamo=False, used below) stops below torch.onnx's own maximum
    from torch.onnx._constants import ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET as MAX_OPSET
except ImportError:
    MAX_OPSET = 20  # torch 2.13's value
INPUT_NAMES = ("input_ids", "attention_mask")
# Floats of one (batch·head) bucket table: hashes are cumulated in groups whose tables fit this.
_TABLE_BUDGET = 1 << 20


class ScatterAddRowsFn(torch.autograd.Function):
    """table[rows[i]] += updates[i]; exported as ``ScatterND(reduction="add")``.

    forward(table, rows, updates): table (T, D) fp32, rows (L, 1) int64 in [0, T), updates (L, D)
    fp32 → (T, D) fp32. Repeated rows all add (torch's index_put with accumulate exports to a
    ScatterND without reduction, which keeps only one of them — hence this function).
    """

    @staticmethod
    def forward(ctx, table, rows, updates):
        return table.index_add(0, rows.view(-1), updates)

    @staticmethod
    def symbolic(g, table, rows, updates):
        return g.op("ScatterND", table, rows, updates, reduction_s="add")


def hash_codes_onnx(x_hat: torch.Tensor, projection: torch.Tensor, hash_bits: int, int8: bool = False) -> torch.Tensor:
    """x_hat (B, H, N, D) fp32 rows, projection (H, D, m·τ) fp32 → codes (B, H, N, m) int64.

    The codes of :func:`yoso_serve.kernels.hash_codes` (its oracle) for the same projection, left in
    (B, H, N, m) order: the cumulation below indexes them that way, so no transpose is needed. int8:
    ``projection`` holds the int8 planes and the rows are quantized first (ReduceMax, Div, Round).
    """
    b, h, n, _ = x_hat.shape
    scores = torch.matmul(quantize_rows(x_hat) if int8 else x_hat, projection)  # (B, H, N, m·τ)
    bits = (scores > 0).to(torch.float32).view(b, h, n, -1, hash_bits)  # (B, H, N, m, τ)
    weights = torch.tensor([float(1 << t) for t in range(hash_bits)])  # sums ≤ 2^16: exact in fp32
    # Mul + ReduceSum, not a MatMul with a (τ,) vector: runtimes run that as millions of tiny GEMMs.
    return (bits * weights).sum(dim=-1).to(torch.int64)  # (B, H, N, m)


def lsh_cumulate_onnx(q_codes: torch.Tensor, k_codes: torch.Tensor, v: torch.Tensor, hash_bits: int,
                      group: int) -> torch.Tensor:
    """Bucket cumulation averaged over hashes, without masks (padded rows of v are already zero).

    q_codes, k_codes: (BH, N, m) int64; v: (BH, N, D) fp32 → (BH, N, D) fp32:
    out[i] = (1/m) Σ_h Σ_j [k_codes[j, h] == q_codes[i, h]] v[j]. Oracle: kernels' lsh_cumulate.
    Hashes run ``group`` at a time, one (BH·group·2^τ, D) table per group.
    """
    bh, n, m = k_codes.shape
    d = v.shape[2]
    rows = 1 << hash_bits
    out = None
    for start in range(0, m, group):
        g = min(group, m - start)
        offsets = torch.arange(bh * g).view(bh, 1, g) * rows  # one table block per (batch·head, hash)
        k_rows = (k_codes[:, :, start : start + g] + offsets).reshape(-1, 1)  # (BH·N·g, 1)
        updates = v[:, :, None].expand(bh, n, g, d).reshape(-1, d)  # (BH·N·g, D)
        table = ScatterAddRowsFn.apply(v.new_zeros(bh * g * rows, d), k_rows, updates)
        picked = table[(q_codes[:, :, start : start + g] + offsets).reshape(-1)]  # (BH·N·g, D)
        part = picked.view(bh, n, g, d).sum(dim=2)
        out = part if out is None else out + part
    return out / m


def exact_cumulate_onnx(q_hat: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                        hash_bits: int) -> torch.Tensor:
    """YOSO-E: q_hat, k_hat (BH, N, D) unit rows, v (BH, N, D), keep (BH, N) 0/1, all fp32 → (BH, N, D).

    out = ((1 − arccos(q̂·k̂)/π)^τ ⊙ keep_k)·v ⊙ keep_q. Oracle: kernels' YosoExactFn.
    """
    cosine = torch.matmul(q_hat, k_hat.transpose(1, 2)).clamp(-1.0, 1.0)  # (BH, N, N)
    weights = (1.0 - torch.arccos(cosine) / math.pi) ** hash_bits * keep[:, None, :]
    return torch.matmul(weights, v) * keep[:, :, None]


class OnnxSelfAttention(nn.Module):
    """A :class:`YosoSelfAttention` (weights shared, not copied) with the traceable attention above.

    The layer's projections for ``hashes`` hashes are a buffer, so they become graph initializers.
    """

    def __init__(self, attention: YosoSelfAttention, hashes: int):
        super().__init__()
        config = attention.config
        self.attention = attention
        self.hashes = hashes
        self.hash_bits = config.hash_code_len
        if hashes:
            self.int8 = bool(config.hash_int8)
            projection = projection_planes(attention.seed, attention.heads, hashes, self.hash_bits, attention.head_dim,
                                     bool(config.use_fast_hash), torch.device("cpu"), self.int8)
            self.register_buffer("projection", projection.clone())  # (H, D, m·τ): an initializer
            self.group = max(1, min(hashes, _TABLE_BUDGET // ((1 << self.hash_bits) * attention.head_dim)))

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """hidden (B, N, hidden) fp32, keep (B, N) fp32 0/1 → (B, N, hidden) fp32."""
        att = self.attention
        q_raw, k_raw = att.split_heads(att.query(hidden)), att.split_heads(att.key(hidden))  # (B, H, N, d)
        q, k = F.normalize(q_raw, dim=-1), F.normalize(k_raw, dim=-1)
        v = att.split_heads(att.value(hidden))
        b, h, n, d = q.shape
        keep_heads = keep[:, None, :].expand(b, h, n).reshape(b * h, n)  # (BH, N)
        v_masked = v * keep[:, None, :, None]
        if self.hashes:
            # the raw rows, as the served kernels hash them (int8 rounding is per row)
            q_codes = hash_codes_onnx(q_raw, self.projection, self.hash_bits, self.int8).reshape(b * h, n, self.hashes)
            k_codes = hash_codes_onnx(k_raw, self.projection, self.hash_bits, self.int8).reshape(b * h, n, self.hashes)
            context = lsh_cumulate_onnx(q_codes, k_codes, v_masked.reshape(b * h, n, d), self.hash_bits, self.group)
            context = context * keep_heads[:, :, None]
        else:
            context = exact_cumulate_onnx(q.reshape(b * h, n, d), k.reshape(b * h, n, d), v.reshape(b * h, n, d),
                                          keep_heads, self.hash_bits)
        # N-YOSO's norm, then YOSO-C over the values already masked: the served layer's own formula
        context = attention_finish_ref(context.view(b, h, n, d), v_masked,
                                       None if att.conv is None else att.conv.weight, None)
        return context.transpose(1, 2).reshape(b, n, h * d)  # (B, N, hidden)


class ExportableEncoder(nn.Module):
    """An :class:`EncoderModel` as one traceable function of (input_ids, attention_mask).

    Outputs: last_hidden_state (B, N, hidden), embedding (B, hidden) pooled by config.pooling and not
    normalised (as ``EncoderModel.embed``), and logits (B, num_labels) when there is a classifier.
    """

    def __init__(self, model: EncoderModel, hashes: int):
        super().__init__()
        self.model = model
        self.attention = nn.ModuleList(
            OnnxSelfAttention(layer.attention.self, hashes) for layer in model.encoder.encoder.layer
        )

    @property
    def output_names(self) -> list[str]:
        names = ["last_hidden_state", "embedding"]
        return names + ["logits"] if self.model.has_classifier else names

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """input_ids (B, N) int64, attention_mask (B, N) int64 0/1 → the tensors of ``output_names``."""
        keep = attention_mask.to(torch.float32)
        hidden = self.model.encoder.embeddings(input_ids)
        for layer, attention in zip(self.model.encoder.encoder.layer, self.attention):
            x = layer.attention.output(attention(hidden, keep), hidden)
            hidden = layer.feed_forward(x)  # position-wise: the trace never needs torch's chunking
        if self.model.config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = keep[:, :, None]  # (B, N, 1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        outputs = (hidden, pooled)
        if self.model.has_classifier:
            outputs += (self.model.classifier(hidden),)
        return outputs


def check_exportable(config) -> None:
    """Raise ValueError unless ``config`` (an EncoderConfig) is a model this exporter covers."""
    if config.attention_type != "yoso" or getattr(config, "reversible", False):
        raise ValueError(f"ONNX export covers post-LN YOSO encoders (attention_type 'yoso', reversible False); "
                         f"this model has attention_type {config.attention_type!r}, reversible "
                         f"{getattr(config, 'reversible', False)}")


def export_onnx(model: EncoderModel | str | Path, out_dir: str | Path, *, hashes: int | None = None,
                opset: int = DEFAULT_OPSET) -> Path:
    """Write ``out_dir`` = model.onnx + config.json (with an ``onnx`` section) + tokenizer files.

    ``model`` is an :class:`EncoderModel` or a checkpoint directory; ``hashes`` (default: the
    model's default_hashes; 0 = exact) is fixed in the graph. The model is moved to the CPU in
    float32 (in place, as ``nn.Module.to`` does). The config written has use_expectation/num_hash
    set so that its default_hashes is the exported count. Bad hashes (more than MAX_HASHES
    included)/opset → ValueError.
    """
    if isinstance(hashes, int) and hashes > MAX_HASHES:  # the graph unrolls every hash: hours to trace
        raise ValueError(f"hashes must be <= {MAX_HASHES} to export, got {hashes}")
    if opset < 16:
        raise ValueError(f"opset must be >= 16 (ScatterND with add reduction), got {opset}")
    if opset > MAX_OPSET:
        raise ValueError(f"opset must be <= {MAX_OPSET} (the TorchScript exporter's maximum), got {opset}")
    if not isinstance(model, EncoderModel):
        check_out_dir(model, out_dir)
        model = load_pretrained(model)
    check_exportable(model.config)
    hashes = resolve_hashes(model.config, hashes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.float32).eval()
    wrapper = ExportableEncoder(model, hashes).eval()
    # Two rows of different lengths: a trace on a square or unpadded input could bake in a shape.
    ids = torch.full((2, 8), model.tokenizer.pad_id if model.tokenizer is not None else 0, dtype=torch.long)
    ids[:, 0], ids[0, 1:7], ids[1, 1:4] = 1, 5, 6
    mask = (torch.arange(8)[None] < torch.tensor([[7], [4]])).long()
    dynamic = {name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES}
    dynamic.update({"last_hidden_state": {0: "batch", 1: "sequence"}, "embedding": {0: "batch"},
                    "logits": {0: "batch"}})
    outputs = wrapper.output_names
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of torch.export; it is still the one that
        # honours a custom op's symbolic and dynamic_axes without onnxscript.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        with torch.no_grad():
            torch.onnx.export(wrapper, (ids, mask), str(out_dir / ONNX_FILE), dynamo=False,
                              input_names=list(INPUT_NAMES), output_names=outputs, opset_version=opset,
                              dynamic_axes={k: v for k, v in dynamic.items() if k in INPUT_NAMES or k in outputs})
    _write_config(model, out_dir, hashes, opset, outputs)
    if model.tokenizer is not None:
        model.tokenizer.save(out_dir)
    return out_dir


def _write_config(model: EncoderModel, out_dir: Path, hashes: int, opset: int, outputs: list[str]) -> None:
    config = model.config
    path = out_dir / "config.json"
    shapes = {"last_hidden_state": ["batch", "sequence", config.hidden_size],
              "embedding": ["batch", config.hidden_size], "logits": ["batch", config.num_labels]}
    config.to_json_file(path, architectures=model.architectures)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["use_expectation"] = hashes == 0
    data["num_hash"] = hashes or config.num_hash
    data["onnx"] = {
        "file": ONNX_FILE,
        "hashes": hashes,
        "opset": opset,
        "inputs": [{"name": name, "shape": ["batch", "sequence"], "dtype": "int64"} for name in INPUT_NAMES],
        "outputs": [{"name": name, "shape": shapes[name], "dtype": "float32"} for name in outputs],
        "pooling": config.pooling,
        "torch_version": torch.__version__,
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
