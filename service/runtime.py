"""Which runtime serves the model: ``--runtime`` made concrete for the device, and the model loaded for it.

``auto`` (the default) picks the faster runtime per device, which is torch on both:

* CPU → torch: on the CPU of docs/benchmarks.md ("ONNX Runtime vs torch") ONNX Runtime, with the one
  intra-op thread it is served with, reaches under half torch's docs/s at every length measured;
* CUDA → torch, with our CUDA kernels (ONNX Runtime on a GPU has not been measured).

``hybrid`` (:class:`yoso_serve.model.hybrid.HybridEncoderModel`), only when asked for: ONNX Runtime
for the served hash count, from an export taken from the cache or written there once, and torch for
any other count. Asked for, it never falls back to torch: a model the exporter does not cover, an
exact served count or an export that cannot be prepared fails the load, and with it the start.

``torch`` and ``onnx`` are what they say. The runtime and its reason are logged once and shown by /info.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yoso_serve.model.hashes import resolve_hashes

from .settings import ServeSettings

log = logging.getLogger("yoso_serve.service")

AUTO_REASONS = {
    "cpu": "auto on cpu: torch, the faster runtime on CPU in docs/benchmarks.md (ONNX Runtime: under half its "
           "docs/s at 128 to 4096 tokens); --runtime hybrid serves the served hash count with ONNX Runtime all "
           "the same",
    "cuda": "auto on cuda: torch, with our CUDA kernels (ONNX Runtime on a GPU has not been measured)",
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine, the runtime serving it and why that runtime."""

    model: Any  # EncoderModel, OnnxEncoderModel or HybridEncoderModel: the same duck interface
    runtime: str  # "torch", "hybrid" or "onnx"
    reason: str


def load_served_model(settings: ServeSettings) -> LoadedModel:
    """Load ``settings.model`` (or the bundled default) for the runtime ``settings.runtime`` resolves to.

    With ``hybrid`` this exports the model into the cache when no export is there yet (seconds for
    the default model), so it runs before the server turns ready; any failure raises.
    """
    from yoso_serve.model import default_model_dir, load_pretrained
    from yoso_serve.model.onnx_runtime import load_onnx

    device = settings.resolved_device()
    if settings.runtime == "onnx":  # settings checked that --model is an exported directory
        return LoadedModel(load_onnx(settings.model, device=device), "onnx", "--runtime onnx")
    path = Path(settings.model or default_model_dir())
    model = load_pretrained(path, device=device)
    if settings.runtime == "torch":
        return LoadedModel(model, "torch", "--runtime torch")
    if settings.runtime == "hybrid":
        # auto serves the model's count from ONNX: its exact switch is torch-only (model/hashes.py)
        served = resolve_hashes(model.config, settings.hashes, source="setting", n_tokens=model.config.max_length)
        return _load_hybrid(model, path, served, device)
    reason = AUTO_REASONS[device]
    log.info("runtime torch: %s", reason)
    return LoadedModel(model, "torch", reason)


def _load_hybrid(model, path: Path, served: int, device: str) -> LoadedModel:
    """``model`` (loaded from ``path``) behind ONNX Runtime at ``served`` hashes; raises what blocks it."""
    from yoso_serve.model.export import check_exportable
    from yoso_serve.model.hybrid import HybridEncoderModel, cached_export, onnx_cache_dir
    from yoso_serve.model.onnx_runtime import load_onnx

    try:
        check_exportable(model.config)
    except ValueError as exc:
        raise ValueError(f"--runtime hybrid: {exc}; use --runtime torch for this model") from None
    if served == 0:
        raise ValueError("--runtime hybrid: the served hash count is 0 (exact YOSO-E), whose ONNX graph is not "
                         "chunked (O(N²) memory); set --hashes to an LSH count or use --runtime torch")
    try:
        export = cached_export(model, path, served)
    except Exception as exc:
        raise RuntimeError(f"--runtime hybrid: the ONNX export at {served} hashes could not be prepared in "
                           f"{onnx_cache_dir()} ({type(exc).__name__}: {exc}); point YOSO_CACHE_DIR at a "
                           "writable folder or write the export ahead of time with `yoso-serve --prepare "
                           "--runtime hybrid`, or use --runtime torch") from exc
    hybrid = HybridEncoderModel(model, load_onnx(export, device=device))
    reason = (f"--runtime hybrid: ONNX Runtime for the served {served} hashes, torch for any other count; "
              f"export {export}")
    log.info("runtime hybrid: %s", reason)
    return LoadedModel(hybrid, "hybrid", reason)
