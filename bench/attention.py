"""Attention operators on CPU: SDPA vs YOSO-E vs YOSO-m, and YOSO-m's approximation error.

Part 1, time and peak memory of one forward versus N (B=1, H=12, τ=8, fp32, inference mode):
torch ``scaled_dot_product_attention``, YOSO-E (exact expectation, O(N²), skipped past
``--exact-max``) and YOSO-m (``--hashes``), through the public ``yoso_attention`` with the
backend it picks (with the C++ extension: the fused ``lsh_attention`` and ``exact_attention``),
and the floor "GEMM": the same shapes' hash projection alone (q and k times the (D, 32·τ)
projection, ``torch.matmul``). Per N the methods are interleaved inside every repeat, after one
warm-up per method; the median of ``--repeats`` is reported, with the crossover N where YOSO-E
costs as much as YOSO-32. A breakdown of YOSO-32 shows where the time goes: hashing q and k
and the cumulation as separate kernels, against the fused op and the projection GEMM.

Peak memory is the growth of the resident set during one forward (the kernel's VmHWM
high-water mark, reset after a same-size warm-up, minus the RSS just before the call), in a
fresh subprocess per case: it counts everything the forward touches (torch tensors, MKL and
kernel scratch, thread stacks), not only torch's allocations, and not the inputs.

Part 2, like Figure 8 of the paper: the mean angle (degrees) between YOSO-m and YOSO-E output
rows versus N and m, on random Gaussian q, k, v and, with ``--model DIR`` (a BERT-family
Hugging Face directory), on the Q/K/V of one attention layer over a long text run in
512-token windows and concatenated.

    PYTHONSAFEPATH=1 .venv/bin/python bench/attention.py [--quick] [--sizes 512 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F
from tqdm import tqdm

# appended, not prepended: PYTHONSAFEPATH keeps bench/ off the path, and bench/onnx.py must not shadow onnx
sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine  # noqa: E402

from yoso_serve.kernels import backend_info, yoso_attention
from yoso_serve.kernels.hashing import projection_planes
from yoso_serve.kernels.yoso import _kernels
from yoso_serve.kernels.cumulate import lsh_cumulate as torch_lsh_cumulate

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    full = dict(sizes=[128, 256, 512, 1024, 2048, 4096, 8192, 16384], dims=[32, 64], hashes=[16, 32, 64], repeats=3,
                error_sizes=[64, 128, 256, 512, 1024, 2048, 4096], error_hashes=[8, 16, 32, 64, 128])
    quick = dict(
        sizes=[256, 512], dims=[32], hashes=[16, 32], repeats=1, error_sizes=[64, 128, 256], error_hashes=[8, 32]
    )
    p.add_argument("--sizes", type=int, nargs="+", help=f"sequence lengths N (default {full['sizes']})")
    p.add_argument("--dims", type=int, nargs="+", help=f"head dimensions D (default {full['dims']})")
    p.add_argument("--hashes", type=int, nargs="+", help=f"m for YOSO-m (default {full['hashes']})")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--hash-bits", type=int, default=8)
    p.add_argument("--repeats", type=int, help=f"timed runs per case, median reported (default {full['repeats']})")
    p.add_argument("--exact-max", type=int, default=8192, help="largest N for O(N²) YOSO-E")
    p.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    p.add_argument("--no-error", action="store_true", help="skip part 2 (the approximation error study)")
    p.add_argument("--error-sizes", type=int, nargs="+", help=f"N of the error study (default {full['error_sizes']})")
    p.add_argument("--error-hashes", type=int, nargs="+", help=f"m of the error study (default {full['error_hashes']})")
    p.add_argument("--error-dim", type=int, default=64, help="D of the random q, k, v")
    p.add_argument("--model", type=Path, help="BERT-family HF directory for real Q/K/V")
    p.add_argument("--layer", type=int, default=2, help="attention layer of --model")
    p.add_argument("--text", type=Path, help="text for --model (default: the repository's *.md files)")
    p.add_argument("--out", type=Path, help="folder for plots and results (default docs/img, quick: bench/out)")
    p.add_argument("--quick", action="store_true", help=f"small defaults {quick}: checks the script runs")
    p.add_argument("--memory-case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out = args.out or ROOT / ("bench/out" if args.quick else "docs/img")
    return args


def forward_fn(method: str, hash_bits: int):
    """method ∈ {"SDPA", "GEMM", "YOSO-E", "YOSO-<m>", "YOSO-<m> int8"} → f(q, k, v) running one forward
    ("int8": q and k hashed in int8, kernels/hashing.py)."""
    if method == "SDPA":
        return F.scaled_dot_product_attention
    if method == "GEMM":  # YOSO-32's hash projections of q and k, nothing else: the floor
        def projections(q, k, v):
            proj = projection_planes(0, q.shape[1], 32, hash_bits, q.shape[-1], True, q.device)
            return torch.matmul(q, proj), torch.matmul(k, proj)

        return projections
    if method == "YOSO-E":
        return lambda q, k, v: yoso_attention(q, k, v, exact=True, hash_bits=hash_bits)
    m, int8 = int(method.split("-")[1].split()[0]), method.endswith(" int8")
    return lambda q, k, v: yoso_attention(q, k, v, num_hashes=m, hash_bits=hash_bits, int8_hash=int8)


def inputs(n: int, d: int, heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, d, generator=gen) for _ in range(3))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def memory_case(spec: str) -> None:
    """Child process: print the RSS growth (bytes) of one forward of the case in spec (JSON).

    A warm-up forward of the same size first touches code pages and fills caches; then the
    kernel's high-water mark is reset (``/proc/self/clear_refs``) and the second forward's peak
    RSS minus the RSS before it is the answer. The parent sets a fixed malloc mmap threshold, so
    freed large blocks go back to the OS instead of being silently reused.
    """
    case = json.loads(spec)
    torch.set_num_threads(case["threads"])
    fn = forward_fn(case["method"], case["hash_bits"])
    with torch.inference_mode():
        q, k, v = inputs(case["n"], case["d"], case["heads"])
        fn(q, k, v)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        fn(q, k, v)
    print(json.dumps({"extra_bytes": max(0, _status_kib("VmHWM") - before) * 1024}))


def measure_memory(method: str, n: int, d: int, args) -> float:
    spec = dict(method=method, n=n, d=d, heads=args.heads, hash_bits=args.hash_bits, threads=torch.get_num_threads())
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-case", json.dumps(spec)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_bytes"] / 2**20


def run_speed(args) -> dict:
    methods = ["SDPA", "GEMM", "YOSO-E"] + [f"YOSO-{m}" for m in args.hashes] + [f"YOSO-{m} int8" for m in args.hashes]
    results = {}  # (d, n, method) -> {"ms": .., "mb": ..}
    steps = len(args.dims) * len(args.sizes) * len(methods) * (args.repeats + (0 if args.no_memory else 1))
    bar = tqdm(total=steps, desc="speed", unit="run")
    with torch.inference_mode():
        for d in args.dims:
            for method in methods:  # warm-up: extension load, projection caches, thread pools
                forward_fn(method, args.hash_bits)(*inputs(min(args.sizes), d, args.heads))
            for n in args.sizes:
                live = [m for m in methods if m != "YOSO-E" or n <= args.exact_max]
                q, k, v = inputs(n, d, args.heads)
                times = {m: [] for m in live}
                for _ in range(args.repeats):
                    for method in live:
                        times[method].append(timed(forward_fn(method, args.hash_bits), q, k, v))
                        bar.update()
                for method in live:
                    mb = None if args.no_memory else measure_memory(method, n, d, args)
                    results[(d, n, method)] = {"ms": 1e3 * median(times[method]), "mb": mb}
                    bar.update(0 if args.no_memory else 1)
                bar.update((len(methods) - len(live)) * (args.repeats + (0 if args.no_memory else 1)))
    bar.close()
    return {"methods": methods, "results": results}


def profile_yoso(args, m: int = 32) -> dict:
    """Median ms of each stage of YOSO-m's forward: (d, n) -> {stage: ms}.

    The separate kernels (hash codes of q and k, then the cumulation) are what a training step
    runs; the fused op (one pass, codes never leave the kernel) is what inference runs; the
    projection GEMM alone (torch) is the floor the issue measures against.
    """
    kernels = _kernels("auto", torch.device("cpu"))
    where = "C++" if kernels.cumulate is not torch_lsh_cumulate else "torch"
    stages = {}
    with torch.inference_mode():
        for d in args.dims:
            for n in tqdm(args.sizes, desc=f"profile D={d}", unit="N"):
                q, k, v = inputs(n, d, args.heads)
                bits = args.hash_bits
                codes = kernels.codes(q, m, bits, 0, True).view(args.heads, m, n)
                work = {
                    "projection GEMM (torch)": lambda: forward_fn("GEMM", bits)(q, k, v),
                    f"hash q, k ({where})": lambda: [kernels.codes(x, m, bits, 0, True) for x in (q, k)],
                    f"hash q, k int8 ({where})": lambda: [kernels.codes(x, m, bits, 0, True, True) for x in (q, k)],
                    f"cumulate ({where})": lambda: kernels.cumulate(codes, codes, v.view(args.heads, n, d), bits),
                    "yoso_attention (fused)": lambda: forward_fn(f"YOSO-{m}", bits)(q, k, v),
                    "fused, int8 hashing": lambda: forward_fn(f"YOSO-{m} int8", bits)(q, k, v),
                }
                stage_ms = {}
                for name, fn in work.items():
                    fn()
                    stage_ms[name] = 1e3 * median(timed(fn) for _ in range(args.repeats))
                stages[(d, n)] = stage_ms
    return stages


def crossover(speed: dict, d: int, args, m: int = 32) -> str:
    """N where YOSO-E costs as much as YOSO-m (log-log interpolation between measured sizes)."""
    pts = [(n, speed["results"][(d, n, "YOSO-E")]["ms"], speed["results"][(d, n, f"YOSO-{m}")]["ms"])
           for n in args.sizes if (d, n, "YOSO-E") in speed["results"] and (d, n, f"YOSO-{m}") in speed["results"]]
    for (n0, e0, l0), (n1, e1, l1) in zip(pts, pts[1:]):
        r0, r1 = math.log(e0 / l0), math.log(e1 / l1)
        if r0 <= 0 < r1:
            return f"{math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * -r0 / (r1 - r0)):.0f}"
    if pts and all(e > lsh for _, e, lsh in pts):
        return f"below {pts[0][0]}"
    return f"above {pts[-1][0]}" if pts else "not measured"


def mean_angle_deg(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean angle between matching rows of a and b (…, D), rows where either is zero left out."""
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    keep = (a.norm(dim=-1) > 0) & (b.norm(dim=-1) > 0)
    cos = F.cosine_similarity(a[keep], b[keep], dim=-1).clamp(-1, 1)
    return math.degrees(torch.arccos(cos).mean().item())


