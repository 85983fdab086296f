"""Admission: answer 429 at once when a request cannot start before its deadline.

Waiting out a deadline in the queue and answering 504 costs the client the whole deadline and the
server nothing it could use; refusing at once lets the client retry elsewhere or later. The engine
predicts when a new request would start from the work queued ahead of it and its own measured
speed, and refuses when that is past most (:data:`ADMIT_SHARE`) of the request's deadline. The
queue-token cap (``max_queue_tokens``) stays as a hard limit underneath.

The decision is plain and clock-free: :class:`ThroughputEstimate` learns from the batches the
scheduler reports, :class:`AdmissionPolicy` decides from a snapshot of the queue, and both are
unit-tested without threads or HTTP. The client's own deadline arrives in the ``x-request-timeout``
header; the middleware parses it (:func:`parse_client_timeout`) and keeps it in a context variable
for the one request, which :func:`request_budget` reads.
"""

from __future__ import annotations

import math
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Mapping

from .errors import InvalidInput

TIMEOUT_HEADER = "x-request-timeout"

# A request is admitted while its predicted start is within this share of its deadline. The
# prediction is a mean over recent batches; admitted requests sit right at the limit whenever the
# server is overloaded, so without spare room about half of them would start late and get 504.
ADMIT_SHARE = 0.8
# Weight kept by the past at each new batch: the estimate follows roughly the last ten batches,
# which is quick enough to track a change of input lengths and slow enough to average out one
# batch that shared the cores with a burst of tokenisation.
DECAY = 0.9
# Tokens per character of a text not tokenised yet, until requests have taught better: the usual
# figure for English with a WordPiece or BPE vocabulary.
TOKENS_PER_CHAR = 0.25
# Retry-After when nothing has been measured yet (tokens/s): the old fixed guess, used only for
# the queue-full answer before any batch of that hash count ran.
FALLBACK_TOKENS_PER_S = 1000.0

# The engine's second warm-up batch, one input of 512 tokens (truncated where the model is shorter):
# long enough that per-batch overhead does not dominate its speed, short enough to cost a fraction
# of a second on a CPU, one input so that it runs as one batch whatever --max-batch-requests says.
# The first warm-up batch pays one-off costs and is not measured.
SPEED_PROBE = [" ".join(["warm-up"] * 170)]

# The absolute (time.monotonic) deadline the client asked for, set per request by the middleware.
client_deadline: ContextVar[float | None] = ContextVar("client_deadline", default=None)

# When (time.monotonic) the middleware took the request in, set per work request: a drain that begins
# later still serves it (nothing accepted is lost), and refuses only what arrives after it began.
request_arrival: ContextVar[float | None] = ContextVar("request_arrival", default=None)


def parse_client_timeout(raw: bytes | None) -> float | None:
    """The ``x-request-timeout`` header in seconds (None when absent); 422 when it is not a
    positive, finite number."""
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidInput(f"{TIMEOUT_HEADER} must be a positive number of seconds (the most this "
                           f"request may wait; capped at the server's request_timeout), got {text[:40]!r}",
                           param=TIMEOUT_HEADER)
    return seconds


def request_budget(server_timeout: float) -> float:
    """Seconds from now the request may still wait in the queue: the server's ``request_timeout``,
    or less when the client's ``x-request-timeout`` runs out sooner (never more)."""
    deadline = client_deadline.get()
    if deadline is None:
        return server_timeout
    return max(0.0, min(server_timeout, deadline - time.monotonic()))


@dataclass
class _Sums:
    real: float = 0.0  # tokens of the inputs themselves
    padded: float = 0.0  # what the batch cost: batch size x longest input
    seconds: float = 0.0  # forward time
    batches: int = 0


class ThroughputEstimate:
    """Per hash count, padded tokens per second and padding per real token, from the batches run.

    Sums decay by :data:`DECAY` per batch and are weighted by tokens, so a big batch counts for
    more than a tiny one, whose time is mostly fixed per-batch overhead.
    """

    def __init__(self) -> None:
        self._by_hashes: dict[int, _Sums] = {}
        self.last: int | None = None  # the hash count of the last batch measured

    def observe(self, hashes: int, real_tokens: int, padded_tokens: int, seconds: float) -> None:
        self.last = hashes
        s = self._by_hashes.setdefault(hashes, _Sums())
        s.real = DECAY * s.real + real_tokens
        s.padded = DECAY * s.padded + padded_tokens
        s.seconds = DECAY * s.seconds + max(seconds, 1e-6)
        s.batches += 1

    def known(self, hashes: int) -> bool:
        """Whether a batch of this hash count has been measured."""
        return hashes in self._by_hashes

    def predictable(self, hashes: int) -> bool:
        """Whether this hash count's speed can be told: measured, or an LSH count while another is (below)."""
        return self._stand_in(hashes) is not None

    def _stand_in(self, hashes: int) -> tuple[int, float] | None:
        """(a measured count, the factor on its speed) that stands for ``hashes``: itself when measured. For an
        LSH count no batch has run yet (any count in [1, max_hashes] may come in a request), the fewest measured
        hashes above it at their own speed, or else the most measured below it at its speed x m0/m, as if all
        of a forward's cost grew with the hash count. Both err slow, so the admission refuses early rather than
        letting requests time out in the queue. An unmeasured exact count (0) has no stand-in: its cost grows
        with the square of the length, not with anything measured."""
        if hashes in self._by_hashes:
            return hashes, 1.0
        lsh = [h for h in self._by_hashes if h > 0]
        if hashes <= 0 or not lsh:
            return None
        above = [h for h in lsh if h > hashes]
        if above:
            return min(above), 1.0
        return max(lsh), max(lsh) / hashes

    def padded_tokens_per_s(self, hashes: int) -> float:
        count, factor = self._stand_in(hashes)
        s = self._by_hashes[count]
        return factor * s.padded / s.seconds

    def padding(self, hashes: int) -> float:
        """Padded tokens computed per real token queued (1.0 = no padding)."""
        s = self._by_hashes[self._stand_in(hashes)[0]]
        return s.padded / s.real

    def seconds_for(self, hashes: int, real_tokens: float) -> float:
        """Predicted forward time of ``real_tokens`` queued tokens, padding included."""
        return real_tokens * self.padding(hashes) / self.padded_tokens_per_s(hashes)


