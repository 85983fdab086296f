"""YOSO attention on the GPU (CUDA kernels) against torch SDPA (flash), versus sequence length.

B=1, H=12, D=64, τ=8 by default; YOSO-m for m in ``--hashes`` (default 16, 32, 64) and SDPA
with the flash backend, in the same process. For every N: forward and forward+backward time
(CUDA events, median of ``--repeats`` after warm-up) and peak extra memory
(``torch.cuda.max_memory_allocated`` above the inputs); YOSO runs the default sorted table build
(no float atomics), and YOSO-32 also the atomic build it replaced (``yoso-32-atomic``, opted in with
YOSO_CUDA_TABLES=atomic), which stays only if it is measured faster. The cumulation kernel alone is also timed, and its compulsory traffic (codes, V
and the output, each read or written once) is divided by the bandwidth of a device-to-device
copy measured in the same run: the fraction of the memory bandwidth the kernel achieves. Hash
codes are timed three ways (int8 in one kernel, int8 as quantize + GEMM + pack, the fp32 rotation)
on the bench's heads and on the bundled model's shape (8 × 4096 tokens, 12 heads of 32).
Prints a markdown table and the issue's targets, writes a PNG plot.

Runs only with CUDA (exits with a message otherwise):

    PYTHONSAFEPATH=1 .venv/bin/python bench/attention_cuda.py [--lengths 1024 8192 65536] [--dtype fp16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from yoso_serve.kernels import _build, hash_codes, yoso_attention

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "bench" / "out" / "attention_cuda.png"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() over repeats, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def peak_mib(fn) -> float:
    """Peak memory fn() allocates above what is live before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the achievable bandwidth."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / (ms / 1e3)


def sdpa_fns(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)

    def train():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(*leaves).sum().backward()

    return forward, train


def yoso_fns(q, k, v, hashes: int, bits: int, atomic: bool = False):
    """(forward, forward+backward) of yoso_attention; atomic: the atomic table build (the opt-in)."""
    from yoso_serve.kernels._cuda import TABLES_ENV

    args = dict(num_hashes=hashes, hash_bits=bits, backend="cuda")

    def run(fn):
        before = os.environ.pop(TABLES_ENV, None)
        if atomic:
            os.environ[TABLES_ENV] = "atomic"
        try:
            return fn()
        finally:
            os.environ.pop(TABLES_ENV, None)
            if before is not None:
                os.environ[TABLES_ENV] = before

    def forward():
        with torch.no_grad():
            return run(lambda: yoso_attention(q, k, v, **args))

    def train():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        run(lambda: yoso_attention(*leaves, **args).float().sum().backward())

    return forward, train


def kernel_row(ext, n: int, heads: int, dim: int, hashes: int, bits: int, repeats: int, bandwidth: float) -> dict:
    """The cumulation kernel alone on fp32 V (sorted tables, the default; and atomic): time and achieved
    fraction of copy bandwidth."""
    x = F.normalize(torch.randn(1, heads, n, dim, device="cuda"), dim=-1)
    codes = hash_codes(x, num_hashes=hashes, hash_bits=bits).view(heads, hashes, n)
    v = torch.randn(heads, n, dim, device="cuda")
    ms = timed(lambda: ext.lsh_cumulate_cuda(codes, codes, v, bits, True), repeats)
    atomic_ms = timed(lambda: ext.lsh_cumulate_cuda(codes, codes, v, bits, False), repeats)
    compulsory = 2 * codes.numel() * 4 + 2 * v.numel() * 4  # q and k codes, V in, output out
    return {"n": n, "hashes": hashes, "ms": ms, "atomic_ms": atomic_ms,
            "fraction": compulsory / (ms / 1e3) / bandwidth}


# (batch, heads, N, D): the bench's heads at two lengths, and the bundled model's (8 documents of 4096
# tokens, 12 heads of 32), whose int8 hashing ran as quantize + GEMM + pack until 2026-11-28
HASH_SHAPES = [(1, 12, 8192, 64), (1, 12, 65536, 64), (8, 12, 4096, 32)]


