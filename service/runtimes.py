"""What each runtime needs at start, checked by the settings (before any model loads, without torch) and
by the loader: ``--runtime onnx`` an exported directory whose count honours ``--hashes``, ``--runtime
hybrid`` onnxruntime and onnx and an LSH served count. Each check raises ValueError saying how to fix it."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from yoso_serve.model.hashes import AUTO, resolve_hashes


def check_onnx_serving(path: str | Path | None, hashes: int | str | None = None, exact_below: int = 0) -> None:
    """What ``--runtime onnx`` needs at start: an exported ``path``, onnxruntime, and ``hashes``
    (if a count, not "auto") equal to the exported count; under "auto" no exact crossover (``exact_below``),
    since the graph cannot run exact. Raises ValueError saying how to fix each."""
    from yoso_serve.model.onnx_runtime import import_onnxruntime, is_onnx_dir

    if path is None:
        raise ValueError("--runtime onnx needs --model pointing at a directory written by "
                         "`yoso-train export-onnx` (docs/onnx.md); the bundled default model is a torch "
                         "checkpoint: to serve it, use --runtime torch (what auto picks) or --runtime hybrid "
                         "(ONNX Runtime from an export cached at the first start)")
    if not is_onnx_dir(path):
        raise ValueError(f"--model {path} is not an ONNX export (no 'onnx' section in its config.json); "
                         f"serve it with --runtime torch or hybrid (exported into the cache once), or run "
                         f"`yoso-train export-onnx --model {path} --out DIR` and serve DIR")
    import_onnxruntime()
    exported = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))["onnx"]["hashes"]
    if hashes is not None and hashes != AUTO:
        resolve_hashes(None, hashes, source="setting", fixed=exported)
    elif exact_below > 0:
        raise ValueError(f"--runtime onnx with --hashes auto: auto runs inputs under --auto-exact-below "
                         f"{exact_below} tokens exact (YOSO-E), which this export (fixed at {exported} hashes) "
                         f"cannot, so short texts would get other vectors than on torch or hybrid; use "
                         f"--runtime hybrid (exact inputs on torch), or serve every input at {exported} hashes "
                         f"with --hashes {exported} or --auto-exact-below 0")


def check_hybrid_serving(hashes: int | str | None = None) -> None:
    """What ``--runtime hybrid`` needs at start: onnxruntime and onnx (the exporter writes with it)
    importable, and a served count (``hashes``, if given) other than exact 0. Raises ValueError
    saying how to fix each."""
    try:
        importlib.import_module("onnxruntime")
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
