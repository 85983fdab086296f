"""The engine: plain parameters in, arrays out. Tokenise → queue → batch → forward → split.

The app hands the engine dataclasses (never pydantic objects); the engine raises the typed errors
of :mod:`errors`. Tokenisation runs in a small thread pool so it never blocks the event loop; the
model runs on the scheduler's worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import numpy as np
import torch

from yoso_serve.model.hashes import HashesError, auto_crossover, hashes_header, resolve_hashes
from yoso_serve.model.pieces import piece_bounds, piece_means

from .admission import SPEED_PROBE, request_arrival, request_budget
from .errors import ClientGone, InvalidInput, NotReady
from .metrics import ServiceMetrics
from .params import ClassifyParams, EmbedParams, HiddenParams, Output, PiecesParams, Usage
from .loading import LoadedModel, ServedModel, check_model_limits
from .scheduler import BatchScheduler, OutputKind, WorkItem
from .settings import ServeSettings
from .zero_shot import DEFAULT_SCORE_CENTER, ranked, softmax, zero_shot_classify

log = logging.getLogger("yoso_serve.service")

WARMUP_TEXT = "warm-up"
# /embed_pieces' default piece size: the default model's pieces were trained and measured at 64 and 128 tokens
# (docs/training.md, item 8); 128 gives half the vectors to store.
PIECE_TOKENS = 128


Watch = Callable[[], Awaitable[object]]  # completes when the client disconnects


def chunk_windows(n_tokens: int, window: int, overlap: int) -> list[tuple[int, int, int]]:
    """Split ``n_tokens`` content tokens into ``(start, stop, weight)`` windows of at most ``window``
    tokens, neighbours sharing ``overlap``. ``weight`` counts the tokens a window adds that no
    earlier window had, so the weights sum to ``n_tokens`` (overlap counted once)."""
    if not 0 <= overlap < window:
        raise ValueError(f"chunk overlap {overlap} must be in [0, window {window})")
    if n_tokens == 0:  # a text the tokenizer drops whole ("\x07"): its specials alone, weight 1, not 0/0
        return [(0, 0, 1)]
    windows, start, covered = [], 0, 0
    while True:
        stop = min(start + window, n_tokens)
        windows.append((start, stop, stop - covered))
        covered = stop
        if stop >= n_tokens:
            return windows
        start = stop - overlap


async def in_own_thread(fn: Callable[[], object], name: str) -> object:
    """``fn()`` on a new thread that ends with it. Not ``asyncio.to_thread``: the model load runs torch ops
    in parallel, and OpenMP keeps a team for every thread that ran a parallel region while that thread
    lives; with the executor's long-lived thread holding one, the batcher's own team ran a 1 × 128 forward
    in 32–36 ms instead of 22 (AMD EPYC, 2 cores; every forward runs on the batcher thread)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(error: BaseException | None, value: object) -> None:
        if done.done():  # the awaiting coroutine was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def target() -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine, raised there
            loop.call_soon_threadsafe(settle, exc, None)
        else:
            loop.call_soon_threadsafe(settle, None, value)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit length (a zero row stays zero)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _char_bounds(offsets: list[tuple[int, int]], bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character bounds of each token range: from its first content token's start to its last one's stop;
    special tokens (offset (0, 0)) have no text, so a range of them only is empty where the text stopped."""
    out, end = [], 0
    for a, b in bounds:
        text = [o for o in offsets[a:b] if o[1] > o[0]]
        if text:
            out.append((text[0][0], text[-1][1]))
            end = text[-1][1]
        else:
            out.append((end, end))
    return out


class Engine:
    """Serves one model. ``load_model()`` (called on a worker thread at start) returns a
    :class:`LoadedModel` (the model with its runtime, see loading.py) or a bare :class:`ServedModel`
    (an ``EncoderModel``, say: tests, embedders); ``settings`` sets every limit. What depends on the
    model is None until it is loaded."""

    def __init__(self, settings: ServeSettings, metrics: ServiceMetrics,
                 load_model: Callable[[], LoadedModel | ServedModel], *, model_name: str) -> None:
        self.settings = settings
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
        self.backend = model.backend_info()
        self.runtime, self.runtime_reason = loaded.runtime, loaded.reason
        self.metrics.set_model_info(model=self.model_name, hashes=self.default_hashes,
                                    backend=str(self.backend.get("backend")), device=self.device,
                                    runtime=self.runtime, max_length=self.max_length, policy=str(s.hashes),
                                    auto_exact_below=self.exact_below)
        self.scheduler = BatchScheduler(
            self._forward, max_batch_tokens=s.max_batch_tokens, max_batch_requests=s.max_batch_requests,
            max_wait_ms=s.max_wait_ms, max_queue_tokens=s.max_queue_tokens, metrics=self.metrics,
            max_padding_tokens=s.padding_limit(self.device))
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
    def check(self, p: EmbedParams | PiecesParams, *, warmup: bool = False) -> int | str:
        """Every check :meth:`embed` (EmbedParams) or :meth:`embed_pieces` (PiecesParams) makes before it
        tokenises, so that a route calling several of them refuses a request before any of them runs;
        returns the request's hash count."""
        if isinstance(p, PiecesParams):
            self._check_open()
            if self.model.config.pooling != "mean":
                raise InvalidInput("pieces are means of token states, and this model pools by its first token "
                                   "(pooling 'cls'); use /embed or /embed_all")
            size = self._piece_tokens(p)
            if not 1 <= size <= self.max_length:
                raise InvalidInput(f"piece_tokens must be in [1, {self.max_length}] (the model's input length), "
                                   f"got {size}", param="piece_tokens")
            return self._check_hidden(p)
        self._check_open(warmup)
        hashes = self._hashes(p.hashes)
        self._check_texts(p.texts)
        if p.dimensions is not None and not 1 <= p.dimensions <= self.model.config.hidden_size:
            raise InvalidInput(f"dimensions must be in [1, {self.model.config.hidden_size}] (the "
                               f"model's hidden size), got {p.dimensions}", param="dimensions")
        return hashes

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
        rows = await self._run([ids for _, ids, _ in flat], hashes, OutputKind.EMBED, p.pooling, usage, watch, [i for i, *_ in flat])
        vectors = np.zeros((len(p.texts), rows[0].shape[0]), dtype=np.float32)
        weights = np.zeros(len(p.texts), dtype=np.float32)
        for (i, _, w), row in zip(flat, rows):
            vectors[i] += w * row
            weights[i] += w
        vectors /= weights[:, None]
        if p.dimensions is not None:
            vectors = np.ascontiguousarray(vectors[:, : p.dimensions])
        if p.normalize:
            vectors = unit_rows(vectors)
        return Output(vectors, usage)

    async def embed_all(self, p: HiddenParams, watch: Watch | None = None) -> Output:
        """Last hidden states per input: a list of (n_tokens_i, d) float32 arrays."""
        hashes = self._check_hidden(p)
        rows, usage, _ = await self._run_whole_inputs(p, hashes, OutputKind.HIDDEN, watch, vector_tokens=1)
        return Output(rows, usage)

    def _check_hidden(self, p: HiddenParams) -> int | str:
        self._check_open()
        hashes = self._hashes(p.hashes)
        self._check_texts(p.texts)
        if p.long_input == "chunk":
            raise InvalidInput("long_input='chunk' is only for pooled embeddings (/embed); use "
                               "'truncate' or 'error' here", param="long_input")
        return hashes

    def _piece_tokens(self, p: PiecesParams) -> int:
        return min(PIECE_TOKENS, self.max_length) if p.piece_tokens is None else p.piece_tokens

    async def embed_pieces(self, p: PiecesParams, watch: Watch | None = None) -> Output:
        """Per input, from one pass: its pooled embedding (as :meth:`embed` without chunking) and the mean
        token state of each consecutive ``piece_tokens``-token piece (model/pieces.py), with each piece's
        token and character bounds: ``[(vector (d,), pieces (k, d), [(tok_a, tok_b)], [(char_a, char_b)])]``."""
        hashes = self.check(p)
        size = self._piece_tokens(p)
        # the token states of one pass per input, and the character offsets of the same tokenisation
        states, usage, offsets = await self._run_whole_inputs(p, hashes, OutputKind.HIDDEN, watch, offsets=True,
                                                              vector_tokens=size)
        out = []
        for hidden, offs in zip(states, offsets):
            whole, means, _ = piece_means(torch.from_numpy(hidden)[None], torch.ones(1, len(hidden)), size)
            vector, pieces = whole[0].numpy(), means[0].numpy()
            if p.normalize:
                vector, pieces = unit_rows(vector), unit_rows(pieces)
            bounds = piece_bounds(len(hidden), size)
            out.append((vector, pieces, bounds, _char_bounds(offs, bounds)))
        return Output(out, usage)

    async def classify(self, p: ClassifyParams, watch: Watch | None = None) -> Output:
        """Per input, ``[(label, score), ...]`` sorted by score, highest first."""
        self._check_open()
        if p.labels is None:
            return await self._classify_head(p, watch)
        return await zero_shot_classify(p, watch, embed=self.embed, check_texts=self._check_texts,
                                        max_labels=self.settings.max_client_batch_size, center=self.score_center)

    async def _run_whole_inputs(self, p, hashes: int | str, kind: OutputKind, watch: Watch | None, *,
                                offsets: bool = False, vector_tokens: int | None = None,
                                ) -> tuple[list, Usage, list | None]:
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
            vectors, limit = sum(-(-len(ids) // vector_tokens) for ids in seqs), self.settings.max_batch_tokens
            if vectors > limit:
                pieces_ = isinstance(p, PiecesParams)
                each = f"one per {vector_tokens}-token piece" if pieces_ else "one per token"
                raise InvalidInput(f"the answer would hold {vectors} vectors ({each}), above max_batch_tokens "
                                   f"({limit}) vectors per request; send fewer or shorter inputs"
                                   + (", or larger pieces" if pieces_ else ""), param="inputs")
        return await self._run(seqs, hashes, kind, None, usage, watch), usage, spans

    async def _classify_head(self, p: ClassifyParams, watch: Watch | None) -> Output:
        if not self.model.has_classifier:
            raise InvalidInput("this model has no classification head; pass `labels` to classify "
                               "zero-shot by embedding similarity", param="labels")
        hashes = self._hashes(p.hashes)
        self._check_texts(p.texts)
        if p.long_input == "chunk":
            raise InvalidInput("long_input='chunk' is not supported with a classification head; "
                               "use 'truncate' or 'error'", param="long_input")
        rows, usage, _ = await self._run_whole_inputs(p, hashes, OutputKind.CLASSIFY, watch)
        logits = np.stack(rows)
        if p.raw_scores:
            scores = logits
        elif p.multi_label:
            scores = 1.0 / (1.0 + np.exp(-logits))
        else:
            scores = softmax(logits)
        id2label = self.model.id2label
        return Output(ranked(scores, [id2label.get(i, str(i)) for i in range(logits.shape[1])]), usage)

    async def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[dict]]:
        """Per input, its tokens: ``{id, text, start, stop, special}`` (offsets in characters)."""
        self._check_open()
        self._check_texts(texts)
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
        if len(batch) > self.settings.max_client_batch_size:
            raise InvalidInput(f"{len(batch)} id lists is above max_client_batch_size "
                               f"{self.settings.max_client_batch_size}; split the request", param="ids")
        vocab = self.model.tokenizer.vocab_size
        if any(i >= vocab for ids in batch for i in ids):
            raise InvalidInput(f"token ids must be in [0, {vocab}) (the vocabulary size)", param="ids")
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

    def _hashes(self, requested: int | str | None, n_tokens: int | None = None) -> int | str:
        """A request's count ("auto" stays), or one input's with ``n_tokens``; model/hashes.py decides."""
        try:
            return resolve_hashes(self.model.config, requested, source="request", default=self.settings.hashes,
                                  max_hashes=self.settings.max_hashes, fixed=self.fixed_hashes,
                                  exact_below=self.exact_below, n_tokens=n_tokens)
        except HashesError as exc:
            raise InvalidInput(str(exc), param="hashes") from None

    def _check_texts(self, texts: list[str]) -> None:
        if not texts:
            raise InvalidInput("inputs must not be empty", param="inputs")
        if len(texts) > self.settings.max_client_batch_size:
            raise InvalidInput(f"{len(texts)} inputs is above max_client_batch_size "
                               f"{self.settings.max_client_batch_size}; split the request", param="inputs")
        if any(not t for t in texts):
            raise InvalidInput("inputs must not contain empty strings", param="inputs")
        if self.settings.log_texts:
            log.info("inputs: %r", texts)

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

    def _split(self, texts: list[str], side: str, long_input: str, offsets: bool = False, chunk_hint: bool = False,
               ) -> tuple[list[list[tuple[list[int], int]]], list[list[tuple[int, int]]] | None]:
        tok = self.model.tokenizer
        if long_input != "chunk":
            limit = self.max_length if long_input == "truncate" else None
            if offsets:
                encoded = tok.encode_with_offsets(texts, max_length=limit, truncation_side=side)
            else:
                encoded = [(ids, None) for ids in tok.encode(texts, max_length=limit, truncation_side=side)]
            for i, (ids, _) in enumerate(encoded):
                if len(ids) > self.max_length:
                    # only long_input 'error' (or TEI's truncate: false) gets here: the client turned truncation off
                    raise InvalidInput(f"input {i} has {len(ids)} tokens, above the limit of {self.max_length} (the "
                                       "model's input length), and the request turned truncation off; shorten it, "
                                       "allow truncation" + (", or send long_input='chunk'" if chunk_hint else ""),
                                       param="inputs", index=i)
            return [[(ids, len(ids))] for ids, _ in encoded], [o for _, o in encoded] if offsets else None
        if offsets:
            raise ValueError("character offsets are for whole inputs, not chunks")
        out = []
        for ids in tok.encode(texts, add_special_tokens=False):
            out.append([(tok.wrap(ids[a:b]), w) for a, b, w in
                        chunk_windows(len(ids), self.window, self.settings.chunk_overlap)])
        return out, None

    async def _run(self, seqs: list[list[int]], hashes: int | str, kind: OutputKind, pooling: str | None,
                   usage: Usage, watch: Watch | None, owners: list[int] | None = None) -> list[np.ndarray]:
        """Queue one item per sequence at the count its own length resolves ``hashes`` to (the batcher
        groups by it), wait for all (or the client leaving), fill ``usage``. ``owners``: each sequence's input."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + request_budget(self.settings.request_timeout)
        counts = [self._hashes(hashes, len(ids)) for ids in seqs]
        usage.hashes = hashes_header(counts, owners)
        items = [WorkItem(ids, count, kind, pooling, deadline, loop.create_future(), loop)
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
        if first.kind is OutputKind.HIDDEN:
            return [out[row, : it.length] for row, it in enumerate(batch)]
        return list(out)

