"""Pick the next batch from the queue by token budget: a pure function, no threads, no clock.

Cost model: a batch is padded to its longest input, so it costs ``len(batch) * longest`` tokens of
compute whatever the real lengths are, plus a fixed cost per forward (layer launches, threads
waking, Python). Batching pays while the padding an input adds stays under that fixed cost, so
an input joins a batch only then (``max_padding_tokens``, the fixed cost counted in tokens): a
2,000-token document never rides with a 4,000-token one (measured on 2 CPU cores: 4 padded
documents of 1–4k tokens ran at 0.72x the tokens/s of the same documents one by one), while
short texts of similar lengths still share one forward. Sorting the chosen items by length
afterwards does not change the cost but keeps rows with similar lengths adjacent for the pooling
and splitting code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence


class Queued(Protocol):
    """What the batcher needs to know about a queued input."""

    length: int  # tokens, specials included
    group: Hashable  # items batch together only when equal (hash count and output kind)
    enqueued: float  # arrival time, seconds on any one clock


# Joining lets a later input start before an earlier one that is passed over (another length or
# group). The admission predicts a request's wait from the work queued ahead of it, so the work
# allowed to pass an input must stay small: once an input is passed over, only inputs that arrived
# at most this long after it may still join. Measured on 2 CPU cores (bench/load.py --overload): with
# no limit, length-aware batching let later short texts pass long documents for tens of seconds and
# 10 % of requests ended in 504 instead of 0-0.6 %. Where nothing is passed over (texts of one length
# and group) nothing is held back.
JOIN_WINDOW_S = 1.0


@dataclass(frozen=True)
class BatchPlan:
    """``indices`` into the queue, sorted by length (shortest first); ``padded_tokens`` the cost;
    ``full`` when no further item of the group could join (so waiting for more is pointless)."""

    indices: list[int]
    padded_tokens: int
    full: bool


def plan_batch(queue: Sequence[Queued], *, max_batch_tokens: int, max_batch_requests: int,
               max_padding_tokens: int | None = None, join_window: float = JOIN_WINDOW_S) -> BatchPlan:
    """Take the oldest item (``queue[0]``; the queue is in arrival order), then every later item of
    the same group that keeps ``len * longest <= max_batch_tokens`` and ``len <= max_batch_requests``
    and adds at most ``max_padding_tokens`` of padding (None: no padding limit): the padded cost
    grows by the item's own length plus at most that much. Once an item is passed over, only
    items that arrived at most ``join_window`` seconds after it may still join (see JOIN_WINDOW_S).

    The oldest item always goes, even if it alone is over the token budget (the service rejects
    inputs longer than the budget at start-up), so nothing starves: every call serves the head.
    Items that do not fit are skipped, not a stop: a shorter item further back may still fit.
    """
    if max_batch_tokens < 1 or max_batch_requests < 1:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_batch_requests "
                         f"({max_batch_requests}) must be >= 1")
    if max_padding_tokens is not None and max_padding_tokens < 0:
        raise ValueError(f"max_padding_tokens must be >= 0 or None, got {max_padding_tokens}")
    if not queue:
        return BatchPlan([], 0, False)
    head = queue[0]
    chosen, longest = [0], head.length
    passed_over: float | None = None  # arrival of the oldest item not taken
    for i in range(1, len(queue)):
        if len(chosen) == max_batch_requests:
            break
        item = queue[i]
        new_longest = max(longest, item.length)
        padded = (len(chosen) + 1) * new_longest
        added_padding = padded - len(chosen) * longest - item.length
        fits = (item.group == head.group and padded <= max_batch_tokens
                and (max_padding_tokens is None or added_padding <= max_padding_tokens))
        if fits and (passed_over is None or item.enqueued <= passed_over + join_window):
            chosen.append(i)
            longest = new_longest
        elif passed_over is None:
            passed_over = item.enqueued
    padded = len(chosen) * longest
    full = len(chosen) == max_batch_requests or padded + longest > max_batch_tokens
    chosen.sort(key=lambda i: (queue[i].length, i))
    return BatchPlan(chosen, padded, full)
