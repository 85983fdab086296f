"""Helpers shared by several test folders: random hash codes, the fp32 comparison, the tiny configs.

Importable as ``yoso_testkit`` (pytest puts tests/support, and only it, on ``sys.path``: see
``pythonpath`` in pyproject.toml). Conftests cannot be imported under ``--import-mode=importlib``, so
what more than one folder needs lives here, once.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from yoso_serve.model import EncoderConfig, EncoderModel

# A two-layer YOSO encoder small enough for a forward in milliseconds: 16 hashes of 6 bits.
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=128,
    type_vocab_size=2,
    hash_code_len=6,
    num_hash=16,
    pad_token_id=0,
)


def tiny_config(**overrides) -> EncoderConfig:
    return EncoderConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, *, with_classifier: bool = False, with_mlm: bool = False, **overrides) -> EncoderModel:
    torch.manual_seed(seed)
    return EncoderModel(tiny_config(**overrides), with_classifier=with_classifier, with_mlm=with_mlm).eval()


def random_ids(lengths: list[int], *, vocab: int = TINY["vocab_size"], seed: int = 0) -> list[list[int]]:
    """Token ids avoiding 0 (the pad id), one list per length."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def pad_batch(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad → input_ids (B, N) int64 and attention_mask (B, N) int64."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def random_codes(gen: torch.Generator | int, bh: int, m: int, n: int, hash_bits: int,
                 mask_frac: float = 0.2) -> torch.Tensor:
    """(BH, m, N) int32 codes in [0, 2^τ); a fraction of tokens masked (-1 in every hash).
    ``gen``: a generator, or a seed for a fresh one."""
    if isinstance(gen, int):
        gen = torch.Generator().manual_seed(gen)
    codes = torch.randint(0, 1 << hash_bits, (bh, m, n), generator=gen, dtype=torch.int32)
    masked = torch.rand(bh, 1, n, generator=gen) < mask_frac
    return codes.masked_fill(masked, -1)


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """fp32 elementwise, relative to the largest entry (sums of many fp32 terms in another order)."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=rtol, atol=rtol * scale)


# C++ for host drivers that draw their own inputs: a seeded LCG (`state`, next_u) and a hash code for
# 2^tau = nb buckets, one in 20 masked (-1) and one in 20 past the table (nb .. nb + 2, which the
# kernels treat as masked), the rest uniform.
HOST_RANDOM = r"""
static unsigned long long state = 1;
static unsigned next_u() { state = state * 6364136223846793005ull + 1442695040888963407ull; return unsigned(state >> 33); }
static int random_code(int nb) {
  const unsigned r = next_u() % 20;
  return r == 0 ? -1 : r == 1 ? nb + int(next_u() % 3) : int(next_u() % nb);
}
"""


ASAN_FLAGS = ("-Xcompiler", "-fsanitize=address", "-lasan")

# The register hash kernels' per-thread items (yoso_cuda_hash.cu: rotate_item, int8_hash_item) run on the
# CPU for every thread index a launch makes, and `extra` past the grid's end. argv: kind (rotate | int8)
# bh heads n d m tau P extra table_floats, then files x (bh*n*d fp32), table (table_floats fp32: the
# rotation's signs or the int8 planes), codes out. Buffers are exactly their size.
HASH_GROUPS_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "yoso_cuda_hash.cu"
template <HashItem Item> int run(char** a) {
  const long long bh = atoll(a[2]), heads = atoll(a[3]), n = atoll(a[4]), d = atoll(a[5]), m = atoll(a[6]);
  const int tau = atoi(a[7]);
  const long long extra = atoll(a[9]), table = atoll(a[10]);
  std::vector<float> x(bh * n * d), w(table);
  std::vector<int32_t> codes(bh * m * n, -7);
  FILE* f = fopen(a[11], "rb"); if (!f || fread(x.data(), 4, x.size(), f) != x.size()) return 2; fclose(f);
  f = fopen(a[12], "rb"); if (!f || fread(w.data(), 4, w.size(), f) != w.size()) return 2; fclose(f);
  const long long groups = (m + kHashesPerThread - 1) / kHashesPerThread;
  for (long long item = 0; item < bh * groups * n + extra; ++item)
    Item(item, x.data(), w.data(), codes.data(), bh, heads, n, d, m, tau);
  f = fopen(a[13], "wb"); fwrite(codes.data(), 4, codes.size(), f); fclose(f);
  return 0;
}
template <int P> int kind(char** a) {
  if (!strcmp(a[1], "rotate")) return run<rotate_item<P>>(a);
  if (!strcmp(a[1], "int8")) return run<int8_hash_item<P>>(a);
  return 5;
}
int main(int argc, char** argv) {
  if (argc != 14) return 3;
  switch (atoi(argv[8])) {
    case 1: return kind<1>(argv); case 2: return kind<2>(argv); case 4: return kind<4>(argv);
    case 8: return kind<8>(argv); case 16: return kind<16>(argv); case 32: return kind<32>(argv);
    case 64: return kind<64>(argv); default: return 4;
  }
}
"""


def run_hash_groups(driver: Path, kind: str, x, table, m: int, tau: int, p: int, work: Path):
    """Codes (B, H, m, N) int32 of HASH_GROUPS_DRIVER (built by build_host_driver) for x (B, H, N, D)
    fp32 and the kernel's table (signs (H, m, 3, P) for "rotate", planes (H, D, m·τ) for "int8")."""
    import numpy as np
    import torch

    batch, heads, n, dim = x.shape
    x.numpy().tofile(work / "x.bin")
    table.numpy().tofile(work / "table.bin")
    args = [kind, batch * heads, heads, n, dim, m, tau, p, 300, table.numel(), work / "x.bin", work / "table.bin",
            work / "codes.bin"]
    done = subprocess.run([str(driver), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return torch.from_numpy(np.fromfile(work / "codes.bin", dtype=np.int32)).view(batch, heads, m, n)


def build_host_driver(out: Path, source: str, *csrc_files: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile a driver's CUDA source (host code calling the kernels' host or __host__ __device__
    code, so it runs on a CPU) with the kernels' csrc/ on the include path and the named csrc
    files linked in, for one device target; fails the test when there is no CUDA toolkit, which
    CI must have to compile the kernels. ``flags``: more nvcc arguments (ASAN_FLAGS: every host
    read and write bounds-checked, a bad one ends the driver with AddressSanitizer's report)."""
    import pytest

    import yoso_serve.kernels
    from yoso_serve.kernels import _build

    home, how = _build.find_cuda_toolkit()
    if home is None:
        pytest.fail(f"no CUDA toolkit ({how}): CI must compile the CUDA kernels")
    csrc = Path(yoso_serve.kernels.__file__).resolve().parent / "csrc"
    (out / "driver.cu").write_text(source)
    cmd = [str(home / "bin" / "nvcc"), "-std=c++17", "-O1", "-gencode=arch=compute_80,code=sm_80", f"-I{csrc}",
           *flags, str(out / "driver.cu"), *(str(csrc / name) for name in csrc_files), "-o", str(out / "driver")]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    return out / "driver"
