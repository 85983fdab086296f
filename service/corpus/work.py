"""One document through the server's own engine: the settings of a job, the model's digest, and
:class:`DocumentEmbedder`, which both engines (local and Ray) use to turn a document into a row.

The row's vector is what ``POST /embed`` answers for the text (``long_input: "chunk"``, normalised), or
with pieces what ``POST /embed_pieces`` answers (one pass, ``piece_tokens`` as given), because it is made
by the same :class:`yoso_serve.service.Engine` calls: the same tokenisation, chunking, token-budget
batching, forward and pooling, bit for bit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from pydantic import ValidationError

from ..engine import Engine
from ..errors import ServiceError
from ..heap import retain_freed_memory
from ..loading import load_served_model, model_path
from ..metrics import ServiceMetrics
from ..params import EmbedParams, PiecesParams
from ..settings import ServeSettings, describe_errors
from .sources import BadRow, CorpusError, Document

log = logging.getLogger("yoso_serve.service.corpus")

# The server's settings that decide a vector: a rerun into the same folder must keep them. The device, the
# dtypes and the exact kernel are kept resolved (auto made concrete), since auto may differ between machines.
VECTOR_SETTINGS = ("hashes", "auto_exact_below", "max_input_length", "chunk_overlap", "runtime", "dense_dtype",
                   "dtype", "device", "exact_kernel")
# The server's settings that only shape batches (the vectors do not depend on them).
BATCH_SETTINGS = ("max_batch_tokens", "max_batch_requests", "max_padding_tokens")
# A job's requests never time out in the queue and are never refused for a full queue: the job itself
# bounds what it has in flight (local.py), so the engine's admission control has nothing to protect.
JOB_TIMEOUT_S = 1e9
JOB_QUEUE_TOKENS = 1 << 50
_READ_CHUNK = 1 << 20
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "special_tokens_map.json",
                    "tokenizer_config.json")


def job_settings(given: dict) -> ServeSettings:
    """The engine's settings for a job: ``given`` (flag names as ServeSettings fields) over the server's own
    defaults and ``YOSO_<NAME>`` variables; raises CorpusError with the server's wording of what is wrong."""
    try:
        return ServeSettings(**given, request_timeout=JOB_TIMEOUT_S, max_queue_tokens=JOB_QUEUE_TOKENS)
    except ValidationError as err:
        raise CorpusError(describe_errors(err)) from None


def resolved_settings(settings: ServeSettings) -> dict:
    """The settings that decide a vector, auto made concrete where the machine decides it."""
    out = {name: getattr(settings, name) for name in VECTOR_SETTINGS}
    out.update(device=settings.resolved_device(), dtype=settings.resolved_dtype(),
               exact_kernel=settings.resolved_exact_kernel())
    if settings.runtime != "onnx":
        out["dense_dtype"] = settings.resolved_dense_dtype()
    return out


def model_digest(path: Path) -> str:
    """sha256 over the files that decide the model's vectors: config.json, the weights (or the ONNX graph)
    and the tokenizer's files; 32 hex digits."""
    from yoso_serve.model.checkpoint import CheckpointError, weight_files

    try:
        weights = weight_files(path)
    except CheckpointError:
        weights = sorted(path.glob("*.onnx")) + sorted(path.glob("*.onnx.data"))
    files = [path / "config.json", *weights, *(path / n for n in _TOKENIZER_FILES if (path / n).is_file())]
    digest = hashlib.sha256()
    for file in files:
        try:
            digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
            with open(file, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise CorpusError(f"--model {path}: cannot read {file.name} ({exc.strerror or exc})") from None
    return digest.hexdigest()[:32]


class DocumentEmbedder:
    """The server's engine, loaded once, embedding documents one request each (the engine batches the
    requests in flight together by its token budget, as it batches concurrent clients)."""

    def __init__(self, settings: ServeSettings, pieces: int | None) -> None:
        self.settings = settings
        self.pieces = pieces
        retain_freed_memory()  # as yoso-serve does (service/heap.py): this process embeds batch after batch
        self.engine = Engine(settings, ServiceMetrics(settings.max_batch_tokens),
                             lambda: load_served_model(settings), model_name=str(model_path(settings)))

    def start(self) -> None:
        """Load the model and run the engine's warm-up batches (its own event loop, then closed: the engine's
        worker thread serves any loop later)."""
        try:
            asyncio.run(self.engine.start())
        except ServiceError as exc:
            raise CorpusError(f"the model could not start: {exc.message}") from None
        except (ValueError, OSError) as exc:
            raise CorpusError(f"the model could not start: {exc}") from None
        if self.pieces is not None:  # --pieces out of range or a model that cannot: say so before any document
            try:
                self.engine.check(PiecesParams(["x"], piece_tokens=self.pieces))
            except ServiceError as exc:
                raise CorpusError(f"--pieces {self.pieces}: {exc.message}") from None

    @property
    def dimension(self) -> int:
        return self.engine.model.config.hidden_size

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    def close(self) -> None:
        self.engine.close(timeout=10.0)

    async def embed(self, doc: Document) -> dict | BadRow:
        """``doc`` as a row (see store.part_schema), or a BadRow when the engine refuses or fails on it."""
        try:
            if self.pieces is None:
                out = await self.engine.embed(EmbedParams([doc.text], long_input="chunk"))
                return {"id": doc.id, "vector": out.value[0], "tokens": out.usage.tokens, "hashes": out.usage.hashes}
            out = await self.engine.embed_pieces(PiecesParams([doc.text], piece_tokens=self.pieces))
        except ServiceError as exc:
            return BadRow("embed_failed", doc.where, exc.message, doc.id)
        except Exception as exc:  # a forward that fails on one text fails that document only
            log.exception("embedding %s failed", doc.where)
            return BadRow("embed_failed", doc.where, f"{type(exc).__name__}: {exc}", doc.id)
        vector, pieces, tokens, chars = out.value[0]
        truncated = out.usage.tokens >= self.max_length and await self._longer_than_model(doc.text)
        return {"id": doc.id, "vector": vector, "tokens": out.usage.tokens, "hashes": out.usage.hashes,
                "piece_vectors": list(pieces), "piece_tokens": [list(t) for t in tokens],
                "piece_chars": [list(c) for c in chars], "truncated": truncated}

    async def _longer_than_model(self, text: str) -> bool:
        """Whether the text has more tokens than the one pass read (a second tokenisation, only for a text
        that filled the model's length)."""
        tok = self.engine.model.tokenizer
        ids = await asyncio.get_running_loop().run_in_executor(None, lambda: tok.encode([text])[0])
        return len(ids) > self.max_length

    def embed_all(self, docs: list[Document], in_flight: int) -> list[dict | BadRow]:
        """Every doc of ``docs`` (at most ``in_flight`` at a time), in order: for a Ray batch."""

        async def run():
            gate = asyncio.Semaphore(in_flight)

            async def one(doc):
                async with gate:
                    return await self.embed(doc)

            return await asyncio.gather(*(one(d) for d in docs))

        return asyncio.run(run())