@dataclass(frozen=True)
class Running:
    """The batch on the model now: its hash count, padded tokens, and seconds since it started."""

    hashes: int
    padded_tokens: int
    elapsed: float


@dataclass(frozen=True)
class Admission:
    """``reason`` is None when admitted, else ``"queue_full"`` or ``"predicted_wait"``;
    ``predicted_wait`` is None when it could not be predicted (exact mode, 0, not measured yet)."""

    reason: str | None
    predicted_wait: float | None
    retry_after: int = 0
    message: str = ""

    @property
    def admitted(self) -> bool:
        return self.reason is None


class AdmissionPolicy:
    """Decides whether a request may join the queue. The queue ahead of it is described by its
    tokens per hash count and the batch on the model now."""

    def __init__(self, *, max_queue_tokens: int, admit_share: float = ADMIT_SHARE) -> None:
        self.max_queue_tokens = max_queue_tokens
        self.admit_share = admit_share
        self.estimate = ThroughputEstimate()
        self.tokens_per_char = TOKENS_PER_CHAR

    def note_text(self, chars: int, tokens: int) -> None:
        """A tokenised request: its tokens per character join the running mean."""
        if chars > 0:
            self.tokens_per_char = DECAY * self.tokens_per_char + (1 - DECAY) * tokens / chars

    def predicted_wait(self, queued: Mapping[int, int], running: Running | None) -> float | None:
        """Seconds until a request joining the queue now starts: what is left of the running batch
        plus every queued token at its hash count's speed (measured, or a stand-in's:
        :meth:`ThroughputEstimate.predictable`). None when one of those counts has no speed to go by
        (then only the token cap applies)."""
        hashes = {h for h, n in queued.items() if n > 0} | ({running.hashes} if running else set())
        if not all(self.estimate.predictable(h) for h in hashes):
            return None
        wait = sum(self.estimate.seconds_for(h, n) for h, n in queued.items() if n > 0)
        if running is not None:
            expected = running.padded_tokens / self.estimate.padded_tokens_per_s(running.hashes)
            wait += max(0.0, expected - running.elapsed)
        return wait

    def decide(self, *, queued: Mapping[int, int], running: Running | None, budget: float,
               tokens: int | None = None, tokenizing_chars: int = 0) -> Admission:
        """Admit or refuse a request of ``tokens`` (None: not tokenised yet, skip the token cap)
        whose deadline is ``budget`` seconds away. ``tokenizing_chars`` are the characters of the
        requests being tokenised now, on their way into the queue ahead of it; they count at the
        running tokens per character and the last measured speed. Without them the check before
        tokenising lets a whole burst through, only for most of it to be refused after its
        tokenisation has cost the server its CPU and the client its time."""
        total = sum(queued.values())
        if tokens is not None and total and total + tokens > self.max_queue_tokens:
            # An empty queue takes any request, so one request larger than the cap still runs.
            excess = total + tokens - self.max_queue_tokens
            wait = self.predicted_wait({h: excess * n / total for h, n in queued.items()}, None)
            retry = max(1, math.ceil(excess / FALLBACK_TOKENS_PER_S if wait is None else wait))
            return Admission("queue_full", self.predicted_wait(queued, running), retry,
                             f"queue is full ({total} tokens queued, limit max_queue_tokens="
                             f"{self.max_queue_tokens}); retry after {retry} s")
        wait = self.predicted_wait(queued, running)
        limit = self.admit_share * budget
        if wait is not None and tokenizing_chars and self.estimate.last is not None:
            wait += self.estimate.seconds_for(self.estimate.last, tokenizing_chars * self.tokens_per_char)
        if wait is None or wait <= limit:
            return Admission(None, wait)
        # By the time the deadline has passed, all that is queued now has started or been dropped.
        retry = max(1, math.ceil(min(wait - limit, budget)))
        return Admission("predicted_wait", wait, retry,
                         f"predicted queue wait {wait:.2f} s is over this request's limit of {limit:.2f} s "
                         f"({self.admit_share:g} x its deadline of {budget:.2f} s: request_timeout, or "
                         f"{TIMEOUT_HEADER} when lower); retry after {retry} s")
