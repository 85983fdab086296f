"""Serve an exported directory (model.onnx + config.json + tokenizer) with ONNX Runtime.

:class:`OnnxEncoderModel` has the interface the service serves (``ServedModel`` in service/loading.py,
which :class:`~yoso_serve.model.encoder_model.EncoderModel` has too) — ``.config``, ``.tokenizer``,
``.last_hidden``, ``.embed``, ``.classify``, ``.has_classifier``, ``.id2label``, ``.to``, ``.eval``,
``.backend_info`` — taking and returning torch tensors, so the engine's batching, limits and metrics
are the same for both runtimes. The hash count is the one
fixed at export (``fixed_hashes``); a call asking for another raises ValueError naming it.
``onnxruntime`` is imported when a model is loaded, never at package import.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .config import POOLINGS, EncoderConfig
from .export import ONNX_FILE
from .hashes import resolve_hashes
from .tokenizer import TOKENIZER_FILES, TextTokenizer

DEVICES = ("cpu", "cuda")


class OnnxModelError(ValueError):
    """An exported directory that cannot be served: missing file, no ``onnx`` section, no provider."""


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise OnnxModelError("the onnx runtime needs the onnxruntime package: pip install 'yoso-serve[onnx]' "
                             "(CPU) or 'yoso-serve[onnx-gpu]' (CUDA)") from exc
    return onnxruntime


def providers_for(device: str) -> list[str]:
    """Execution providers for ``device``: CPU, or CUDA first (onnxruntime-gpu) with CPU behind it."""
    if device not in DEVICES:
        raise OnnxModelError(f"device must be one of {DEVICES} for the onnx runtime, got {device!r}")
    if device == "cpu":
        return ["CPUExecutionProvider"]
    available = import_onnxruntime().get_available_providers()
    if "CUDAExecutionProvider" not in available:
        raise OnnxModelError(f"device cuda needs CUDAExecutionProvider (package onnxruntime-gpu); this "
                             f"onnxruntime offers {available}")
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def session_options(device: str):
    """``onnxruntime.SessionOptions`` for ``device``: one intra-op thread on the CPU.

    onnxruntime's CPU ScatterND splits the updates over its intra-op threads and adds without
    atomics, so with reduction="add" two threads adding to one bucket lose updates (wrong
    vectors, not just rounding: sums off by ~10 on a crowded table with onnxruntime 1.31 and two
    threads; tests/onnx/test_export.py checks the cumulation under these options). One thread
    keeps every add; the CUDA kernel adds atomically and keeps onnxruntime's default threads.
    """
    options = import_onnxruntime().SessionOptions()
    if device == "cpu":
        options.intra_op_num_threads = 1
    return options


def is_onnx_dir(path: str | Path) -> bool:
    """True when ``path`` is an exported directory (config.json with an ``onnx`` section)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return "onnx" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False


