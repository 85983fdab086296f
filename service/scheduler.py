"""The queue and the batching loop: one worker thread turns queued inputs into model batches.

Requests live on the asyncio loop; the model runs on this thread so a forward never blocks the
event loop. Futures are resolved with ``loop.call_soon_threadsafe`` because asyncio futures are
not thread-safe. Which items form a batch is decided by :func:`plan_batch`, and whether a request
may join the queue by :class:`AdmissionPolicy` (both pure, unit-tested).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from itertools import count
from typing import Any, Callable, Hashable

from .admission import Admission, AdmissionPolicy, Running
from .batching import plan_batch
from .errors import ClientGone, DeadlineExceeded, InternalError, NotReady, Overloaded, ServiceError
from .metrics import ServiceMetrics
from .threads import lower_priority

log = logging.getLogger("yoso_serve.service")


class OutputKind(str, Enum):
    """What a batch returns per item; str-valued, so it reads as its text wherever it is shown."""

    EMBED = "embed"  # pooled vector
    HIDDEN = "hidden"  # last hidden states, one row per token
    CLASSIFY = "classify"  # the classification head's logits


@dataclass(eq=False)
class WorkItem:
    """One tokenised input waiting for the model. ``group`` = (hashes, kind, pooling): items batch
    together only when they share it, so one forward has one attention setting and one output kind."""

    ids: list[int]
    hashes: int
    kind: OutputKind
    pooling: str | None
    deadline: float  # time.monotonic() after which the item is dropped with 504, unless its request started
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    queue_wait: float = 0.0
    inference: float = 0.0
    batch_id: int = -1
    first_start: FirstStart | None = None  # shared by the request's items (submit sets it)
    pieces: int | None = None  # HIDDEN: answer (mean, piece means) of this many tokens each, not the states

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def group(self) -> Hashable:
        return (self.hashes, self.kind, self.pooling)


@dataclass(eq=False)
class FirstStart:
    """One admitted request, shared by its inputs: its predicted wait (None when it could not be
    predicted), observed beside the actual one when the first of its inputs starts. A request is timed
    as one unit: its deadline bounds the wait until it starts, so once one of its inputs has run the
    others are never dropped for it, however long the request's own work takes."""

    predicted: float | None
    started: bool = False


