"""ONNX Runtime for the served hash count, torch for every other: ``--runtime hybrid``.

An ONNX graph fixes its hash count (model/export.py), while a request may ask for any count (0 =
exact). :class:`HybridEncoderModel` holds both: calls at the exported count run on ONNX Runtime,
any other count on the torch model. The route depends on the hash count alone, so the same request
always takes the same path. It is opt-in: on the CPU measured in docs/benchmarks.md ("ONNX Runtime
vs torch") torch is the faster runtime, so the default (auto) serves torch.

The export comes from a cache, ``$YOSO_CACHE_DIR/onnx/<key>/``, keyed by the checkpoint's bytes and
everything that shapes the graph (:func:`export_key`); :func:`cached_export` writes it once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoint import WEIGHTS_BIN, WEIGHTS_INDEX, WEIGHTS_SAFETENSORS, CheckpointError
from .default import cache_root
from .export import DEFAULT_OPSET, ONNX_FILE, export_onnx
from .hashes import resolve_hashes
from .heads import EncoderModel
from .onnx_runtime import OnnxEncoderModel, OnnxModelError

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


def onnx_cache_dir() -> Path:
    """Where exports are cached: ``$YOSO_CACHE_DIR/onnx`` (see model/default.py for the root)."""
    return cache_root() / "onnx"


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    """config.json and the weight files ``load_pretrained`` reads (in the order it prefers them)."""
    if (checkpoint / WEIGHTS_SAFETENSORS).is_file():
        weights = [checkpoint / WEIGHTS_SAFETENSORS]
    elif (checkpoint / WEIGHTS_INDEX).is_file():
        index = json.loads((checkpoint / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        weights = [checkpoint / WEIGHTS_INDEX] + [checkpoint / s for s in sorted(set(index["weight_map"].values()))]
    elif (checkpoint / WEIGHTS_BIN).is_file():
        weights = [checkpoint / WEIGHTS_BIN]
    else:
        raise CheckpointError(f"no weights in {checkpoint}")
    return [checkpoint / "config.json", *weights]


def export_key(checkpoint: str | Path, hashes: int, opset: int = DEFAULT_OPSET) -> str:
    """sha256 over the checkpoint's config.json and weight bytes, the hash count, the opset and the
    versions of this package and of torch (whose exporter writes the graph); 32 hex digits."""
    digest = hashlib.sha256()
    for path in _checkpoint_files(Path(checkpoint)):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    version = importlib.metadata.version("yoso-serve")
    digest.update(f"hashes={hashes};opset={opset};yoso-serve={version};torch={torch.__version__}".encode())
    return digest.hexdigest()[:32]


def check_serving(hashes: int | None = None) -> None:
    """What ``--runtime hybrid`` needs at start: onnxruntime and onnx (the exporter writes with it)
    importable, and a served count (``hashes``, if given) other than exact 0. Raises ValueError
    saying how to fix each."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        missing = ["onnxruntime"]
    else:
        missing = []
    if importlib.util.find_spec("onnx") is None:
        missing.append("onnx")
    if missing:
        raise ValueError(f"--runtime hybrid needs {' and '.join(missing)}: pip install 'yoso-serve[onnx]' "
                         "('yoso-serve[onnx-gpu]' on CUDA), or use --runtime torch (the default, auto, serves torch)")
    if hashes == 0:
        raise ValueError("--runtime hybrid with --hashes 0: the exact (YOSO-E) ONNX graph is not chunked "
                         "(O(N²) memory) and is not served; use --runtime torch, or set --hashes to an LSH count")


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / ONNX_FILE).is_file()


def cached_export(model: EncoderModel, checkpoint: str | Path, hashes: int, *, opset: int = DEFAULT_OPSET) -> Path:
    """The export of ``model`` (loaded from ``checkpoint``) at ``hashes``: reused when cached, else
    written once. Moves ``model`` to the CPU in float32, as export_onnx does."""
    target = onnx_cache_dir() / export_key(checkpoint, hashes, opset)
    if _is_export(target):
        log.info("ONNX export of %s at %d hashes: reusing %s", checkpoint, hashes, target)
        return target
    if importlib.util.find_spec("onnx") is None:  # torch's exporter needs it to write the file
        raise OnnxModelError("exporting needs the onnx package: pip install 'yoso-serve[onnx]'")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("one-time ONNX export of %s at %d hashes into %s (later starts reuse it; "
             "`yoso-serve --prepare --runtime hybrid` does this ahead of time)", checkpoint, hashes, target)
    # Export beside the target and rename: a crash leaves no half export under the key, and of two
    # processes exporting at once the first rename wins and the other's copy is discarded.
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        # mkdtemp's 0700 would hide the export from other users: an image exports as root at build
        # time and serves as an unprivileged user from its read-only cache.
        os.chmod(scratch, 0o755)
        export_onnx(model, scratch, hashes=hashes, opset=opset)
        try:
            os.replace(scratch, target)
        except OSError:
            if not _is_export(target):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


class HybridEncoderModel:
    """The ``EncoderModel`` surface over a torch model and its ONNX export at one hash count.

    A call whose hashes resolve to ``onnx_hashes`` (``None`` resolves to the torch model's default
    count) runs on ONNX Runtime; any other count, exact 0 included, on torch. The config, tokenizer
    and labels are the torch model's.
    """

    runtime = "hybrid"

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
        from yoso_serve.kernels import backend_info

        return {"backend": "onnxruntime+torch", "onnx_hashes": self.onnx_hashes, "export": str(self.export_dir),
                "onnxruntime": self.onnx_model.backend_info(), "torch": backend_info()}

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
