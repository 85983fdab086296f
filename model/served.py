"""The one interface every runtime's model implements and the service's engine serves:
``EncoderModel`` (torch), ``OnnxEncoderModel`` and ``HybridEncoderModel``. The model layer owns it; the
service imports it (service → model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotations only: importing the protocol needs no torch
    import torch

    from .config import EncoderConfig
    from .tokenizer import TextTokenizer


@runtime_checkable
class ServedModel(Protocol):
    """What the engine serves: ``EncoderModel`` (torch), ``OnnxEncoderModel`` and ``HybridEncoderModel``.

    Tensors in and out: input_ids (B, N) int64 and attention_mask (B, N) 0/1; ``hashes`` None means the
    model's default count. A runtime that cannot run a count raises ValueError naming it.
    """

    config: EncoderConfig
    tokenizer: TextTokenizer | None
    runtime: str  # "torch", "hybrid" or "onnx"
    fixed_hashes: int | None  # the one count an exported graph runs; None: any count

    @property
    def has_classifier(self) -> bool: ...

    @property
    def id2label(self) -> dict[int, str]: ...

    def backend_info(self) -> dict:
        """What /info shows as the backend (the kernels, or onnxruntime and its providers)."""

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> ServedModel: ...

    def eval(self) -> ServedModel: ...

    def last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    hashes: int | None = None) -> torch.Tensor:
        """(B, N, hidden)."""

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
              hashes: int | None = None, pooling: str | None = None) -> torch.Tensor:
        """Pooled, not normalised (B, hidden)."""

    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 hashes: int | None = None) -> torch.Tensor:
        """Logits (B, num_labels)."""
