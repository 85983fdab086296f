"""ONNX Runtime for the served hash count, torch for every other: ``--runtime hybrid``.

An ONNX graph fixes its hash count (model/export.py), while a request may ask for any count (0 =
exact). :class:`HybridEncoderModel` holds both: calls at the exported count run on ONNX Runtime,
any other count on the torch model. The route depends on the hash count alone, so the same request
always takes the same path. It is opt-in: on the CPU measured in docs/benchmarks.md ("ONNX Runtime
vs torch") torch is the faster runtime, so the default (auto) serves torch. The export it runs comes
from the cache of model/export_cache.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .encoder_model import EncoderModel
from .hashes import resolve_hashes
from .onnx_runtime import OnnxEncoderModel


class HybridEncoderModel:
    """The ``EncoderModel`` surface over a torch model and its ONNX export at one hash count.

    A call whose hashes resolve to ``onnx_hashes`` (``None`` resolves to the torch model's default
    count) runs on ONNX Runtime; any other count, exact 0 included, on torch. The config, tokenizer
    and labels are the torch model's.
    """

    runtime = "hybrid"
    fixed_hashes = None  # any count: the ones the export does not run go to torch

    def __init__(self, torch_model: EncoderModel, onnx_model: OnnxEncoderModel):
        if onnx_model.config.hidden_size != torch_model.config.hidden_size:
            raise ValueError(f"the ONNX export (hidden size {onnx_model.config.hidden_size}) is not of this "
                             f"torch model (hidden size {torch_model.config.hidden_size})")
        self.torch_model = torch_model
        self.onnx_model = onnx_model
        self.onnx_hashes = onnx_model.fixed_hashes
        self.config = torch_model.config
        self.tokenizer = torch_model.tokenizer

    @property
    def has_classifier(self) -> bool:
        return self.torch_model.has_classifier

    @property
    def id2label(self) -> dict[int, str]:
        return self.torch_model.id2label

    @property
    def export_dir(self) -> Path:
        return self.onnx_model.path

    def backend_info(self) -> dict:
        """Both runtimes: ONNX Runtime's session for ``onnx_hashes``, the torch kernels for the rest."""
        return {"backend": "onnxruntime+torch", "onnx_hashes": self.onnx_hashes, "export": str(self.export_dir),
                "onnxruntime": self.onnx_model.backend_info(), "torch": self.torch_model.backend_info()}

    def runs_on_onnx(self, hashes: int | None) -> bool:
        """True when a call with ``hashes`` runs on ONNX Runtime."""
        return resolve_hashes(self.config, hashes) == self.onnx_hashes

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "HybridEncoderModel":
        self.torch_model.to(device=device, dtype=dtype)
        self.onnx_model.to(device, dtype)
        return self

    def eval(self) -> "HybridEncoderModel":
        self.torch_model.eval()
        return self

    def last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    hashes: int | None = None) -> torch.Tensor:
        """input_ids (B, N) int64, attention_mask (B, N) 0/1 → (B, N, hidden) fp32."""
        return self._pick(hashes).last_hidden(input_ids, attention_mask, hashes=hashes)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
              hashes: int | None = None, pooling: str | None = None) -> torch.Tensor:
        """Pooled, not normalised (B, hidden)."""
        return self._pick(hashes).embed(input_ids, attention_mask, hashes=hashes, pooling=pooling)

    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 hashes: int | None = None) -> torch.Tensor:
        """Logits (B, num_labels)."""
        return self._pick(hashes).classify(input_ids, attention_mask, hashes=hashes)

    def _pick(self, hashes: int | None):
        return self.onnx_model if self.runs_on_onnx(hashes) else self.torch_model
