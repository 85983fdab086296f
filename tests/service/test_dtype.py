"""--dtype: the torch runtime's weights on CUDA (float16 by default there, as text-embeddings-inference), float32
on CPU. The CUDA default cannot run here; what can: the resolution, the loader's cast (bfloat16 on the CPU, past
the start-time CUDA check) and pooling in float32, which a 4096-token fp16 sum would otherwise overflow."""

from __future__ import annotations

import torch

from yoso_serve.service import ServeSettings
from yoso_serve.service.loading import load_served_model


def test_auto_is_float16_for_torch_on_cuda_and_float32_elsewhere(monkeypatch):
    assert ServeSettings(device="cpu").resolved_dtype() == "float32"
    monkeypatch.setattr(ServeSettings, "resolved_device", lambda self: "cuda")
    assert ServeSettings.model_construct(dtype="auto", runtime="auto").resolved_dtype() == "float16"
    assert ServeSettings.model_construct(dtype="auto", runtime="hybrid").resolved_dtype() == "float32"
    assert ServeSettings.model_construct(dtype="bfloat16", runtime="torch").resolved_dtype() == "bfloat16"


def test_the_loader_casts_the_model_and_info_says_so(tiny_dir):
    settings = ServeSettings(model=tiny_dir, runtime="torch", dense_dtype="fp32")
    full = load_served_model(settings).model
    half = load_served_model(settings.model_copy(update={"dtype": "bfloat16"})).model
    assert full.backend_info()["dtype"] == "float32" and half.backend_info()["dtype"] == "bfloat16"
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    with torch.inference_mode():
        a, b = full.embed(ids, torch.ones_like(ids), hashes=0), half.embed(ids, torch.ones_like(ids), hashes=0)
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b).item() > 0.99


def test_pooling_runs_in_float32_so_a_long_fp16_sum_cannot_overflow(tiny_dir, monkeypatch):
    model = load_served_model(ServeSettings(model=tiny_dir, runtime="torch", dense_dtype="fp32")).model
    states = torch.full((1, 4096, model.config.hidden_size), 30.0, dtype=torch.float16)  # the sum: 122880
    monkeypatch.setattr(type(model), "last_hidden", lambda self, ids, mask, hashes=None: states)
    ids = torch.ones(1, 4096, dtype=torch.long)
    out = model.embed(ids, torch.ones_like(ids))
    assert out.dtype == torch.float32 and torch.equal(out, torch.full_like(out, 30.0))
