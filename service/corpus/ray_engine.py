"""The Ray engine: the same documents, embedded by a pool of Ray Data workers that each load the model once.

The driver streams the input through the same reader and admission as the local engine (bad rows, duplicate
ids and ids already written are settled there, once), and stages the admitted documents as Parquet shards
in ``DIR/_staging``. Then ``ray.data.read_parquet`` → ``map_batches`` over :class:`RayEmbedder` (one server
engine per worker, ``--workers`` of them, each with ``--threads-per-worker`` CPUs and ``--gpus-per-worker``
GPUs) → each batch written by its worker as one part, named by its ids, so a task Ray retries after a
worker died rewrites the same part instead of adding one. The driver only counts the small summaries
that come back. Ray is started for the job (limited to what the workers need, no dashboard) unless
``--ray-address`` names a cluster, whose workers must see ``DIR``, the model and the inputs at the same paths.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from typing import Iterable

from ..loading import model_path
from ..settings import ServeSettings
from .report import RunReport
from .sources import Admission, BadRow, CorpusError, Document
from .store import OutputStore
from .work import BATCH_SETTINGS, DocumentEmbedder, job_settings, model_digest, resolved_settings

# Documents of one worker's batch in the engine at once: two full batches' worth of short texts.
IN_FLIGHT_PER_WORKER = 128
# Logical CPUs a job's own Ray keeps beyond the workers', for Ray Data's read tasks.
READ_CPUS = 1


@dataclass(frozen=True)
class RayJob:
    settings: ServeSettings
    pieces: int | None
    digest: str
    workers: int
    threads_per_worker: int
    gpus_per_worker: float
    address: str | None
    part_rows: int

    def worker_settings(self) -> dict:
        """What every worker builds its engine from: every vector setting resolved on the driver (a worker on
        another machine must not resolve auto its own way), the batch settings, the model and threads."""
        s = self.settings
        return {**resolved_settings(s), **{k: getattr(s, k) for k in BATCH_SETTINGS},
                "model": None if s.model is None else str(s.model), "threads": self.threads_per_worker}


def import_ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise CorpusError("--engine ray needs Ray Data: pip install 'yoso-serve[ray]'") from None
    return ray


class RayEmbedder:
    """One Ray Data worker: the server's engine, loaded once; each batch of staged documents becomes one
    part in ``DIR`` and a summary row per document (its tokens, or why it failed) for the driver."""

    def __init__(self, settings: dict, pieces: int | None, digest: str, out: str, token: str) -> None:
        self.settings = job_settings(settings)
        found = model_digest(model_path(self.settings))
        if found != digest:
            raise CorpusError(f"this worker's model ({model_path(self.settings)}) has digest {found}, the job's "
                              f"{digest}: every worker must see the same model at the same path")
        self.store, self.token = OutputStore(out), token
        self.embedder = DocumentEmbedder(self.settings, pieces)
        self.embedder.start()

    def __call__(self, batch):
        import pyarrow as pa

        docs = [Document(i, t, w) for i, t, w in zip(batch.column("id").to_pylist(), batch.column("text").to_pylist(),
                                                     batch.column("where").to_pylist())]
        results = self.embedder.embed_all(docs, IN_FLIGHT_PER_WORKER)
        rows = [r for r in results if not isinstance(r, BadRow)]
        if rows:
            self.store.write_part(rows, self.embedder.pieces is not None, self.token)
        bad = [r if isinstance(r, BadRow) else None for r in results]
        return pa.table({
            "id": [d.id for d in docs], "where": [d.where for d in docs],
            "tokens": pa.array([0 if isinstance(r, BadRow) else r["tokens"] for r in results], pa.int64()),
            "truncated": [False if isinstance(r, BadRow) else r.get("truncated", False) for r in results],
            "kind": pa.array([None if b is None else b.kind for b in bad], pa.string()),
            "message": pa.array([None if b is None else b.message for b in bad], pa.string())})


def _stage(rows: Iterable[Document | BadRow], admission: Admission, store: OutputStore, report: RunReport,
           total: int, shard_rows: int) -> tuple[int, int]:
    """Write the admitted documents as shards of ``shard_rows`` in ``DIR/_staging``; returns (documents,
    shards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    store.staging.mkdir(parents=True, exist_ok=True)
    shard: list[Document] = []
    staged = shards = 0

    def flush() -> None:
        nonlocal shards
        table = pa.table({"id": [d.id for d in shard], "text": [d.text for d in shard],
                          "where": [d.where for d in shard]})
        pq.write_table(table, store.staging / f"shard-{shards:06d}.parquet", compression="zstd")
        shards += 1
        shard.clear()

    report.open_bar(total, "checking input")
    try:
        for row in rows:
            doc = row if isinstance(row, BadRow) else admission.check(row)
            if isinstance(doc, BadRow):
                report.bad(doc)
                continue
            report.step()
            if doc is None:
                continue
            shard.append(doc)
            staged += 1
            if len(shard) >= shard_rows:
                flush()
        if shard:
            flush()
    finally:
        report.close_bar()
    return staged, shards


def _start_ray(ray, job: RayJob) -> bool:
    """Connect to ``job.address``, or start a Ray for this job; True when this call started one."""
    if ray.is_initialized():
        return False
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING, configure_logging=True)
    if job.address is not None:
        ray.init(address=job.address, **quiet)
    else:
        gpus = job.workers * job.gpus_per_worker
        ray.init(num_cpus=job.workers * job.threads_per_worker + READ_CPUS, num_gpus=gpus if gpus else None,
                 include_dashboard=False, **quiet)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job's own bar counts the documents
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return True


def run_ray(job: RayJob, rows: Iterable[Document | BadRow], admission: Admission, store: OutputStore,
            report: RunReport, total: int) -> None:
    """Embed every admitted document of ``rows`` into parts of ``store`` on Ray Data."""
    ray = import_ray()
    try:
        staged, shards = _stage(rows, admission, store, report, total, job.part_rows)
        if staged == 0:
            return
        started = _start_ray(ray, job)
        try:
            # One block per shard, so that every worker gets work however small the corpus: Ray Data's newer
            # Parquet reader (datasource v2, the default of 2.60) packs small files into one read task and
            # ignores override_num_blocks; the first reader honours it.
            ray.data.DataContext.get_current().use_datasource_v2 = False
            ds = ray.data.read_parquet(str(store.staging), override_num_blocks=shards)
            gpus = {"num_gpus": job.gpus_per_worker} if job.gpus_per_worker > 0 else {}
            ds = ds.map_batches(RayEmbedder, batch_size=job.part_rows, batch_format="pyarrow",
                                compute=ray.data.ActorPoolStrategy(size=job.workers), num_cpus=job.threads_per_worker,
                                fn_constructor_kwargs={"settings": job.worker_settings(), "pieces": job.pieces,
                                                       "digest": job.digest, "out": str(store.path),
                                                       "token": store.token}, **gpus)
            report.open_bar(staged, f"embedding on {job.workers} Ray worker{'s' * (job.workers > 1)}")
            for summary in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in summary.to_pylist():
                    if row["kind"] is not None:
                        report.bad(BadRow(row["kind"], row["where"], row["message"], row["id"]))
                    else:
                        report.done(row["tokens"], row["truncated"])
        except CorpusError:
            raise
        except Exception as exc:  # Ray's own errors carry the worker's traceback; the message is what matters
            raise CorpusError(f"the Ray job failed: {type(exc).__name__}: {exc}") from None
        finally:
            report.close_bar()
            if started:
                ray.shutdown()
    finally:
        shutil.rmtree(store.staging, ignore_errors=True)