def model_qkv(args, n_max: int) -> tuple[torch.Tensor, ...]:
    """(1, H, n_max, Dh) Q, K, V of layer --layer of --model over the text, 512-token windows."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).eval()
    files = [args.text] if args.text else sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md"))
    ids = tokenizer("\n".join(Path(f).read_text() for f in files), add_special_tokens=False)["input_ids"]
    ids = (ids * (n_max // max(1, len(ids)) + 1))[:n_max]  # a short text is cycled, said in the docs
    attention = model.encoder.layer[args.layer].attention.self
    heads = model.config.num_attention_heads
    grabbed = {"query": [], "key": [], "value": []}
    hooks = [
        getattr(attention, name).register_forward_hook(lambda _m, _i, out, name=name: grabbed[name].append(out))
        for name in grabbed
    ]
    window = tokenizer.model_max_length if tokenizer.model_max_length < 10**6 else 512
    with torch.inference_mode():
        for start in range(0, n_max, window - 2):
            chunk = ids[start : start + window - 2]
            model(torch.tensor([[tokenizer.cls_token_id] + chunk + [tokenizer.sep_token_id]]))
    for hook in hooks:
        hook.remove()

    def heads_first(name):  # [(1, w, H·Dh)] without the special tokens → (1, H, n_max, Dh)
        rows = torch.cat([x[0, 1:-1] for x in grabbed[name]])[:n_max]
        return rows.view(n_max, heads, -1).transpose(0, 1)[None].contiguous()

    return tuple(heads_first(name) for name in ("query", "key", "value"))


def run_error(args) -> dict:
    """source -> {(m, n): mean angle in degrees between YOSO-m and YOSO-E}."""
    n_max = max(args.error_sizes)
    sources = {"random": inputs(n_max, args.error_dim, 4, seed=1)}
    if args.model:
        sources[f"{args.model.name} layer {args.layer}"] = model_qkv(args, n_max)
    errors = {}
    with torch.inference_mode():
        for source, (q, k, v) in sources.items():
            errors[source] = {}
            for n in tqdm(args.error_sizes, desc=f"error ({source})", unit="N"):
                qn, kn, vn = (x[:, :, :n].contiguous() for x in (q, k, v))
                exact = yoso_attention(qn, kn, vn, exact=True, hash_bits=args.hash_bits)
                for m in args.error_hashes:
                    approx = yoso_attention(qn, kn, vn, num_hashes=m, hash_bits=args.hash_bits)
                    errors[source][(m, n)] = mean_angle_deg(approx, exact)
    return errors




def speed_tables(speed: dict, args) -> str:
    out = []
    for d in args.dims:
        out += [f"\n**D = {d}** (B=1, H={args.heads}, τ={args.hash_bits}, fp32, forward only)\n"]
        out += ["| N | method | ms | ms / 1k tokens | speed-up vs SDPA | peak extra MB |"]
        out += ["|---:|---|---:|---:|---:|---:|"]
        for n in args.sizes:
            sdpa = speed["results"][(d, n, "SDPA")]["ms"]
            for method in speed["methods"]:
                r = speed["results"].get((d, n, method))
                if r is None:
                    out.append(f"| {n} | {method} | — | — | — | — |")
                    continue
                mb = "—" if r["mb"] is None else f"{r['mb']:.1f}"
                per_k = r["ms"] / n * 1e3
                out.append(f"| {n} | {method} | {r['ms']:.1f} | {per_k:.2f} | {sdpa / r['ms']:.2f}× | {mb} |")
        if "YOSO-32" in speed["methods"]:
            out += [f"\n**D = {d}: the targets** (same-run medians)\n",
                    "| N | SDPA / YOSO-32 | SDPA / YOSO-32 int8 | YOSO-32 / GEMM | YOSO-32 int8 / GEMM | YOSO-E / YOSO-32 |",
                    "|---:|---:|---:|---:|---:|---:|"]
            for n in args.sizes:
                r = {m: speed["results"].get((d, n, m), {}).get("ms")
                     for m in ("SDPA", "GEMM", "YOSO-E", "YOSO-32", "YOSO-32 int8")}
                exact = f"{r['YOSO-E'] / r['YOSO-32']:.2f}" if r["YOSO-E"] else "—"
                i8 = r["YOSO-32 int8"]
                out.append(f"| {n} | {r['SDPA'] / r['YOSO-32']:.2f}× | {r['SDPA'] / i8:.2f}× | "
                           f"{r['YOSO-32'] / r['GEMM']:.2f}× | {i8 / r['GEMM']:.2f}× | {exact} |")
            out.append(f"\nCrossover (YOSO-E costs as much as YOSO-32): N ≈ {crossover(speed, d, args)}")
    return "\n".join(out)


def profile_tables(stages: dict, args) -> str:
    names = list(next(iter(stages.values())))
    out = ["\n**Where YOSO-32's forward time goes** (ms, median; stages timed separately)\n"]
    out += ["| D | N | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    for (d, n), ms in stages.items():
        out.append(f"| {d} | {n} | " + " | ".join(f"{ms[name]:.1f}" for name in names) + " |")
    return "\n".join(out)


def error_tables(errors: dict, args) -> str:
    out = []
    for source, table in errors.items():
        out += [f"\n**Mean angle (degrees) between YOSO-m and YOSO-E outputs: {source}** (τ={args.hash_bits})\n"]
        out += ["| N | " + " | ".join(f"m={m}" for m in args.error_hashes) + " |"]
        out += ["|---:|" + "---:|" * len(args.error_hashes)]
        for n in args.error_sizes:
            out.append(f"| {n} | " + " | ".join(f"{table[(m, n)]:.1f}" for m in args.error_hashes) + " |")
    return "\n".join(out)


def plot(speed: dict, errors: dict, args) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    figures = (
        ("ms", "forward time (ms)", "attention_time.png"),
        ("mb", "peak extra memory (MB)", "attention_memory.png"),
    )
    for key, label, name in figures:
        if key == "mb" and args.no_memory:
            continue
        fig, axes = plt.subplots(1, len(args.dims), figsize=(6 * len(args.dims), 4.5), squeeze=False)
        for ax, d in zip(axes[0], args.dims):
            for method in speed["methods"]:
                pts = [(n, r[key]) for n in args.sizes if (r := speed["results"].get((d, n, method))) and r[key]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=method)
            ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=label)
            ax.set_title(f"D = {d}, H = {args.heads}, τ = {args.hash_bits}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / name, dpi=110)
        plt.close(fig)
        written.append(args.out / name)
    if not errors:
        return written
    fig, axes = plt.subplots(1, len(errors), figsize=(6 * len(errors), 4.5), squeeze=False)
    for ax, (source, table) in zip(axes[0], errors.items()):
        for m in args.error_hashes:
            ax.plot(args.error_sizes, [table[(m, n)] for n in args.error_sizes], marker="o", label=f"m = {m}")
        ax.set(xscale="log", xlabel="sequence length N", ylabel="mean angle to YOSO-E (degrees)", title=source)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "attention_error.png", dpi=110)
    plt.close(fig)
    return written + [args.out / "attention_error.png"]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_case:
        memory_case(args.memory_case)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "PYTHONSAFEPATH=1 .venv/bin/python bench/attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = backend_info()
    print(f"machine: {machine()}\nbackend: {info['backend']} ({info['reason']})\ncommand: {command.strip()}")
    speed = run_speed(args)
    stages = profile_yoso(args)
    errors = {} if args.no_error else run_error(args)
    report = "\n".join([speed_tables(speed, args), profile_tables(stages, args), error_tables(errors, args)])
    print(report)
    written = plot(speed, errors, args)
    results = {
        "machine": machine(),
        "backend": info,
        "command": command.strip(),
        "speed": {f"D={d} N={n} {m}": r for (d, n, m), r in speed["results"].items()},
        "crossover": {f"D={d}": crossover(speed, d, args) for d in args.dims},
        "profile": {f"D={d} N={n}": ms for (d, n), ms in stages.items()},
        "error": {src: {f"m={m} N={n}": deg for (m, n), deg in t.items()} for src, t in errors.items()},
    }
    (args.out / "attention_results.json").write_text(json.dumps(results, indent=1))
    print("\nwrote " + ", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in written))


if __name__ == "__main__":
    main()
