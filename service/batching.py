"""Pick the next batch from the queue by token budget: a pure function, no threads, no clock.

Cost model: a batch is padded to its longest input, so it costs ``len(batch) * longest`` tokens of
compute whatever the real lengths are. Sorting the chosen items by length afterwards does not
change that cost but keeps rows with similar lengths adjacent for the pooling and splitting code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence


class Queued(Protocol):
    """What the batcher needs to know about a queued input."""

    length: int  # tokens, specials included
    group: Hashable  # items batch together only when equal (hash count and output kind)


@dataclass(frozen=True)
class BatchPlan:
    """``indices`` into the queue, sorted by length (shortest first); ``padded_tokens`` the cost;
    ``full`` when no further item of the group could join (so waiting for more is pointless)."""

    indices: list[int]
    padded_tokens: int
    full: bool


def plan_batch(queue: Sequence[Queued], *, max_batch_tokens: int, max_batch_requests: int) -> BatchPlan:
    """Take the oldest item (``queue[0]``; the queue is in arrival order), then every later item of
    the same group that keeps ``len * longest <= max_batch_tokens`` and ``len <= max_batch_requests``.

    The oldest item always goes, even if it alone is over the token budget (the service rejects
    inputs longer than the budget at start-up), so nothing starves: every call serves the head.
    Items that do not fit are skipped, not a stop: a shorter item further back may still fit.
    """
    if max_batch_tokens < 1 or max_batch_requests < 1:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_batch_requests "
                         f"({max_batch_requests}) must be >= 1")
    if not queue:
        return BatchPlan([], 0, False)
    head = queue[0]
    chosen, longest = [0], head.length
    for i in range(1, len(queue)):
        if len(chosen) == max_batch_requests:
            break
        item = queue[i]
        if item.group != head.group:
            continue
        new_longest = max(longest, item.length)
        if (len(chosen) + 1) * new_longest <= max_batch_tokens:
            chosen.append(i)
            longest = new_longest
    padded = len(chosen) * longest
    full = len(chosen) == max_batch_requests or padded + longest > max_batch_tokens
    chosen.sort(key=lambda i: (queue[i].length, i))
    return BatchPlan(chosen, padded, full)
