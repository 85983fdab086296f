"""Threads of the service: a call on a thread of its own, awaited from the event loop, and the lower
priority of the threads that run the forward."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Callable

log = logging.getLogger("yoso_serve.service")


def lower_priority(nice: int) -> int | None:
    """Raise the calling thread's nice value by ``nice`` (Linux: a thread's priority is its own, and the
    threads it starts inherit it, the forward's OpenMP team among them). Returns the new value, or None
    where the platform has none or refuses (logged; the thread runs on at its priority)."""
    if not nice or sys.platform != "linux":
        return None
    tid = threading.get_native_id()
    try:
        value = min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        os.setpriority(os.PRIO_PROCESS, tid, value)
    except OSError as exc:
        log.warning("could not lower the forward thread's priority by %d: %s", nice, exc)
        return None
    return value


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
