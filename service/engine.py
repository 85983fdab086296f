"""The engine: plain parameters in, arrays out. Tokenise → queue → batch → forward → split.

The app hands the engine dataclasses (never pydantic objects); the engine raises the typed errors
of :mod:`errors`. Tokenisation runs in a small thread pool so it never blocks the event loop; the
model runs on the scheduler's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import numpy as np
import torch

from yoso_serve.model.hashes import auto_crossover, hashes_header, resolve_hashes
from yoso_serve.model.served import ServedModel

from .admission import SPEED_PROBE, request_arrival, request_budget
from .errors import ClientGone, NotReady
from .inputs import split_texts
from .metrics import ServiceMetrics
from .params import ClassifyParams, EmbedParams, HiddenParams, Output, PiecesParams, Usage
from .loading import LoadedModel, check_model_limits
from .outputs import document_pieces, head_scores, piece_vectors, pooled_documents
from .requests import RequestRules
from .scheduler import BatchScheduler, OutputKind, WorkItem
from .settings import ServeSettings
from .threads import in_own_thread
from .zero_shot import DEFAULT_SCORE_CENTER, zero_shot_classify

log = logging.getLogger("yoso_serve.service")

WARMUP_TEXT = "warm-up"


Watch = Callable[[], Awaitable[object]]  # completes when the client disconnects


class Engine:
    """Serves one model. ``load_model()`` (called on a worker thread at start) returns a
    :class:`LoadedModel` (the model with its runtime, see loading.py) or a bare :class:`ServedModel`
    (an ``EncoderModel``, say: tests, embedders); ``settings`` sets every limit. What depends on the
    model is None until it is loaded."""

    def __init__(self, settings: ServeSettings, metrics: ServiceMetrics,
                 load_model: Callable[[], LoadedModel | ServedModel], *, model_name: str,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self._on_ready = on_ready  # called once, warmed up, just before the engine turns ready
        self.metrics = metrics
        self.model_name = model_name
        self._load_model = load_model
        self.model: ServedModel | None = None
        self.state = "loading"  # loading → ready → draining; or failed
        self._drain_began: float | None = None  # when a drain began on a ready server (time.monotonic)
        self.failure: str | None = None
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="yoso-tokenize")
        # /tokenize and /decode on a thread of their own: a burst of them (up to a 2 MB body each) cannot
        # queue ahead of the tokenisation of model work, which admission counts and they would not be
        self._text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="yoso-text")
        self.scheduler: BatchScheduler | None = None
        self.device: str | None = None
        self.max_length: int | None = None  # tokens per input, specials included
        self.window: int | None = None  # content tokens per chunked window
        self.fixed_hashes: int | None = None  # the one count an exported graph runs
        self.default_hashes: int | None = None  # the count at and above auto's crossover
        self.exact_below: int | None = None  # auto's crossover, in tokens
        self.rules: RequestRules | None = None  # every per-request rule (requests.py), once the model is known
        self.backend: dict = {}
        self.runtime: str = settings.runtime  # the resolved one once loaded ("auto" means not yet)
        self.runtime_reason: str | None = None

    # --- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Load weights, start the batching loop, run the warm-up batches, then become ready."""
        try:
            await in_own_thread(self._load, "yoso-load")
            if self.state == "draining":  # SIGTERM while loading: nothing to warm up for
                return
            for texts in ([WARMUP_TEXT], SPEED_PROBE):  # the second gives admission its first speed
                out = await self.embed(EmbedParams(texts), warmup=True)
                if not np.isfinite(out.value).all():
                    raise ValueError("warm-up embedding is not finite; the weights are broken")
        except NotReady:
            if self.state == "draining":
                return
            raise
        except Exception as exc:
            self.state, self.failure = "failed", f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (ValueError, OSError)):  # a bad model or setting: its message says it all
                log.error("model failed to start: %s", self.failure)
            else:  # anything else is ours to debug
                log.exception("model failed to start")
            raise
        if self.state != "loading":
            return
        if self._on_ready is not None:
            self._on_ready()
        self.state = "ready"
        self.metrics.ready.set(1)
        log.info("ready: %s on %s, %d hashes, runtime %s, backend %s", self.model_name, self.device,
                 self.default_hashes, self.runtime, self.backend.get("backend"))

    def _load(self) -> None:
        s = self.settings
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        self.device = s.resolved_device()
        loaded = self._load_model()
        if not isinstance(loaded, LoadedModel):  # a loader that hands over a bare model (tests, embedders)
            loaded = LoadedModel(loaded, loaded.runtime, "the model the loader returned")
        model = loaded.model
        cfg = model.config
        self.max_length, self.window = check_model_limits(s, model)
        self.fixed_hashes = model.fixed_hashes
        self.default_hashes = resolve_hashes(cfg, s.hashes, source="setting", max_hashes=s.max_hashes,
                                             fixed=self.fixed_hashes, n_tokens=self.max_length)
        self.exact_below = auto_crossover(s.auto_exact_below, loaded.runtime)
        self.model = model.to(self.device).eval()
        self.rules = RequestRules(s, cfg, model.has_classifier, self.max_length, self.fixed_hashes, self.exact_below)
        self.backend = model.backend_info()
        self.runtime, self.runtime_reason = loaded.runtime, loaded.reason
        self.metrics.set_model_info(model=self.model_name, hashes=self.default_hashes,
                                    backend=str(self.backend.get("backend")), device=self.device,
                                    runtime=self.runtime, max_length=self.max_length, policy=str(s.hashes),
                                    auto_exact_below=self.exact_below)
        self.scheduler = BatchScheduler(
            self._forward, max_batch_tokens=s.max_batch_tokens, max_batch_requests=s.max_batch_requests,
            max_wait_ms=s.max_wait_ms, max_queue_tokens=s.max_queue_tokens, metrics=self.metrics,
            max_padding_tokens=s.padding_limit(self.device), nice=s.forward_nice)
        self.scheduler.start()

    def begin_drain(self) -> None:
        """SIGTERM: not ready any more and no new work; what is queued, and every request that arrived
        before (still reading its body or tokenising), still runs."""
        if self.state == "ready":
            self._drain_began = time.monotonic()
        if self.state in ("loading", "ready"):
            self.state = "draining"
        self.metrics.ready.set(0)
        if self.scheduler is not None:
            self.scheduler.stop_accepting()

    def close(self, timeout: float) -> None:
        self.begin_drain()
        if self.scheduler is not None:
            self.scheduler.close(timeout)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    # --- public calls -----------------------------------------------------------------
    def admit_now(self) -> None:
        """The edge's check before the app parses a request of model work: Overloaded (429) when the queue
        ahead already outlasts the request's deadline, the same check it would meet before tokenising, without
        the validation and routing that made up about half of a refusal's time on the event loop. Only while
        ready: a loading or draining server answers from the route, as before."""
        if self.state == "ready":
            self.scheduler.admit(request_budget(self.settings.request_timeout))

    def check(self, p: EmbedParams | PiecesParams, *, warmup: bool = False) -> int | str:
        """Every check :meth:`embed` (EmbedParams) or :meth:`embed_pieces` (PiecesParams) makes before it
        tokenises, so that a route calling several of them refuses a request before any of them runs;
        returns the request's hash count."""
        self._check_open(warmup and not isinstance(p, PiecesParams))
        return self.rules.verify(p)

    async def check_all(self, p: EmbedParams | PiecesParams) -> None:
        """:meth:`check`, and with long_input 'error' the inputs' token counts too (a tokenisation that is
        thrown away): for a route that runs another call first and must not have run it for nothing."""
        self.check(p)
        if p.long_input == "error":
            await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self._split, p.texts, p.truncation_direction, p.long_input, False,
                getattr(p, "chunk_hint", False))

    async def embed(self, p: EmbedParams, watch: Watch | None = None, *, warmup: bool = False) -> Output:
        """Pooled embeddings (n, d) float32, normalised if asked, chunked long inputs combined."""
        hashes = self.check(p, warmup=warmup)
        t0 = time.monotonic()
        pieces, _ = await self._tokenize(p.texts, p.truncation_direction, p.long_input,
                                         chunk_hint=p.chunk_hint)
        usage = Usage(tokenize_ms=1000 * (time.monotonic() - t0))
        flat = [(i, ids, w) for i, windows in enumerate(pieces) for ids, w in windows]
        owners = [i for i, *_ in flat]
        rows = await self._run([ids for _, ids, _ in flat], hashes, OutputKind.EMBED, p.pooling, usage, watch, owners)
        return Output(pooled_documents(len(p.texts), owners, [w for *_, w in flat], rows,
                                       dimensions=p.dimensions, normalize=p.normalize), usage)

    async def embed_all(self, p: HiddenParams, watch: Watch | None = None) -> Output:
        """Last hidden states per input: a list of (n_tokens_i, d) float32 arrays."""
        self._check_open()
        hashes = self.rules.verify(p)
        rows, usage, _ = await self._run_whole_inputs(p, hashes, OutputKind.HIDDEN, watch, vector_tokens=1)
        return Output(rows, usage)

    async def embed_pieces(self, p: PiecesParams, watch: Watch | None = None) -> Output:
        """Per input, from one pass: its pooled embedding (as :meth:`embed` without chunking) and the mean
        token state of each consecutive ``piece_tokens``-token piece (model/pieces.py), with each piece's
        token and character bounds: ``[(vector (d,), pieces (k, d), [(tok_a, tok_b)], [(char_a, char_b)])]``."""
        hashes = self.check(p)
        size = self.rules.piece_tokens(p)
        # the token states of one pass per input, and the character offsets of the same tokenisation
        vectors, usage, offsets = await self._run_whole_inputs(p, hashes, OutputKind.HIDDEN, watch, offsets=True,
                                                               vector_tokens=size, piece_tokens=size)
        return Output([document_pieces(v, len(offs), offs, size, p.normalize) for v, offs in zip(vectors, offsets)],
                      usage)

    async def classify(self, p: ClassifyParams, watch: Watch | None = None) -> Output:
        """Per input, ``[(label, score), ...]`` sorted by score, highest first."""
        self._check_open()
        if p.labels is None:
            return await self._classify_head(p, watch)
        return await zero_shot_classify(p, watch, embed=self.embed, check_texts=self.rules.texts,
                                        max_labels=self.settings.max_client_batch_size, center=self.score_center)

    async def _run_whole_inputs(self, p, hashes: int | str, kind: OutputKind, watch: Watch | None, *,
                                offsets: bool = False, vector_tokens: int | None = None,
                                piece_tokens: int | None = None) -> tuple[list, Usage, list | None]:
        """Tokenise p.texts (one window each: no chunking) and run them; (rows, usage, each text's character
        offsets per token when ``offsets``, else None).

        With ``vector_tokens`` the answer holds a vector per that many tokens of each input (1: /embed_all's token
        states; n: /embed_pieces' pieces), and a request may ask for at most ``max_batch_tokens`` vectors: the
        states of one full batch, about 125 MB of JSON at 384 dimensions."""
        t0 = time.monotonic()
        pieces, spans = await self._tokenize(p.texts, p.truncation_direction, p.long_input, offsets=offsets)
        usage = Usage(tokenize_ms=1000 * (time.monotonic() - t0))
        seqs = [w[0][0] for w in pieces]
        if vector_tokens is not None:
            self.rules.answer_size(seqs, vector_tokens, isinstance(p, PiecesParams))
        return await self._run(seqs, hashes, kind, None, usage, watch, pieces=piece_tokens), usage, spans

    async def _classify_head(self, p: ClassifyParams, watch: Watch | None) -> Output:
        hashes = self.rules.verify(p)
        rows, usage, _ = await self._run_whole_inputs(p, hashes, OutputKind.CLASSIFY, watch)
        return Output(head_scores(np.stack(rows), self.model.id2label, raw_scores=p.raw_scores,
                                  multi_label=p.multi_label), usage)

    async def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[dict]]:
        """Per input, its tokens: ``{id, text, start, stop, special}`` (offsets in characters)."""
        self._check_open()
        self.rules.texts(texts)
        tok = self.model.tokenizer
        specials = set(tok.wrap([]))

        def tokens() -> list[list[dict]]:  # on the worker: a 2 MB text is ~500k tokens, seconds of Python
            out = []
            for text, (ids, offsets) in zip(texts, tok.encode_with_offsets(texts, add_special_tokens)):
                names = tok.decode_tokens(ids)
                out.append([{"id": i, "text": name if (special := i in specials and (a, b) == (0, 0))
                             else text[a:b], "start": a, "stop": b, "special": special}
                            for i, name, (a, b) in zip(ids, names, offsets)])
            return out

        return await asyncio.get_running_loop().run_in_executor(self._text_pool, tokens)

    async def decode(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Per list of token ids, its text (the inverse of tokenize)."""
        self._check_open()
        self.rules.token_ids(batch, self.model.tokenizer.vocab_size)
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, lambda: self.model.tokenizer.tokenizer.decode_batch(batch, skip_special_tokens))

    @property
    def score_center(self) -> float:
        """The cosine /rerank and zero-shot multi-label /classify score 0.5: the model's (config.json
        ``score_center``), else DEFAULT_SCORE_CENTER."""
        center = getattr(self.model.config, "score_center", None) if self.model is not None else None
        return DEFAULT_SCORE_CENTER if center is None else float(center)

    def info(self) -> dict:
        cfg = self.model.config if self.model is not None else None
        s = self.settings
        return {
            "model": self.model_name,
            "state": self.state,
            "config": None if cfg is None else {
                k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "max_position_embeddings", "num_hash", "hash_code_len",
                                             "use_expectation", "pooling", "attention_type")},
            "max_input_length": self.max_length,
            "hashes": s.hashes,
            "default_hashes": self.default_hashes,
            "auto_exact_below": self.exact_below,
            "max_hashes": s.max_hashes,
            "has_classifier": None if cfg is None else self.model.has_classifier,
            "labels": None if cfg is None else list(self.model.id2label.values()),
            "score_center": None if cfg is None else self.score_center,
            "backend": self.backend,
            "device": self.device,
            "runtime": self.runtime,
            "runtime_reason": self.runtime_reason,
            "limits": {k: getattr(s, k) for k in (
                "max_batch_tokens", "max_batch_requests", "max_wait_ms", "max_queue_tokens",
                "max_client_batch_size", "payload_limit", "request_timeout", "chunk_overlap")}
            | {"max_padding_tokens": None if self.scheduler is None else self.scheduler.max_padding_tokens},
        }

    # --- internals --------------------------------------------------------------------
    def _arrived_before_drain(self) -> bool:
        """The current request reached the server while it was ready, before the drain began."""
        arrival = request_arrival.get()
        return self._drain_began is not None and arrival is not None and arrival < self._drain_began

    def _check_open(self, warmup: bool = False) -> None:
        if self.state == "ready" or (warmup and self.state == "loading" and self.scheduler is not None):
            return
        if self.state == "draining" and self._arrived_before_drain():
            return
        reason = {"loading": "model is loading", "draining": "server is shutting down",
                  "failed": f"model failed to load ({self.failure})"}[self.state]
        raise NotReady(f"{reason}; retry later or on another replica")

    async def _tokenize(self, texts: list[str], side: str, long_input: str, *, offsets: bool = False,
                        chunk_hint: bool = False,
                        ) -> tuple[list[list[tuple[list[int], int]]], list[list[tuple[int, int]]] | None]:
        """Per text, its windows ``(ids with specials, weight)``: one window unless chunked; and with
        ``offsets`` (not chunked) each text's character offsets per token, from the same tokenisation.
        ``chunk_hint``: the route takes long_input 'chunk', so the over-length error may suggest it."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with self.scheduler.checked(request_budget(self.settings.request_timeout), sum(map(len, texts))) as done:
            pieces, spans = await loop.run_in_executor(self._tokenize_pool, self._split, texts, side, long_input,
                                                       offsets, chunk_hint)
            done.lengths = [len(ids) for windows in pieces for ids, _ in windows]
        self.metrics.tokenize_duration.observe(time.monotonic() - t0)
        for n in done.lengths:
            self.metrics.input_length.observe(n)
        return pieces, spans

    def _split(self, texts: list[str], side: str, long_input: str, offsets: bool = False, chunk_hint: bool = False):
        return split_texts(self.model.tokenizer, texts, side, long_input, max_length=self.max_length,
                           window=self.window, overlap=self.settings.chunk_overlap, offsets=offsets,
                           chunk_hint=chunk_hint)

    async def _run(self, seqs: list[list[int]], hashes: int | str, kind: OutputKind, pooling: str | None,
                   usage: Usage, watch: Watch | None, owners: list[int] | None = None,
                   pieces: int | None = None) -> list:
        """Queue one item per sequence at the count its own length resolves ``hashes`` to (the batcher
        groups by it), wait for all (or the client leaving), fill ``usage``. ``owners``: each sequence's input."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + request_budget(self.settings.request_timeout)
        counts = [self.rules.hashes(hashes, len(ids)) for ids in seqs]
        usage.hashes = hashes_header(counts, owners)
        items = [WorkItem(ids, count, kind, pooling, deadline, loop.create_future(), loop, pieces=pieces)
                 for ids, count in zip(seqs, counts)]
        self.scheduler.submit(items, accepted=self._arrived_before_drain())
        gathered = asyncio.gather(*(it.future for it in items), return_exceptions=True)
        if watch is not None:
            watcher = asyncio.ensure_future(watch())
            await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done():
                self.scheduler.cancel(items)
                raise ClientGone("client disconnected")
            watcher.cancel()
        results = await gathered
        for r in results:
            if isinstance(r, BaseException):  # the scheduler only fails items with ServiceErrors
                raise r
        for count in counts:  # counted once run, like yoso_tokens_processed
            self.metrics.inputs_by_hashes.labels(str(count)).inc()
        usage.tokens += sum(len(s) for s in seqs)
        usage.queue_ms = max(1000 * it.queue_wait for it in items)
        usage.inference_ms += sum({it.batch_id: 1000 * it.inference for it in items}.values())
        return results

    def _forward(self, batch: list[WorkItem]) -> list[np.ndarray]:
        """Worker thread: pad, run under inference_mode, split back one output per item."""
        first = batch[0]
        longest = max(it.length for it in batch)
        ids = torch.full((len(batch), longest), self.model.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, it in enumerate(batch):
            ids[row, : it.length] = torch.tensor(it.ids, dtype=torch.long)
            mask[row, : it.length] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            if first.kind is OutputKind.EMBED:
                out = self.model.embed(ids, mask, hashes=first.hashes, pooling=first.pooling)
            elif first.kind is OutputKind.HIDDEN:
                out = self.model.last_hidden(ids, mask, hashes=first.hashes)
            else:
                out = self.model.classify(ids, mask, hashes=first.hashes)
        out = out.float().cpu().numpy()
        if first.kind is OutputKind.HIDDEN:  # pieces here, on this thread (outputs.piece_vectors says why)
            return [out[row, : it.length] if it.pieces is None else piece_vectors(out[row, : it.length], it.pieces)
                    for row, it in enumerate(batch)]
        return list(out)

