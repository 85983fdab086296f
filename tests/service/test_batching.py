"""Batch selection (pure function), chunk windows, and the scheduler without HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from yoso_serve.service.batching import plan_batch
from yoso_serve.service.inputs import chunk_windows
from yoso_serve.service.errors import ClientGone, DeadlineExceeded, InternalError, NotReady, Overloaded
from yoso_serve.service.metrics import ServiceMetrics, power_of_two_buckets
from yoso_serve.service.scheduler import BatchScheduler, OutputKind, WorkItem


@dataclass
class Q:
    length: int
    group: tuple = (32, "embed", None)
    enqueued: float = 0.0


def plan(lengths_or_items, tokens=100, requests=8, padding=None):
    queue = [x if isinstance(x, Q) else Q(x) for x in lengths_or_items]
    return plan_batch(queue, max_batch_tokens=tokens, max_batch_requests=requests, max_padding_tokens=padding)


def test_empty_queue_gives_no_batch():
    p = plan([])
    assert p.indices == [] and p.padded_tokens == 0 and not p.full


def test_oldest_first_then_same_group_only():
    queue = [Q(10, (0, "embed", None)), Q(10, (32, "embed", None)), Q(10, (0, "embed", None)),
             Q(10, (0, "hidden", None))]
    assert plan(queue).indices == [0, 2]


def test_padded_cost_limits_the_batch_and_skips_rather_than_stops():
    # head 10; next 40 would cost 2*40=80 (fits), then 30 costs 3*40=120 > 100 (skipped),
    # then 5 costs 3*40=120 too; a budget of 120 takes all four.
    assert plan([10, 40, 30, 5], tokens=100).indices == [0, 1]
    assert plan([10, 60, 20], tokens=50).indices == [0, 2]  # 60 would cost 120, 20 fits (2*20=40)
    assert plan([10, 40, 30, 5], tokens=160).indices == [3, 0, 2, 1]  # sorted by length


def test_request_cap_and_full_flag():
    p = plan([5] * 20, tokens=1000, requests=4)
    assert p.indices == [0, 1, 2, 3] and p.full and p.padded_tokens == 20
    p = plan([5, 5], tokens=1000, requests=4)
    assert not p.full  # room left: the loop may wait max_wait_ms for more
    assert plan([50, 50], tokens=100).full  # a third 50-token item could never fit


def test_oversized_head_still_runs_alone():
    p = plan([500, 5], tokens=100)
    assert p.indices == [0] and p.padded_tokens == 500 and p.full


def test_padding_limit_keeps_long_documents_apart_and_short_texts_together():
    docs = [2500, 4000, 1200, 2600, 3900]
    # no limit: every document rides padded to 4000 (20000 tokens of compute for 14200 real)
    assert plan(docs, tokens=20000).padded_tokens == 20000
    # 64 tokens of padding per input: even the 2600 would pad the head's row by 100, so it runs alone
    p = plan(docs, tokens=20000, padding=64)
    assert p.indices == [0] and p.padded_tokens == 2500
    # 2540 pads the head by 40, then 2480 pads itself by 60: both join, 4000 waits
    p = plan([2500, 4000, 2540, 2480], tokens=20000, padding=64)
    assert p.indices == [3, 0, 2] and p.padded_tokens == 3 * 2540
    # short texts of mixed length still share one forward when their padding is small
    p = plan([100, 120, 90, 128, 110], tokens=10000, padding=64)
    assert sorted(p.indices) == [0, 1, 2, 3, 4]


def test_padding_limit_counts_the_padding_an_item_adds_to_every_row():
    # head 100; 140 adds 40 to the head's row -> allowed at 40, not at 39
    assert plan([100, 140], tokens=1000, padding=40).indices == [0, 1]
    assert plan([100, 140], tokens=1000, padding=39).indices == [0]
    # a shorter item pads only itself: 60 under a 100 longest adds 40
    assert plan([100, 60], tokens=1000, padding=40).indices == [1, 0]
    assert plan([100, 60], tokens=1000, padding=39).indices == [0]
    # with two rows already at 100, a 120 adds 2 * 20 = 40
    assert plan([100, 100, 120], tokens=1000, padding=40).indices == [0, 1, 2]
    assert plan([100, 100, 120], tokens=1000, padding=39).indices == [0, 1]
    # padding=0 batches equal lengths only
    assert plan([50, 50, 51, 50], tokens=1000, padding=0).indices == [0, 1, 3]
    with pytest.raises(ValueError, match="max_padding_tokens"):
        plan([1], padding=-1)


def test_an_input_passed_over_is_overtaken_only_by_inputs_that_arrived_soon_after_it():
    # the 2000-token document cannot join the 100-token head; short texts that arrived within the
    # window after it may still pass it, later ones wait: the admission's wait prediction counts
    # the work queued ahead of a request, in order
    queue = [Q(100, enqueued=0.0), Q(2000, enqueued=0.1), Q(100, enqueued=0.3), Q(100, enqueued=5.0)]
    p = plan_batch(queue, max_batch_tokens=10000, max_batch_requests=8, max_padding_tokens=64, join_window=0.5)
    assert p.indices == [0, 2]
    p = plan_batch(queue, max_batch_tokens=10000, max_batch_requests=8, max_padding_tokens=64, join_window=10.0)
    assert p.indices == [0, 2, 3]
    # another group passed over counts too
    other = [Q(100, enqueued=0.0), Q(100, (0, "embed", None), enqueued=0.1), Q(100, enqueued=5.0)]
    assert plan_batch(other, max_batch_tokens=10000, max_batch_requests=8, join_window=0.5).indices == [0]
    # nothing passed over: no window, however far apart the arrivals
    same = [Q(100, enqueued=0.0), Q(100, enqueued=3.0), Q(100, enqueued=9.0)]
    assert plan_batch(same, max_batch_tokens=10000, max_batch_requests=8, join_window=0.5).indices == [0, 1, 2]


def test_invalid_budget_is_a_value_error():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        plan([1], tokens=0)


@pytest.mark.parametrize("n,window,overlap", [(10, 4, 1), (62, 62, 0), (186, 62, 16), (1, 5, 2), (100, 10, 9)])
def test_chunk_windows_cover_every_token_once_by_weight(n, window, overlap):
    windows = chunk_windows(n, window, overlap)
    assert windows[0][0] == 0 and windows[-1][1] == n
    assert sum(w for _, _, w in windows) == n
    for (a0, b0, _), (a1, b1, _) in zip(windows, windows[1:]):
        assert a1 == b0 - overlap and b1 > b0  # neighbours share exactly `overlap` tokens, always progress
    assert all(b - a <= window for a, b, _ in windows)


def test_chunk_windows_reject_overlap_not_below_window():
    with pytest.raises(ValueError, match="overlap"):
        chunk_windows(10, 4, 4)


def test_power_of_two_buckets_end_at_the_limit():
    assert power_of_two_buckets(4096)[-1] == 4096 and power_of_two_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)


# --- the scheduler, with a stand-in forward ------------------------------------------------
def _scheduler(run_batch, **kw):
    opts = dict(max_batch_tokens=1000, max_batch_requests=8, max_wait_ms=50, max_queue_tokens=100)
    opts.update(kw)
    s = BatchScheduler(run_batch, metrics=ServiceMetrics(), **opts)
    s.start()
    return s


def _items(loop, lengths, *, timeout=10.0, hashes=32):
    now = time.monotonic()
    return [WorkItem(list(range(n)), hashes, OutputKind.EMBED, None, now + timeout, loop.create_future(), loop)
            for n in lengths]


def test_scheduler_batches_concurrent_items_and_keeps_order():
    seen = []

    def forward(batch):
        seen.append([it.length for it in batch])
        return [it.length * 10 for it in batch]

    async def main():
        s = _scheduler(forward)
        items = _items(asyncio.get_running_loop(), [3, 1, 2])
        s.submit(items)
        results = await asyncio.gather(*(it.future for it in items))
        s.close(5)
        return results

    assert asyncio.run(main()) == [30, 10, 20]
    assert seen == [[1, 2, 3]]  # one batch, sorted by length; outputs still matched to their items


def test_without_a_wait_a_lone_input_runs_at_once_and_later_ones_batch_behind_the_forward():
    """--max-wait-ms 0 (the default): the idle worker takes a lone input without waiting for company,
    and the inputs that arrive while its forward runs go together in the next forward."""
    gate, seen = threading.Event(), []

    def forward(batch):
        seen.append(sorted(it.length for it in batch))
        if len(seen) == 1:
            gate.wait(5)
        return [it.length for it in batch]

    async def main():
        loop = asyncio.get_running_loop()
        s = _scheduler(forward, max_wait_ms=0)
        first = _items(loop, [5])
        s.submit(first)
        await asyncio.sleep(0.05)
        assert seen == [[5]]  # running alone although 7 more inputs would fit
        later = [_items(loop, [n])[0] for n in (6, 7, 8)]
        for it in later:  # three requests, one input each, all during the first forward
            s.submit([it])
        gate.set()
        results = await asyncio.gather(*(it.future for it in first + later))
        s.close(5)
        return results

    assert asyncio.run(main()) == [5, 6, 7, 8]
    assert seen == [[5], [6, 7, 8]]


def test_default_batcher_wait_is_zero():
    from yoso_serve.service.settings import ServeSettings

    assert ServeSettings.model_fields["max_wait_ms"].default == 0.0


def test_scheduler_keeps_inputs_of_far_apart_lengths_in_separate_batches():
    seen = []

    def forward(batch):
        seen.append(sorted(it.length for it in batch))
        return [it.length for it in batch]

    async def main():
        s = _scheduler(forward, max_padding_tokens=8)
        items = _items(asyncio.get_running_loop(), [40, 400, 44, 396])
        s.submit(items)
        results = await asyncio.gather(*(it.future for it in items))
        s.close(5)
        return results

    assert asyncio.run(main()) == [40, 400, 44, 396]  # nothing accepted is lost
    assert sorted(seen) == [[40, 44], [396, 400]]


def test_failing_input_fails_only_its_own_request():
    def forward(batch):
        if any(it.length == 2 for it in batch):
            raise RuntimeError("boom")
        return [it.length for it in batch]

    async def main():
        s = _scheduler(forward)
        items = _items(asyncio.get_running_loop(), [1, 2, 3])
        s.submit(items)
        results = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
        s.close(5)
        return results

    one, two, three = asyncio.run(main())
    assert one == 1 and three == 3 and isinstance(two, InternalError)


def test_output_count_mismatch_is_an_error_not_a_misassignment():
    async def main():
        s = _scheduler(lambda batch: [0])  # one output whatever the batch size
        items = _items(asyncio.get_running_loop(), [1, 1])
        s.submit(items)
        results = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
        s.close(5)
        return results

    # As a pair the batch fails the one-to-one check; retried alone each item gets its own output.
    assert asyncio.run(main()) == [0, 0]


def test_expired_and_cancelled_items_are_dropped_before_running():
    gate = threading.Event()
    ran = []

    def forward(batch):
        gate.wait(5)
        ran.extend(it.length for it in batch)
        return [0] * len(batch)

    async def main():
        loop = asyncio.get_running_loop()
        s = _scheduler(forward, max_batch_requests=1, max_wait_ms=0)
        blocker = _items(loop, [1])
        s.submit(blocker)
        await asyncio.sleep(0.05)  # the blocker is running; the rest wait behind it
        late = _items(loop, [2], timeout=0.01)
        gone = _items(loop, [3])
        ok = _items(loop, [4])
        s.submit(late + gone + ok)
        s.cancel(gone)
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(*(it.future for it in blocker + late + gone + ok), return_exceptions=True)
        s.close(5)
        return results

    results = asyncio.run(main())
    assert results[0] == 0 and results[3] == 0
    assert isinstance(results[1], DeadlineExceeded) and isinstance(results[2], ClientGone)
    assert ran == [1, 4]


def test_queue_over_budget_is_overloaded_with_retry_after_and_closed_is_not_ready():
    gate = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        s = _scheduler(lambda b: (gate.wait(5), [0] * len(b))[1], max_batch_requests=1, max_wait_ms=0)
        s.submit(_items(loop, [10]))  # running
        queued = _items(loop, [60])
        s.submit(queued)
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded) as info:
            s.submit(_items(loop, [50]))  # 60 queued + 50 > 100
        assert info.value.retry_after >= 1
        s.stop_accepting()
        with pytest.raises(NotReady):
            s.submit(_items(loop, [1]))
        gate.set()
        await queued[0].future  # what was queued before the stop still runs
        assert s.close(5)

    asyncio.run(main())