def hash_row(ext, shape: tuple, hashes: int, bits: int, repeats: int, device: str = "cuda", timer=None) -> dict:
    """Codes of one (B, H, N, D) input three ways, timed: int8 hashing as the op runs it (one kernel up to
    D = 64), int8 hashing as it ran before (rows quantized in PyTorch, cuBLAS GEMM, hash_pack_cuda), and
    the fp32 fast rotation (hash_rotate_cuda); plus whether the two int8 paths gave the same codes."""
    from yoso_serve.kernels._cuda import cuda_ops
    from yoso_serve.kernels.hashing import projection_planes, quantize_rows

    timer = timer or timed
    codes, _, _ = cuda_ops(ext, None)
    x = torch.randn(*shape, device=device, generator=torch.Generator(device=device).manual_seed(2))
    proj = projection_planes(0, shape[1], hashes, bits, shape[3], True, x.device, True)

    def gemm():
        return ext.fast_hash_codes(quantize_rows(x).contiguous(), proj, hashes, bits, False)

    def kernel():
        return codes(x, hashes, bits, 0, True, True)

    row = {"shape": shape, "int8_ms": timer(kernel, repeats), "gemm_ms": timer(gemm, repeats),
           "rotate_ms": timer(lambda: codes(x, hashes, bits, 0, True, False), repeats)}
    row["equal"] = bool(torch.equal(kernel(), gemm()))
    return row


