"""Keep freed memory in the process for the next batch, instead of handing it back to the kernel.

glibc's malloc gives an allocation of more than 128 KiB its own ``mmap`` (the threshold then follows the
largest freed one, up to 32 MiB), returns free memory at a heap's top once more than twice that is free, and
unmaps a thread's heap that has become empty. A forward makes and drops tensors of several MiB every layer, so
each batch faulted its pages in again and the kernel zeroed them: a forward of 32 texts of 128 tokens faulted
about 23,000 pages (90 MiB) every time. :func:`retain_freed_memory` fixes the thresholds (mmap 32 MiB, trim
:data:`TRIM_BYTES`, top pad :data:`PAD_BYTES`): what a batch frees is reused by the next one (about one
fault), and the resident size stays at the largest batch's high-water mark. That forward
ran 1.09x faster (AMD EPYC, 2 cores; docs/configuration.md, "Memory").

Only where the C library is glibc, and never over a choice already made in the environment (any
``MALLOC_*`` variable or ``GLIBC_TUNABLES`` naming malloc): those keep glibc as they set it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 << 20  # the largest threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_BYTES = 1 << 30
# a thread's arena is a chain of heaps of at most 64 MiB; one left empty is unmapped unless the pad is as large
PAD_BYTES = 64 << 20


def user_choice(environ: dict[str, str] | None = None) -> str | None:
    """The environment variable that already tunes glibc's malloc, or None."""
    env = os.environ if environ is None else environ
    named = sorted(name for name in env if name.startswith("MALLOC_"))
    if named:
        return named[0]
    if "malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def retain_freed_memory(environ: dict[str, str] | None = None) -> str:
    """Set glibc's thresholds as above; returns what was done, for the start-up log."""
    if (name := user_choice(environ)) is not None:
        return f"left as {name} sets it"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc: left as it is"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = all(libc.mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, MMAP_BYTES), (M_TRIM_THRESHOLD, TRIM_BYTES), (M_TOP_PAD, PAD_BYTES)))
    return (f"freed memory kept for reuse (mmap threshold {MMAP_BYTES >> 20} MiB, trim threshold "
            f"{TRIM_BYTES >> 20} MiB, top pad {PAD_BYTES >> 20} MiB)" if ok else "mallopt refused: left as it is")
