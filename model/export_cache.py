"""The export cache of ``--runtime hybrid``: ``$YOSO_CACHE_DIR/onnx/<key>/``, one ONNX export per key.

The key (:func:`export_key`) covers the checkpoint's bytes and everything that shapes the graph, so an
export is written once (:func:`cached_export`) and reused by every later start, by any user.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoint import weight_files
from .default import cache_root
from .encoder_model import EncoderModel
from .export import DEFAULT_OPSET, ONNX_FILE, export_onnx
from .onnx_runtime import OnnxModelError
from .version import package_version

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


def onnx_cache_dir() -> Path:
    """Where exports are cached: ``$YOSO_CACHE_DIR/onnx`` (see model/default.py for the root)."""
    return cache_root() / "onnx"


def _checkpoint_files(checkpoint: Path) -> list[Path]:
    """config.json and the weight files ``load_pretrained`` reads (in the order it prefers them)."""
    return [checkpoint / "config.json", *weight_files(checkpoint)]


def export_key(checkpoint: str | Path, hashes: int, opset: int = DEFAULT_OPSET) -> str:
    """sha256 over the checkpoint's config.json and weight bytes, the hash count, the opset and the
    versions of this package and of torch (whose exporter writes the graph); 32 hex digits."""
    digest = hashlib.sha256()
    for path in _checkpoint_files(Path(checkpoint)):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    version = package_version()
    digest.update(f"hashes={hashes};opset={opset};yoso-serve={version};torch={torch.__version__}".encode())
    return digest.hexdigest()[:32]


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
