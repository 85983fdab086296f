"""The C++ CPU module once :func:`yoso_serve.kernels._build.cpu_extension` has loaded it (None before, or when it is
forced off or failed): for helpers, such as input checks, that use it when it is there and must never be what
triggers a compilation. Its own module so that they need not import ``_build``."""

from __future__ import annotations

from types import ModuleType

cpu_module: ModuleType | None = None


def loaded_cpu_extension() -> ModuleType | None:
    """The loaded C++ module, or None; never builds."""
    return cpu_module
