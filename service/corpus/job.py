"""``embed_corpus``: the whole job, what ``yoso-embed`` runs (same options, as keyword arguments).

1. Check the options and the server settings (the server's own rules and wording), the inputs, the model.
2. Prepare ``DIR``: refuse one written with another model or other settings, find what is written.
3. Stream the input: bad rows reported and skipped, ids already written skipped, the rest embedded by
   the local engine or the Ray engine into parts.
4. Write the manifest: settings, counts, every bad row with its location.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from yoso_serve.model.version import package_version

from .local import run_local
from .report import RunReport
from .sources import Admission, CorpusError, count_rows, plan_sources, read_documents
from .store import FORMAT, OutputStore
from ..loading import model_path
from .work import BATCH_SETTINGS, VECTOR_SETTINGS, DocumentEmbedder, job_settings, model_digest, \
    resolved_settings

ENGINES = ("local", "ray")
PART_ROWS = 1000


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _check_options(engine: str, workers: int, threads_per_worker: int | None, gpus_per_worker: float,
                   pieces: int | None, part_rows: int, ray_address: str | None, serve: dict) -> None:
    if engine not in ENGINES:
        raise CorpusError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    unknown = sorted(set(serve) - set(VECTOR_SETTINGS) - set(BATCH_SETTINGS))
    if unknown:
        raise CorpusError(f"unknown setting(s) {', '.join(unknown)}; a job takes "
                          f"{', '.join(VECTOR_SETTINGS + BATCH_SETTINGS)}")
    if workers < 1:
        raise CorpusError(f"--workers must be >= 1, got {workers}")
    if threads_per_worker is not None and threads_per_worker < 1:
        raise CorpusError(f"--threads-per-worker must be >= 1, got {threads_per_worker}")
    if gpus_per_worker < 0:
        raise CorpusError(f"--gpus-per-worker must be >= 0, got {gpus_per_worker}")
    if pieces is not None and pieces < 1:
        raise CorpusError(f"--pieces must be a piece size in tokens >= 1, got {pieces}")
    if part_rows < 1:
        raise CorpusError(f"--part-rows must be >= 1, got {part_rows}")
    if engine == "local":
        for flag, value, default in (("--workers", workers, 1), ("--gpus-per-worker", gpus_per_worker, 0),
                                     ("--ray-address", ray_address, None)):
            if value != default:
                raise CorpusError(f"{flag} is for --engine ray; the local engine is one process (on a GPU: "
                                  "--device cuda)")


def _ray_settings(given: dict, gpus_per_worker: float):
    """The workers' settings, checked on the driver: their device is decided by ``--gpus-per-worker``, and a
    driver without a GPU checks CUDA settings as the workers will run them, less what only a GPU can check
    (the workers' own settings check that, where the GPU is)."""
    device = "cuda" if gpus_per_worker > 0 else "cpu"
    if given.get("device", device) != device:
        raise CorpusError(f"--device {given['device']}: on the Ray engine the workers' device follows "
                          f"--gpus-per-worker ({gpus_per_worker} gives {device})")
    if device == "cpu":
        return job_settings({**given, "device": "cpu"})
    checked = {k: v for k, v in given.items() if k not in ("device", "dtype", "exact_kernel")}
    return job_settings({**checked, "device": "cpu"}).model_copy(update={
        "device": device, "dtype": given.get("dtype", "auto"), "exact_kernel": given.get("exact_kernel", "auto")})


def embed_corpus(inputs: Sequence[str | os.PathLike], out: str | os.PathLike, *, model: str | os.PathLike | None = None,
                 pieces: int | None = None, hashes: int | str | None = None, id_field: str = "id",
                 text_field: str = "text", engine: str = "local", ray_address: str | None = None, workers: int = 1,
                 threads_per_worker: int | None = None, gpus_per_worker: float = 0, overwrite: bool = False,
                 part_rows: int = PART_ROWS, progress: bool = True, **serve) -> dict:
    """Embed every document of ``inputs`` (JSONL or Parquet files, folders of text files) into ``out``;
    returns the manifest it wrote. ``serve`` takes the server settings that apply to a job (work.py's
    VECTOR_SETTINGS and BATCH_SETTINGS, as ServeSettings fields). Raises CorpusError when the job cannot
    run as asked; bad rows never raise."""
    _check_options(engine, workers, threads_per_worker, gpus_per_worker, pieces, part_rows, ray_address, serve)
    given = {k: v for k, v in serve.items() if v is not None}
    if model is not None:
        given["model"] = Path(model)
    if hashes is not None:
        given["hashes"] = hashes
    given["threads"] = threads_per_worker
    if engine == "ray":
        given["threads"] = threads_per_worker = threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        settings = _ray_settings(given, gpus_per_worker)
    else:
        settings = job_settings(given)
    sources = plan_sources(inputs)
    path = model_path(settings)
    fingerprint = {"model_digest": model_digest(path), "pieces": pieces, "id_field": id_field,
                   "text_field": text_field, "normalize": True, **resolved_settings(settings)}
    store = OutputStore(out)
    earlier = store.prepare(fingerprint, overwrite)
    try:
        dimension = json.loads((path / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    except (OSError, ValueError, KeyError) as exc:
        raise CorpusError(f"--model {path}: config.json has no readable hidden_size ({exc})") from None
    manifest = {
        "format": FORMAT, "tool": "yoso-embed", "version": package_version(), "state": "running",
        "model": {"path": str(path), "digest": fingerprint["model_digest"], "dimension": dimension},
        "settings": fingerprint,
        "run": {"engine": engine, "inputs": [str(s.path) for s in sources], "workers": workers,
                "threads_per_worker": threads_per_worker, "gpus_per_worker": gpus_per_worker,
                "ray_address": ray_address, "part_rows": part_rows, "started": _now(),
                **{k: getattr(settings, k) for k in BATCH_SETTINGS}},
        "runs": (earlier or {}).get("runs", 0) + 1,
    }
    store.write_manifest(manifest)
    done, before, _ = store.written()
    report = RunReport(progress=progress)
    admission = Admission(done)
    rows = read_documents(sources, id_field, text_field)
    if before:
        report.say(f"yoso-embed: {before} documents already in {store.parts}; skipping their ids")
    total = count_rows(sources)
    if engine == "local":
        embedder = DocumentEmbedder(settings, pieces)
        embedder.start()
        try:
            report.open_bar(total, "embedding")
            run_local(embedder, rows, admission, store, report, part_rows=part_rows)
        finally:
            report.close_bar()
            embedder.close()
    else:
        from .ray_engine import RayJob, run_ray

        run_ray(RayJob(settings=settings, pieces=pieces, digest=fingerprint["model_digest"], workers=workers,
                       threads_per_worker=threads_per_worker, gpus_per_worker=gpus_per_worker,
                       address=ray_address, part_rows=part_rows),
                rows, admission, store, report, total)
    _, documents, repeated = store.written()
    counts = report.counts()
    failed = counts["bad_by_kind"].get("embed_failed", 0)
    manifest.update(state="complete" if failed == 0 and repeated == 0 else "incomplete",
                    counts={"documents": documents, "parts": len(store.part_files()), "already_done": admission.skipped,
                            **counts, "repeated_ids_in_output": repeated},
                    bad_rows=report.bad_rows)
    manifest["run"]["finished"] = _now()
    store.write_manifest(manifest)
    return manifest