@dataclass
class _Tokenized:
    lengths: list[int] = field(default_factory=list)  # tokens per input, once tokenised


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():  # the request already gave up (disconnect)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class BatchScheduler:
    """Owns the queue and the worker thread.

    ``run_batch(items) -> list`` runs one forward and returns one output per item, in order; it is
    called on the worker thread only. A failing batch is retried item by item, so one bad input
    fails only its own request.
    """

    def __init__(self, run_batch: Callable[[list[WorkItem]], list], *, max_batch_tokens: int,
                 max_batch_requests: int, max_wait_ms: float, max_queue_tokens: int,
                 metrics: ServiceMetrics, max_padding_tokens: int | None = None, nice: int = 0) -> None:
        self._run_batch = run_batch
        self.nice = nice
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_requests = max_batch_requests
        self.max_padding_tokens = max_padding_tokens
        self.max_wait = max_wait_ms / 1000.0
        self.metrics = metrics
        self.admission = AdmissionPolicy(max_queue_tokens=max_queue_tokens)
        self._queue: list[WorkItem] = []
        self._queued_tokens = 0
        self._queued_by_hashes: dict[int, int] = {}
        self._running: tuple[int, int, float] | None = None  # (hashes, padded tokens, start) on the model
        self._tokenizing_chars = 0  # characters of the requests inside checked()
        self._cond = threading.Condition()
        self._accepting = True
        self._stop = False
        self._batch_ids = count()
        self._thread = threading.Thread(target=self._loop, name="yoso-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def admit(self, budget: float) -> None:
        """Raise Overloaded (429) when the queue ahead, with the requests being tokenised before it, is
        predicted to outlast ``budget`` seconds: the check of :meth:`checked`, for a request not read yet."""
        with self._cond:
            self._admit(budget, None)

    @contextmanager
    def checked(self, budget: float, chars: int):
        """Around the tokenisation of a request of ``chars`` characters: raise Overloaded (429) at
        once if the queue ahead, with the requests being tokenised before it, is predicted to outlast
        ``budget`` seconds, so a refusal costs the server almost nothing; else count the request as
        on its way. The caller sets ``lengths`` on what it yields once it knows them."""
        with self._cond:
            self._admit(budget, None)
            self._tokenizing_chars += chars
        text = _Tokenized()
        try:
            yield text
        finally:
            with self._cond:
                self._tokenizing_chars -= chars
                if text.lengths:
                    self.admission.note_text(chars, sum(text.lengths))

    def submit(self, items: list[WorkItem], *, accepted: bool = False) -> Admission:
        """Enqueue all of a request's items or none: raises Overloaded (429) when the queue is over
        its token cap or predicted to outlast the items' deadline, NotReady (503) when draining, unless
        ``accepted`` (the request arrived before the drain began) and the batcher still runs."""
        tokens = sum(it.length for it in items)
        with self._cond:
            if self._stop or (not self._accepting and not accepted):
                raise NotReady("server is shutting down; retry on another replica")
            admission = self._admit(min(it.deadline for it in items) - time.monotonic(), tokens)
            first = FirstStart(admission.predicted_wait)
            for it in items:
                it.first_start = first
            self._queue.extend(items)
            self._queued_tokens += tokens
            for it in items:
                self._queued_by_hashes[it.hashes] = self._queued_by_hashes.get(it.hashes, 0) + it.length
            self._publish_queue()
            self._cond.notify()
        return admission

    def _admit(self, budget: float, tokens: int | None) -> Admission:
        """Under the lock: the policy's decision on the queue as it is now; raises when refused."""
        running = None
        if self._running is not None:
            hashes, padded, start = self._running
            running = Running(hashes, padded, time.monotonic() - start)
        admission = self.admission.decide(
            queued=self._queued_by_hashes, running=running, budget=max(budget, 0.0), tokens=tokens,
            tokenizing_chars=self._tokenizing_chars if tokens is None else 0)
        if not admission.admitted:
            self.metrics.rejections.labels(admission.reason).inc()
            raise Overloaded(admission.message, retry_after=admission.retry_after, code=admission.reason)
        return admission

    def cancel(self, items: list[WorkItem]) -> None:
        """Mark items whose client went away; the loop drops them instead of running them."""
        with self._cond:
            for it in items:
                it.cancelled = True
            self._cond.notify()

    def close(self, timeout: float) -> bool:
        """Stop taking work, finish what is queued (up to ``timeout`` s), stop the thread.
        Returns True when the queue drained in time."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        drained = not self._thread.is_alive()
        if not drained:
            log.error("drain timeout: %d queued inputs not run", len(self._queue))
        return drained

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def _publish_queue(self) -> None:
        self.metrics.queue_items.set(len(self._queue))
        self.metrics.queue_tokens.set(self._queued_tokens)

    def _take(self, indices: list[int]) -> list[WorkItem]:
        picked = [self._queue[i] for i in indices]
        keep = set(range(len(self._queue))) - set(indices)
        self._queue = [self._queue[i] for i in sorted(keep)]
        self._queued_tokens -= sum(it.length for it in picked)
        for it in picked:
            self._queued_by_hashes[it.hashes] -= it.length
        self._publish_queue()
        return picked

    def _next_batch(self) -> tuple[list[WorkItem], list[WorkItem]] | None:
        """Block until a batch is due. Returns (batch, dropped) or None when stopped and empty."""
        with self._cond:
            while True:
                now = time.monotonic()
                dead = [i for i, it in enumerate(self._queue) if it.cancelled or (
                    it.deadline <= now and not (it.first_start is not None and it.first_start.started))]
                dropped = self._take(dead) if dead else []
                if dropped:
                    return [], dropped
                if not self._queue:
                    if self._stop:
                        return None
                    self._cond.wait()
                    continue
                plan = plan_batch(self._queue, max_batch_tokens=self.max_batch_tokens,
                                  max_batch_requests=self.max_batch_requests,
                                  max_padding_tokens=self.max_padding_tokens)
                wait_left = self._queue[0].enqueued + self.max_wait - now
                if not plan.full and wait_left > 0 and not self._stop:
                    self._cond.wait(wait_left)
                    continue
                return self._take(plan.indices), []

    def _loop(self) -> None:
        lower_priority(self.nice)  # before the first forward: the OpenMP team it starts inherits it
        while True:
            step = self._next_batch()
            if step is None:
                return
            batch, dropped = step
            for it in dropped:
                self._drop(it)
            if batch:
                self._run(batch)

    def _drop(self, item: WorkItem) -> None:
        if item.cancelled:
            self.metrics.failures.labels("client_disconnected").inc()
            error: ServiceError = ClientGone("client disconnected before the input ran")
        else:
            # the deadline counts from the request's arrival, so tokenisation may have used all of it (then 0.0 s)
            left = max(0.0, item.deadline - item.enqueued)
            error = DeadlineExceeded(f"request waited longer than its deadline to start ({left:.1f} s left of it "
                                     f"when queued: request_timeout, or x-request-timeout when lower); retry later")
        self._resolve(item, error=error)

    def _run(self, batch: list[WorkItem]) -> None:
        start = time.monotonic()
        batch_id = next(self._batch_ids)
        padded = len(batch) * max(it.length for it in batch)
        for it in batch:
            it.queue_wait = start - it.enqueued
            it.batch_id = batch_id
            self.metrics.queue_wait.observe(it.queue_wait)
            first = it.first_start
            if first is not None and not first.started:
                first.started = True
                if first.predicted is not None:
                    self.metrics.predicted_wait.observe(first.predicted)
                    self.metrics.actual_wait.observe(it.queue_wait)
        self._running = (batch[0].hashes, padded, start)
        try:
            outputs = self._run_batch(batch)
            if len(outputs) != len(batch):
                raise RuntimeError(f"batch of {len(batch)} inputs gave {len(outputs)} outputs")
        except Exception as exc:  # noqa: BLE001 - every failure must reach its request
            self._running = None
            if len(batch) > 1:
                for it in batch:  # isolate the input that fails
                    self._run([it])
                return
            self._fail(batch[0], exc)
            return
        elapsed = time.monotonic() - start
        tokens = sum(it.length for it in batch)
        hashes = batch[0].hashes
        with self._cond:  # submit() reads the estimate on the event loop's thread
            self._running = None
            # Batch 0 is the engine's first warm-up: a few tokens, one-off costs and per-batch
            # overhead, whose speed would make the first predictions many times too long.
            if batch_id > 0:
                self.admission.estimate.observe(hashes, tokens, padded, elapsed)
        if self.admission.estimate.known(hashes):
            self.metrics.throughput.labels(str(hashes)).set(self.admission.estimate.padded_tokens_per_s(hashes))
        self.metrics.inference_duration.observe(elapsed)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.batch_tokens.observe(padded)
        self.metrics.tokens.inc(tokens)
        for it, out in zip(batch, outputs):
            it.inference = elapsed
            self._resolve(it, result=out)

    def _fail(self, item: WorkItem, exc: Exception) -> None:
        if isinstance(exc, ServiceError):
            error: ServiceError = exc
        else:
            log.error("batch failed", exc_info=exc)
            error = InternalError()
        self._resolve(item, error=error)

    @staticmethod
    def _resolve(item: WorkItem, result: Any = None, error: BaseException | None = None) -> None:
        try:
            item.loop.call_soon_threadsafe(_settle, item.future, result, error)
        except RuntimeError:  # the request's event loop is closed: nobody is waiting
            pass
