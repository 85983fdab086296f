"""The helpers the bench scripts share: timing (bench/_sections.py: warm-up, alternation, medians) and the
overload scenario's latencies (bench/_overload.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
import _sections  # noqa: E402


def test_alternated_medians_warms_up_once_then_alternates_and_takes_medians(monkeypatch):
    order, clock = [], iter(range(100))
    monkeypatch.setattr(_sections.time, "perf_counter", lambda: next(clock))
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    syncs = []
    out = _sections.alternated_medians(calls, 3, sync=lambda: syncs.append(len(order)))
    assert order == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then the rounds in turn
    assert len(syncs) == 2 * 6  # before and after every timed call, never around the warm-ups
    assert out == {"a": 1, "b": 1}  # each timed call spans one tick of the fake clock


def test_overload_latencies_leave_out_the_opening_and_read_the_event_loop_wait():
    import os

    import _overload

    s = _overload.Scenario("overload", 64, 60.0)
    s.answers = [_overload.Answer(0.01, 0.25, 429, 0), *(_overload.Answer(3.0 + i, 0.01, 429, 0) for i in range(9))]
    assert s.latency_ms(429, 100) == 250.0  # the opening burst is in the whole window's figure
    assert round(s.latency_ms(429, 100, _overload.OPENING_S), 6) == 10.0  # and not in the steady state's
    assert s.latency_ms((400, 422), 99) != s.latency_ms((400, 422), 99)  # none: nan
    if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        run_ns, wait_ns, slices = _overload.schedstat(os.getpid())
        assert run_ns > 0 and wait_ns >= 0 and slices > 0
    assert _overload.schedstat(2**22 + 12345) is None  # no such process
