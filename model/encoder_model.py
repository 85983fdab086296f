"""The loaded-model object: a YOSO encoder with its optional heads and its tokenizer.

:class:`EncoderModel` is what ``load_pretrained`` returns and what the service serves on the torch
runtime. State-dict layout is transformers': the encoder under ``yoso.``, the sequence classifier under
``classifier.`` (``dense``, ``out_proj``) and the masked-LM head under ``cls.predictions.``
(``transform.dense``, ``transform.LayerNorm``, ``bias``; the decoder is the word-embedding matrix,
tied, so it is not stored).
"""

from __future__ import annotations

import torch
from torch import nn

from yoso_serve.kernels import backend_info
from yoso_serve.kernels import exact_bf16_dots, int8_gemm, int8_hashing_body

from .attention.yoso import exact_kernel_info
from .config import POOLINGS, EncoderConfig
from .encoder import YosoEncoder
from .heads import ClassificationHead, MaskedLMHead


class EncoderModel(nn.Module):
    """A YOSO encoder with optional heads, plus its tokenizer: what ``load_pretrained`` returns.

    ``with_classifier`` builds a sequence-classification head with ``config.num_labels`` outputs;
    ``with_mlm`` a masked-LM head. The tokenizer is a plain attribute (not a module).
    """

    runtime = "torch"
    fixed_hashes = None  # any count, chosen per call

    def __init__(self, config: EncoderConfig, *, with_classifier: bool = False, with_mlm: bool = False,
                 tokenizer=None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.yoso = YosoEncoder(config)
        if with_classifier and not config.num_labels:
            raise ValueError("a classification head needs config.id2label (num_labels >= 1)")
        self.classifier = ClassificationHead(config, config.num_labels) if with_classifier else None
        self.cls = MaskedLMHead(config) if with_mlm else None
        if self.classifier is not None:
            self.classifier.apply(self.yoso._init_weights)
        if self.cls is not None:
            self.cls.apply(self.yoso._init_weights)

    @property
    def encoder(self) -> YosoEncoder:
        return self.yoso

    @property
    def has_classifier(self) -> bool:
        return self.classifier is not None

    @property
    def has_mlm_head(self) -> bool:
        return self.cls is not None

    @property
    def id2label(self) -> dict[int, str]:
        return dict(self.config.id2label or {})

    def backend_info(self) -> dict:
        """Which attention kernels run (C++/CUDA or pure PyTorch) and why, how LSH codes are computed
        (``hashing``: "fp32", or "int8" with the C++ body that runs it) and the dense layers' CPU GEMMs
        (``dense``: "fp32", "bf16" or "int8", see ``set_dense_dtype``) and exact mode's kernel (``exact_kernel``: "op"
        or "flex", see ``set_exact_kernel``; with bf16 or int8 dense layers on the C++ backend ``exact_bf16_dots``,
        whether that kernel takes their bf16 q and k by AVX-512 BF16 dot products; with int8 ``int8_gemm``, the int8
        GEMM's route, "int_mm" or "u8s8" with ±63 weights (FFN out's ±127), :func:`yoso_serve.kernels.int8_gemm`):
        what /info shows."""
        info = backend_info()
        info["hashing"] = "int8" if self.config.hash_int8 else "fp32"
        info["dense"] = next((d for d in ("bf16", "int8") if any(getattr(m, d, False) for m in self.modules())),
                             "fp32")
        info.update(exact_kernel_info(self))
        info["dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        if self.config.hash_int8:
            info["int8_hashing_body"] = int8_hashing_body()
        if info["dense"] != "fp32" and info.get("backend") == "cpp":  # bf16 q, k reach exact mode's kernel
            info["exact_bf16_dots"] = exact_bf16_dots()
        if info["dense"] == "int8":
            info["int8_gemm"] = int8_gemm()
        return info

    @property
    def architectures(self) -> list[str]:
        """transformers' class name for config.json's ``architectures``."""
        if self.has_classifier:
            return ["YosoForSequenceClassification"]
        if self.has_mlm_head:
            return ["YosoForMaskedLM"]
        return ["YosoModel"]

    def last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    hashes: int | None = None, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, N) int64, attention_mask (B, N) 0/1 → (B, N, hidden)."""
        return self.yoso(input_ids, attention_mask, token_type_ids, hashes=hashes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                hashes: int | None = None) -> torch.Tensor:
        return self.last_hidden(input_ids, attention_mask, hashes=hashes)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
              hashes: int | None = None, pooling: str | None = None) -> torch.Tensor:
        """Pooled (not normalised) fp32 embeddings (B, hidden): mean over real tokens, or the first token."""
        pooling = pooling or self.config.pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        # pooled in fp32: a 4096-token sum of fp16 states can pass fp16's 65504
        hidden = self.last_hidden(input_ids, attention_mask, hashes=hashes).float()
        if pooling == "cls":
            return hidden[:, 0]
        if attention_mask is None:
            return hidden.mean(dim=1)
        weights = attention_mask.to(hidden.dtype)[:, :, None]  # (B, N, 1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)

    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 hashes: int | None = None) -> torch.Tensor:
        """Logits (B, num_labels) of the sequence-classification head."""
        if self.classifier is None:
            raise ValueError("this model has no classification head (no classifier.* weights)")
        return self.classifier(self.last_hidden(input_ids, attention_mask, hashes=hashes))

    def mlm_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   hashes: int | None = None) -> torch.Tensor:
        """Masked-LM logits (B, N, vocab_size)."""
        if self.cls is None:
            raise ValueError("this model has no masked-LM head (no cls.predictions.* weights)")
        hidden = self.last_hidden(input_ids, attention_mask, hashes=hashes)
        return self.cls(hidden, self.yoso.embeddings.word_embeddings.weight)
