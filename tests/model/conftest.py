"""Shared fixtures for the model tests: the tiny configs and padded batches of yoso_testkit, the converted
default model."""

from __future__ import annotations

import types

import pytest
from yoso_testkit import TINY, pad_batch, random_ids, tiny_config, tiny_model

from yoso_serve.model.default import converted_minilm_dir

@pytest.fixture(scope="session")
def default_dir(tmp_path_factory):
    """all-MiniLM-L6-v2 converted as the default-model fallback does, once per session, in a private cache."""
    cache = tmp_path_factory.mktemp("yoso-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YOSO_CACHE_DIR", str(cache))
        path = converted_minilm_dir()
    return path


@pytest.fixture(scope="session")
def kit():
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    return types.SimpleNamespace(tiny_config=tiny_config, tiny_model=tiny_model, random_ids=random_ids,
                                 pad_batch=pad_batch, TINY=TINY)
