"""Which runtime serves the model: ``--runtime`` made concrete for the device, and the model loaded for it
behind :class:`yoso_serve.model.served.ServedModel`, the one interface the engine uses (what each runtime
needs at start is checked by service/runtimes.py).

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
from typing import TYPE_CHECKING

from yoso_serve.model.hashes import resolve_hashes
from yoso_serve.model.served import ServedModel

if TYPE_CHECKING:  # annotations only: settings validation imports this module without torch
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
    """A model ready for the engine, the runtime serving it, why that runtime, and the ONNX export it
    runs from (hybrid only)."""

    model: ServedModel
    runtime: str  # "torch", "hybrid" or "onnx"
    reason: str
    export: Path | None = None


def check_model_limits(settings: ServeSettings, model: ServedModel) -> tuple[int, int]:
    """The limits that need the model, checked the same way by a start and by ``--prepare``: (tokens per
    input, specials included; content tokens per chunked window). A conflict is a ValueError naming the flag."""
    s, cfg = settings, model.config
    if model.tokenizer is None:
        raise ValueError("the model directory has no tokenizer (tokenizer.json or vocab.txt)")
    if s.max_input_length is not None and s.max_input_length > cfg.max_position_embeddings:
        raise ValueError(f"--max-input-length {s.max_input_length} is above the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}; lower it")
    max_length = min(s.max_input_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if max_length > s.max_batch_tokens:
        raise ValueError(f"--max-batch-tokens {s.max_batch_tokens} is below the input limit "
                         f"{max_length}; raise it or lower --max-input-length")
    window = max_length - model.tokenizer.num_special_tokens
    if s.chunk_overlap >= window:
        raise ValueError(f"--chunk-overlap {s.chunk_overlap} must be below the window of "
                         f"{window} tokens; lower it")
    return max_length, window


def model_path(settings) -> Path:
    """The directory the server loads a torch or hybrid model from: ``--model``, else the bundled default model."""
    from yoso_serve.model import default_model_dir

    return Path(settings.model or default_model_dir())


def load_served_model(settings: ServeSettings) -> LoadedModel:
    """Load ``settings.model`` (or the bundled default) for the runtime ``settings.runtime`` resolves to.

    With ``hybrid`` this exports the model into the cache when no export is there yet (seconds for
    the default model), so it runs before the server turns ready; any failure raises.
    """
    import torch

    from yoso_serve.model import load_pretrained
    from yoso_serve.model.linear import set_dense_dtype
    from yoso_serve.model.onnx_runtime import load_onnx

    device = settings.resolved_device()
    if settings.runtime == "onnx":  # settings checked that --model is an exported directory
        return LoadedModel(load_onnx(settings.model, device=device), "onnx", "--runtime onnx")
    path = model_path(settings)
    model = load_pretrained(path, device=device, dtype=getattr(torch, settings.resolved_dtype()))
    if settings.resolved_exact_kernel() == "flex":
        _use_flex(model)
    if settings.runtime != "hybrid":  # torch serves it: its CPU GEMMs at --dense-dtype (CUDA ignores it)
        set_dense_dtype(model, settings.resolved_dense_dtype())
    if settings.runtime == "torch":
        return LoadedModel(model, "torch", "--runtime torch")
    if settings.runtime == "hybrid":
        # ONNX serves the model's count; auto's exact inputs route to torch (model/hybrid.py), as on torch
        served = resolve_hashes(model.config, settings.hashes, source="setting", n_tokens=model.config.max_length)
        return _load_hybrid(model, path, served, device)
    reason = AUTO_REASONS[device]
    log.info("runtime torch: %s", reason)
    return LoadedModel(model, "torch", reason)


def _use_flex(model) -> None:
    """Exact mode through the fused kernel, every length bucket compiled now (a failure is logged and
    the op serves: /info's backend says which runs)."""
    import time

    from yoso_serve.model.attention.yoso import set_exact_kernel, warm_exact_kernel

    set_exact_kernel(model, "flex")
    start = time.perf_counter()
    buckets = warm_exact_kernel(model, model.config.max_length)
    log.info("exact kernel flex: %d length buckets compiled in %.1f s", buckets, time.perf_counter() - start)


def _load_hybrid(model, path: Path, served: int, device: str) -> LoadedModel:
    """``model`` (loaded from ``path``) behind ONNX Runtime at ``served`` hashes; raises what blocks it."""
    from yoso_serve.model.export import check_exportable
    from yoso_serve.model.export_cache import cached_export, onnx_cache_dir
    from yoso_serve.model.hybrid import HybridEncoderModel
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
    return LoadedModel(hybrid, "hybrid", reason, export)
