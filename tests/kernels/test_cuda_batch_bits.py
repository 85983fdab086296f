"""One text, one vector on a GPU: the same bits alone or padded inside a batch (docs/cuda.md,
"Deterministic by default").

Runs only where torch sees a GPU (marker ``cuda``). The op's CUDA cumulation builds its bucket
tables by the sorted path by default (no float atomics), so a text's attention output and its
gradients must not move by one bit when other, longer texts share its call and it is padded. The
model test adds the dense layers (cuBLAS): if the op tests pass and it fails, the GEMMs chose
kernels by row count, not the attention.
"""

from __future__ import annotations

import pytest
import torch

from yoso_serve.kernels import yoso_attention
from yoso_serve.kernels._cuda import TABLES_ENV

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

LENGTHS = [300, 137, 513]  # the middle text is padded to 513 in the batch
HEADS, DIM = 4, 64


@pytest.fixture(autouse=True)
def default_tables(monkeypatch):
    monkeypatch.delenv(TABLES_ENV, raising=False)  # the default, whatever the caller's environment says


def _batch(dtype, seed=0):
    """q, k, v (B, H, N, D) on the GPU and the (B, N) mask of LENGTHS' texts padded to the longest."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (len(LENGTHS), HEADS, max(LENGTHS), DIM)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(3))
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.bool, device="cuda")
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = True
    return q, k, v, mask


@pytest.mark.parametrize("int8_hash", [False, True], ids=["rotation", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_gives_a_text_the_same_bits_alone_and_padded_in_a_batch(dtype, int8_hash):
    q, k, v, mask = _batch(dtype)
    args = dict(num_hashes=32, hash_bits=8, seed=3, backend="cuda", int8_hash=int8_hash, out_dtype=torch.float32)
    with torch.inference_mode():
        batched = yoso_attention(q, k, v, mask, **args)
        assert torch.equal(yoso_attention(q, k, v, mask, **args), batched)  # run to run
        for row, n in enumerate(LENGTHS):
            alone = yoso_attention(*(t[row : row + 1, :, :n] for t in (q, k, v)), **args)
            assert torch.equal(alone[0], batched[row, :, :n]), (row, n)


def test_gradients_give_a_text_the_same_bits_alone_and_padded_in_a_batch():
    """The backward's cumulations (grad V: the sorted tables again; grad q̂, k̂: the weighted op)."""
    q, k, v, mask = _batch(torch.float32, seed=1)
    weight = torch.randn(q.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    args = dict(num_hashes=16, hash_bits=4, seed=5, backend="cuda")  # τ = 4: crowded buckets
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (yoso_attention(*leaves, mask, **args) * weight * mask[:, None, :, None]).sum().backward()
    for row, n in enumerate(LENGTHS):
        mine = [t[row : row + 1, :, :n].clone().requires_grad_() for t in (q, k, v)]
        (yoso_attention(*mine, **args) * weight[row : row + 1, :, :n]).sum().backward()
        for name, alone, batched in zip("qkv", mine, leaves):
            assert torch.equal(alone.grad[0], batched.grad[row, :, :n]), (name, row, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_models_vector_is_the_same_alone_and_padded_in_a_batch(dtype):
    from yoso_serve.model import EncoderConfig, EncoderModel

    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, max_position_embeddings=600, use_expectation=False, num_hash=16,
                           hash_code_len=8)
    model = EncoderModel(config).eval().to("cuda", dtype)
    ids = torch.randint(5, 100, (len(LENGTHS), max(LENGTHS)), device="cuda")
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    with torch.inference_mode():
        batched = model.embed(ids, mask, hashes=16)
        for row, n in enumerate(LENGTHS):
            alone = model.embed(ids[row : row + 1, :n], mask[row : row + 1, :n], hashes=16)
            assert torch.equal(alone[0], batched[row]), (row, n)
