"""--exact-kernel flex at load time: the loader switches exact mode to the fused kernel and compiles every
length bucket before the server turns ready. The setting itself is CUDA-only (test_settings.py); the
loader's part is the same on the CPU, where inductor compiles the kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from yoso_serve.kernels import flex
from yoso_serve.service import ServeSettings
from yoso_serve.service.loading import load_served_model

pytestmark = pytest.mark.skipif(flex.unavailable("cpu") is not None, reason=str(flex.unavailable("cpu")))


def test_flex_is_switched_on_and_warmed_before_serving(tiny_dir, caplog):
    settings = ServeSettings(model=tiny_dir, runtime="torch", dense_dtype="fp32")
    assert settings.resolved_exact_kernel() == "op"
    op = load_served_model(settings).model
    fused = settings.model_copy(update={"exact_kernel": "flex"})  # past the start-time CUDA check
    with caplog.at_level(logging.INFO, logger="yoso_serve.service"):
        loaded = load_served_model(fused)
    assert "exact kernel flex: 1 length buckets compiled" in caplog.text  # the tiny model's 64 positions
    assert loaded.model.backend_info()["exact_kernel"] == "flex"
    assert op.backend_info()["exact_kernel"] == "op"
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102, 0, 0], [101, 2178, 2028, 2003, 2936, 2084, 2008, 102]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        want = op.last_hidden(ids, mask, hashes=0)
        got = loaded.model.last_hidden(ids, mask, hashes=0)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=2e-5)