class OnnxEncoderModel:
    """An exported encoder on an ``onnxruntime.InferenceSession``; see the module docstring.

    path: the directory written by :func:`yoso_serve.model.export.export_onnx`; device: "cpu" or
    "cuda". On the CPU the session runs one intra-op thread: see :func:`session_options`.
    """

    runtime = "onnx"

    def __init__(self, path: str | Path, *, device: str = "cpu"):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise OnnxModelError(f"no config.json in {self.path}")
        try:
            raw = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise OnnxModelError(f"cannot read {config_file}: {exc}") from exc
        if "onnx" not in raw:
            raise OnnxModelError(f"{config_file} has no 'onnx' section: {self.path} is not an exported "
                                 f"model; run: yoso-train export-onnx --model {self.path} --out DIR")
        self.onnx_info = raw["onnx"]
        self.config = EncoderConfig.from_dict(raw)
        if not (self.path / self.onnx_info.get("file", ONNX_FILE)).is_file():
            raise OnnxModelError(f"no {self.onnx_info.get('file', ONNX_FILE)} in {self.path}")
        self.fixed_hashes = int(self.onnx_info["hashes"])
        self.tokenizer = None
        if any((self.path / name).is_file() for name in TOKENIZER_FILES):
            self.tokenizer = TextTokenizer.from_dir(self.path)
        self.device = None
        self.session = None
        self.to(device)

    # --- the EncoderModel surface -----------------------------------------------------
    @property
    def has_classifier(self) -> bool:
        return "logits" in self._outputs

    @property
    def id2label(self) -> dict[int, str]:
        return dict(self.config.id2label or {})

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def backend_info(self) -> dict:
        """What /info shows as the backend: onnxruntime, its version, providers and hashes."""
        ort = import_onnxruntime()
        return {"backend": "onnxruntime", "version": ort.__version__, "providers": self.providers,
                "exported_hashes": self.fixed_hashes, "opset": self.onnx_info.get("opset")}

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "OnnxEncoderModel":
        """Move to "cpu" or "cuda" (a new session with that device's providers); float32 only."""
        if dtype is not None and dtype != torch.float32:
            raise OnnxModelError(f"the exported model runs in float32, got dtype {dtype}")
        device = torch.device(device or "cpu").type
        if device == self.device:
            return self
        ort = import_onnxruntime()
        options = session_options(device)
        onnx_file = str(self.path / self.onnx_info.get("file", ONNX_FILE))
        wanted = providers_for(device)
        session = ort.InferenceSession(onnx_file, options, providers=wanted)
        if session.get_providers()[0] != wanted[0]:  # onnxruntime falls back to CPU quietly; we do not
            raise OnnxModelError(f"onnxruntime could not start {wanted[0]} (it offered {session.get_providers()}); "
                                 "check the CUDA/cuDNN libraries onnxruntime-gpu needs")
        self.session = session
        self._outputs = [o.name for o in self.session.get_outputs()]
        self.device = device
        return self

    def eval(self) -> "OnnxEncoderModel":
        return self

    def last_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                    hashes: int | None = None) -> torch.Tensor:
        """input_ids (B, N) int64, attention_mask (B, N) 0/1 → (B, N, hidden) fp32 (on the CPU)."""
        return self._run("last_hidden_state", input_ids, attention_mask, hashes)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
              hashes: int | None = None, pooling: str | None = None) -> torch.Tensor:
        """Pooled, not normalised (B, hidden): the graph's pooling, or the other one computed here."""
        pooling = pooling or self.config.pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if pooling == self.config.pooling:
            return self._run("embedding", input_ids, attention_mask, hashes)
        hidden = self.last_hidden(input_ids, attention_mask, hashes=hashes)
        if pooling == "cls":
            return hidden[:, 0]
        weights = self._mask(input_ids, attention_mask).to(hidden.dtype)[:, :, None]  # (B, N, 1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)

    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 hashes: int | None = None) -> torch.Tensor:
        """Logits (B, num_labels) of the exported classification head."""
        if not self.has_classifier:
            raise ValueError("this model has no classification head (the export has no 'logits' output)")
        return self._run("logits", input_ids, attention_mask, hashes)

    # --- internals --------------------------------------------------------------------
    def check_hashes(self, hashes: int | None) -> int:
        """The call's hash count: None → the exported one; any other count → ValueError (model/hashes.py)."""
        return resolve_hashes(self.config, hashes, fixed=self.fixed_hashes)

    @staticmethod
    def _mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones_like(input_ids, dtype=torch.long)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        return attention_mask.long()

    def _run(self, output: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             hashes: int | None) -> torch.Tensor:
        self.check_hashes(hashes)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be (B, N) with N >= 1, got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        feeds = {
            "input_ids": np.ascontiguousarray(input_ids.detach().cpu().numpy(), dtype=np.int64),
            "attention_mask": np.ascontiguousarray(self._mask(input_ids, attention_mask).cpu().numpy(),
                                                   dtype=np.int64),
        }
        (out,) = self.session.run([output], feeds)
        return torch.from_numpy(out)


def load_onnx(path: str | Path, *, device: str = "cpu") -> OnnxEncoderModel:
    """Load an exported directory on ``device`` ("cpu" or "cuda")."""
    return OnnxEncoderModel(path, device=device)
