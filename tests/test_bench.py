"""The timing helper the bench scripts share (bench/_sections.py): warm-up, alternation, medians."""

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