def print_hash_rows(rows: list[dict], hashes: int, bits: int) -> None:
    print(f"\n### Hash codes of one input (m={hashes}, τ={bits}; int8 as the bundled model hashes)\n")
    print("| B·H × N × D | int8 kernel ms | int8 via GEMM ms (before) | speed-up | fp32 rotation ms | int8 codes equal |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        b, h, n, d = r["shape"]
        print(f"| {b * h} × {n} × {d} | {r['int8_ms']:.3f} | {r['gemm_ms']:.3f} | {r['gemm_ms'] / r['int8_ms']:.2f}× | "
              f"{r['rotate_ms']:.3f} | {'yes' if r['equal'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--hashes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hash-bits", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="N",
                        help="also print where YOSO-32's GPU time goes at these lengths (torch.profiler, top kernels)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention_cuda.py needs a CUDA GPU; torch sees none")
    ext = _build.cuda_extension()
    if ext is None:
        sys.exit(f"the CUDA extension is not available: {_build.backend_info()}")
    dtype = DTYPES[args.dtype]
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; dtype {args.dtype}; "
          f"B=1 H={args.heads} D={args.dim} τ={args.hash_bits}; copy bandwidth {bandwidth / 1e9:.0f} GB/s\n")

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in args.lengths:
        q, k, v = (torch.randn(1, args.heads, n, args.dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
        methods = [("sdpa-flash", *sdpa_fns(q, k, v))]
        methods += [(f"yoso-{m}", *yoso_fns(q, k, v, m, args.hash_bits)) for m in args.hashes]
        methods.append(("yoso-32-atomic", *yoso_fns(q, k, v, 32, args.hash_bits, atomic=True)))
        for name, forward, train in methods:
            row = {"n": n, "method": name, "fwd_ms": timed(forward, args.repeats)}
            row["fwd_mib"] = peak_mib(forward)
            row["train_ms"] = timed(train, max(3, args.repeats // 2))
            row["train_mib"] = peak_mib(train)
            rows.append(row)
            print(f"N={n:6d} {name:12s} fwd {row['fwd_ms']:9.3f} ms  fwd+bwd {row['train_ms']:9.3f} ms", flush=True)
        del q, k, v
        torch.cuda.empty_cache()

    kernels = [kernel_row(ext, n, args.heads, args.dim, 32, args.hash_bits, args.repeats, bandwidth)
               for n in args.lengths]
    print_tables(rows, kernels, device)
    print_hash_rows([hash_row(ext, shape, 32, args.hash_bits, args.repeats) for shape in HASH_SHAPES], 32,
                    args.hash_bits)
    print_targets(rows)
    plot(rows, args.plot, device)
    for n in args.profile:
        profile(n, args.heads, args.dim, args.hash_bits, dtype)


def profile(n: int, heads: int, dim: int, bits: int, dtype: torch.dtype, top: int = 10) -> None:
    """The GPU kernels YOSO-32's forward and forward+backward spend their time in at length n."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, heads, n, dim, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    for label, fn in zip(("forward", "forward+backward"), yoso_fns(q, k, v, 32, bits)):
        fn()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        total, events = top_kernels(prof, top)
        print(f"\n### Where YOSO-32's GPU time goes: {label}, N={n} (total {total / 1e3:.3f} ms of kernels)\n")
        print("| kernel | calls | ms | share |")
        print("|---|---:|---:|---:|")
        for e in events:
            print(f"| {e.key[:70]} | {e.count} | {e.self_device_time_total / 1e3:.3f} | "
                  f"{e.self_device_time_total / max(total, 1):.0%} |")


def top_kernels(prof, top: int) -> tuple[float, list]:
    """(microseconds of device time in all, the ``top`` events that spent most of it themselves)
    of a finished torch.profiler run (also bench/gpu_run.sh's model step)."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    return total, sorted(events, key=lambda e: -e.self_device_time_total)[:top]


def print_tables(rows: list[dict], kernels: list[dict], device: str) -> None:
    sdpa = {(r["n"]): r for r in rows if r["method"] == "sdpa-flash"}
    print(f"\n### Attention on {device}\n")
    print("| N | method | fwd ms | fwd+bwd ms | fwd peak MiB | fwd+bwd peak MiB | fwd speed-up vs SDPA | fwd+bwd speed-up |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = sdpa[r["n"]]
        print(f"| {r['n']} | {r['method']} | {r['fwd_ms']:.3f} | {r['train_ms']:.3f} | {r['fwd_mib']:.0f} | "
              f"{r['train_mib']:.0f} | {base['fwd_ms'] / r['fwd_ms']:.2f}× | {base['train_ms'] / r['train_ms']:.2f}× |")
    print("\n### Cumulation kernel (m=32, fp32 V, sorted tables; compulsory bytes / copy bandwidth)\n")
    print("| N | ms | fraction of bandwidth | atomic tables ms |")
    print("|---:|---:|---:|---:|")
    for r in kernels:
        print(f"| {r['n']} | {r['ms']:.3f} | {r['fraction']:.0%} | {r['atomic_ms']:.3f} |")


def print_targets(rows: list[dict]) -> None:
    """The issue's H100 targets, checked where the run covered their lengths."""
    by = {(r["n"], r["method"]): r for r in rows}
    checks = [
        (8192, "fwd_ms", 1.0, "YOSO-32 forward at least as fast as SDPA at N=8192"),
        (65536, "fwd_ms", 5.0, "YOSO-32 forward ≥ 5× faster than SDPA at N=65536"),
        (32768, "train_ms", 3.0, "YOSO-32 forward+backward ≥ 3× faster than SDPA at N=32768"),
    ]
    print("\n### Targets\n")
    for n, key, factor, text in checks:
        if (n, "yoso-32") not in by:
            print(f"- {text}: not measured (N={n} not in --lengths)")
            continue
        speedup = by[(n, "sdpa-flash")][key] / by[(n, "yoso-32")][key]
        print(f"- {text}: {speedup:.2f}× → {'met' if speedup >= factor else 'NOT met'}")


def plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        lengths = [r["n"] for r in mine]
        axes[0].plot(lengths, [r["fwd_ms"] for r in mine], marker="o", label=method)
        axes[1].plot(lengths, [r["train_ms"] for r in mine], marker="o", label=method)
        axes[2].plot(lengths, [r["train_mib"] for r in mine], marker="o", label=method)
    titles = ["forward (ms)", "forward + backward (ms)", "forward + backward peak (MiB)"]
    for ax, title in zip(axes, titles):
        ax.set(xscale="log", yscale="log", xlabel="N", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"YOSO (CUDA kernels) vs SDPA flash — {device}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
