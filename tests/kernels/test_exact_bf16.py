"""Exact mode (YOSO-E) over bf16 q, k, v with AVX-512 BF16 dot products (kernels/csrc/yoso_cpu_simd_bf16.cpp).

Where the CPU has them (``ext.bf16_dots()``), ``exact_attention`` reads bf16 q and k as they are: each cosine is
the sum of the rows' exact products scaled by their inverse norms. Against the float64 closed form; against the
fp32 tiles the same machine runs for fp32 copies (and, with YOSO_CPU_NO_BF16_DOT=1, for bf16 too); and a text's
bits alone, padded in a batch, and at any thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def dots(ext):
    """The extension, where this CPU has AVX-512 BF16 dot products (the machines this project serves on do:
    AMD EPYC Zen 4, Intel Xeon with AMX); the fp32 tiles that others run are tested by the switch-off below."""
    if not ext.bf16_dots():
        pytest.skip("this CPU has no AVX-512 BF16 dot products")
    return ext


def head_split(batch: int, length: int, heads: int, dim: int, seed: int):
    """bf16 (B, H, N, D) views of one (B, N, 3, H, D) tensor, as the fused projection gives them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3, heads, dim, generator=gen).bfloat16()
    return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))


@pytest.mark.parametrize("length", [1, 61, 137, 300])  # one query block, several, and past one key block (256)
@pytest.mark.parametrize("dim", [32, 64, 6, 40])  # the bundled head, a wider one, 3 pairs, a partial 16-pair step
def test_bf16_dots_match_the_closed_form_and_the_fp32_tiles(dots, oracles, length, dim):
    q, k, v = head_split(3, length, 4, dim, seed=length + dim)
    q = q * 9.0  # a row's scale never reaches the cosine
    keep = oracles.lengths_mask([length, max(1, length // 2), max(1, length - 3)], length)
    keep[2, 0] = False  # a hole before the last real token
    got = dots.exact_attention(q, k, v, keep, 8)
    expected = oracles.naive_yoso_e(q.float(), k.float(), v.float(), keep, 8)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
    wide = dots.exact_attention(q.float(), k.float(), v.float(), keep, 8)  # the fp32 tiles
    torch.testing.assert_close(got, wide, rtol=1e-4, atol=1e-5)
    assert not got.isnan().any() and (got[~keep[:, None, :].expand(3, 4, length)] == 0).all()


@pytest.mark.parametrize(("length", "padded"), [(150, 300), (97, 1000), (256, 263), (1, 50)])
def test_a_bf16_text_gives_the_same_bits_alone_or_padded_in_a_batch(dots, oracles, length, padded):
    q, k, v = head_split(2, padded, 3, 32, seed=length)
    keep = oracles.lengths_mask([padded, length], padded)
    batch = dots.exact_attention(q, k, v, keep, 8)
    alone = dots.exact_attention(*(x[1:, :, :length] for x in (q, k, v)), keep[1:, :length], 8)
    assert torch.equal(batch[1:, :, :length], alone)
    assert not batch[1:, :, length:].any()


def test_bf16_dots_give_the_same_bits_at_any_thread_count(dots, oracles):
    q, k, v = head_split(2, 777, 3, 32, seed=5)
    keep = oracles.lengths_mask([777, 500], 777)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 4, 2):
            torch.set_num_threads(threads)
            results.append(dots.exact_attention(q, k, v, keep, 8))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


_RUN = r"""
import sys, torch
from yoso_serve.kernels import _build
ext = _build.cpu_extension()
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 137, 3, 32, generator=gen).bfloat16().transpose(1, 2) for _ in range(3))
keep = torch.ones(2, 137, dtype=torch.bool); keep[1, 100:] = False
torch.save({"dots": ext.bf16_dots(), "bf16": ext.exact_attention(q, k, v, keep, 8),
            "fp32": ext.exact_attention(q.float(), k.float(), v.float(), keep, 8)}, sys.argv[1])
"""


def test_the_switch_off_runs_the_fp32_tiles_for_bf16(ext, tmp_path):
    """YOSO_CPU_NO_BF16_DOT=1 (and so a CPU without the instructions) reads bf16 as its fp32 values: the bits of
    fp32 copies; the dot products, where the CPU has them, are within fp32 rounding of that."""
    runs = {}
    for name, env in (("default", {}), ("off", {"YOSO_CPU_NO_BF16_DOT": "1"})):
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _RUN, str(path)], check=True, env={**os.environ, **env})
        runs[name] = torch.load(path)
    off, default = runs["off"], runs["default"]
    assert not off["dots"] and default["dots"] == ext.bf16_dots()
    assert torch.equal(off["bf16"], off["fp32"]) and torch.equal(off["fp32"], default["fp32"])
    torch.testing.assert_close(default["bf16"], off["bf16"], rtol=1e-4, atol=1e-5)


def test_odd_widths_read_bf16_as_its_fp32_values(ext, oracles):
    """An odd head width has no whole pairs: the fp32 tiles, the bits of fp32 copies."""
    q, k, v = head_split(2, 61, 3, 13, seed=13)
    keep = oracles.lengths_mask([61, 40], 61)
    assert torch.equal(ext.exact_attention(q, k, v, keep, 8),
                       ext.exact_attention(q.float(), k.float(), v.float(), keep, 8))
