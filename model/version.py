"""This package's version, one answer for /info, OpenAPI and the export cache's keys."""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@functools.cache
def package_version() -> str:
    """The installed distribution's version; where the tree runs without being installed (the GPU
    image puts the checkout on PYTHONPATH), the version pyproject.toml beside it declares."""
    try:
        return importlib.metadata.version("yoso-serve")
    except importlib.metadata.PackageNotFoundError:
        try:
            return str(tomllib.loads(PYPROJECT.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"
