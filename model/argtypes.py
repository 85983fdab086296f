"""argparse types shared by the model package's command-line tools (yoso-train, yoso-convert)."""

from __future__ import annotations

import argparse
import math


def bounded(kind: type = float, lo: float | None = None, hi: float | None = None, *,
            lo_open: bool = False, hi_open: bool = False):
    """An argparse ``type=`` that also checks the value is finite and in range, so that a value that would
    train silently wrong (nan, inf, a negative rate) stops at parse time as "argument --x: must be ..."."""
    left = "" if lo is None else ("(" if lo_open else "[") + f"{lo}"
    right = "" if hi is None else f"{hi}" + (")" if hi_open else "]")
    if lo is not None and hi is not None:
        limit = f"in {left}, {right}"
    elif lo is not None:
        limit = (">" if lo_open else ">=") + f" {lo}"
    else:
        limit = ("<" if hi_open else "<=") + f" {hi}"

    def convert(text: str):
        value = kind(text)  # ValueError: argparse says "invalid float value"
        if not math.isfinite(value) or (lo is not None and (value < lo or lo_open and value == lo)) \
                or (hi is not None and (value > hi or hi_open and value == hi)):
            raise argparse.ArgumentTypeError(f"must be {'finite and ' if kind is float else ''}{limit}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert
