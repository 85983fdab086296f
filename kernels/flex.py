"""YOSO-E (exact mode) as one fused attention kernel: FlexAttention with the collision probability
as its score. For inference on a GPU, where the exact op (:mod:`.exact`) runs chunked PyTorch.

The YOSO core ℓ2-normalises every head's output row (N-YOSO), so exact mode's ``E[B]·V`` matters only
up to a positive factor per row. Dividing each row by its sum of ``E[B]`` turns it into a softmax
attention whose scores are the log of the collision probability:

    normalize(E[B]·V) = normalize(softmax_j(τ · log(1 − arccos(q̂·k̂_j)/π)) · V)

torch's FlexAttention computes that flash-style (query × key tiles on chip, never an N×N matrix) with
the score modifier below, compiled by ``torch.compile``: Triton kernels on CUDA, inductor's C++ on the
CPU (where the extension's blockwise exact kernels are 4–5× faster, so only tests run it there).

What it returns is not the op's ``E[B]·V`` but those rows divided by their weight sums: callers
normalise rows afterwards (the YOSO core does, through ``attention_finish``). Masked keys score −inf;
masked queries are zero rows, as in the op. No autograd: training keeps the op and its backwards.

Compiled shapes: lengths are padded to a multiple of :data:`LENGTH_STEP` (the padded keys masked), and
the batch dimension is marked dynamic, so a model sees at most two compilations per length bucket
(one for a single input, one for every larger batch); the YOSO core's ``warm_exact_kernel`` compiles
them ahead of traffic.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import threading

import torch
import torch.nn.functional as F

# Lengths are padded up to a multiple of this: one compiled kernel per bucket (16 buckets up to 4096 tokens).
LENGTH_STEP = 256
# Compilations torch.compile may keep per function before it falls back to eager (which would
# materialise the N×N scores): two per bucket up to 16384 tokens.
RECOMPILE_LIMIT = 2 * 16384 // LENGTH_STEP

_lock = threading.Lock()
_compiled = None


def unavailable(device: torch.device | str) -> str | None:
    """Why the fused exact kernel cannot run on ``device`` (None when it can)."""
    device = torch.device(device)
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as exc:  # pragma: no cover - every supported torch has it
        return f"this torch ({torch.__version__}) has no FlexAttention: {exc}"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile needs Triton for CUDA kernels and it is not installed"
    if device.type == "cuda" and not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return "Triton builds its kernel launcher with a C compiler (CC, gcc or clang) and none is on PATH"
    if device.type not in ("cuda", "cpu"):
        return f"FlexAttention compiles for CUDA and CPU, not {device.type}"
    return None


def _flex():
    """flex_attention under torch.compile (static shapes per length bucket), built once per process."""
    global _compiled
    with _lock:
        if _compiled is None:
            import torch._dynamo.config as dynamo_config
            from torch.nn.attention.flex_attention import flex_attention

            for name in ("recompile_limit", "cache_size_limit"):  # the name changed in torch 2.6
                if hasattr(dynamo_config, name):
                    setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), RECOMPILE_LIMIT))
                    break
            _compiled = torch.compile(flex_attention, dynamic=False)
        return _compiled


def padded_length(n: int) -> int:
    """The compiled length that serves ``n`` tokens."""
    return max(LENGTH_STEP, -(-n // LENGTH_STEP) * LENGTH_STEP)


def exact_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                         hash_bits: int) -> torch.Tensor:
    """q, k (B, H, N, D), v (B, H, N, Dv), key_mask (B, N) 0/1 or bool or None (1 = real token) →
    (B, H, N, Dv) fp32: row i is ``Σ_j E[B]_ij v_j / Σ_j E[B]_ij`` over the live keys (E[B] of eq. 6 on
    unit q̂, k̂), zero where query i is masked. Computed in v's dtype (fp16/bf16/fp32), scores in fp32."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"exact_attention_flex takes (B, H, N, D) q and k and (B, H, N, Dv) v, not "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, _, n, _ = q.shape
    dtype = v.dtype if v.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    keep = (torch.ones(batch, n, dtype=torch.bool, device=q.device) if key_mask is None
            else key_mask.to(device=q.device, dtype=torch.bool))
    if n == 0:
        return torch.zeros(*v.shape, dtype=torch.float32, device=v.device)
    pad = padded_length(n) - n
    qn = F.pad(F.normalize(q.float(), dim=-1), (0, 0, 0, pad)).to(dtype)
    kn = F.pad(F.normalize(k.float(), dim=-1), (0, 0, 0, pad)).to(dtype)
    vp = F.pad(v.to(dtype), (0, 0, 0, pad))
    live = F.pad(keep, (0, pad))
    live |= ~live.any(dim=1, keepdim=True)  # an input with no live key: any finite row (its queries are zeroed)
    bias = torch.zeros(live.shape, dtype=torch.float32, device=q.device).masked_fill_(~live, -math.inf)
    tau = float(hash_bits)

    def score(s, b, h, q_idx, kv_idx):
        # log E[B] = τ · log(1 − θ/π), θ = arccos(q̂·k̂); −inf where q̂ = −k̂ and for masked keys
        return tau * torch.log1p(torch.acos(s.clamp(-1.0, 1.0)) * (-1.0 / math.pi)) + bias[b, kv_idx]

    if batch > 1:  # one compilation serves every batch size above 1
        for t in (qn, kn, vp):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(bias, 0)
    out = _flex()(qn, kn, vp, score_mod=score, scale=1.0)
    return out[:, :, :n].float().mul_(keep[:, None, :, None])


def buckets(max_tokens: int) -> range:
    """The padded lengths that serve inputs of 1 … ``max_tokens`` tokens."""
    return range(LENGTH_STEP, padded_length(max_tokens) + 1, LENGTH_STEP)
