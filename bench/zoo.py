"""The attention zoo on CPU: time, peak memory and error against softmax, per method and length.

Part 1. For N = 512 … 16384: one forward of each attention core (B = 1, 12 heads of 32, fp32,
inference mode) on the Q/K/V of layer 2 of all-MiniLM-L6-v2 converted as the default model is
when no distilled model is bundled (run with softmax attention, i.e. MiniLM itself; a distilled
model's weights were trained for YOSO, MiniLM's for softmax, the reference) over real text: the
Python documentation sources of the Debian package python3.11-doc when installed, else this
project's README and docs (cycled to length). The model reads the text in 512-token windows (its trained length) and
the windows' Q/K/V rows are concatenated. Each (method, N) runs in a fresh process: a warm-up
forward, then the kernel's RSS high-water mark is reset and the timed forward's peak RSS
growth is the memory figure (inputs excluded). Error: the mean angle (degrees) between each
output row and softmax's (scale-free, so N-YOSO's unit rows compare too; Figure 8 of the YOSO
paper uses the same measure) and, except for YOSO, the relative Frobenius error. Linformer
runs twice: with its untrained (random JL) E and F, and with E = F = mean pooling over 256
equal segments (the paper's "general projection"), a fixed stand-in for trained projections. Reformer is
also compared with the function it approximates, full shared-QK attention (N ≤ 4096, dense).
YOSO-E is O(N²) with a large constant and is capped at ``--exact-max``.

Part 2 (``--reversible``). One training step (forward + backward) of the default-size encoder
(6 layers, 384 hidden, YOSO-32 attention) at several N, ordinary vs reversible layers: bytes
autograd saves for backward, peak RSS growth and time.

Prints markdown tables and writes docs/img/zoo.png (and docs/img/zoo_reversible.png) and the
raw rows to bench/out/zoo_results.json.

    PYTHONSAFEPATH=1 .venv/bin/python bench/zoo.py [--quick] [--lengths 512 1024 ...] [--reversible]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

# appended, not prepended: PYTHONSAFEPATH keeps bench/ off the path, and bench/onnx.py must not shadow onnx
sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLOT = ROOT / "docs" / "img" / "zoo.png"
PLOT_REV = ROOT / "docs" / "img" / "zoo_reversible.png"
RESULTS = ROOT / "bench" / "out" / "zoo_results.json"
PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
METHODS = ("softmax", "yoso-E", "yoso-32", "linformer", "linformer-pool", "reformer", "linear", "sparse-strided",
           "sparse-fixed", "nystrom")
LAYER, WINDOW = 2, 512


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per case; the fastest counts")
    p.add_argument("--exact-max", type=int, default=4096, help="largest N for O(N²) YOSO-E")
    p.add_argument("--own-max", type=int, default=4096, help="largest N for Reformer's dense shared-QK reference")
    p.add_argument("--reversible", action="store_true", help="also run part 2 (reversible layers)")
    p.add_argument("--rev-lengths", type=int, nargs="+", default=[512, 2048, 4096])
    p.add_argument("--quick", action="store_true", help="N = 512, 1024 and a short reversible run")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.rev_lengths = [512, 1024], [256, 512]
    return args




def real_text() -> tuple[str, str]:
    """(text, where it came from)."""
    files = sorted(PYDOCS.glob("library/*.rst.txt")) if PYDOCS.is_dir() else []
    if files:
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files[:60]), \
            "Python 3.11 library docs (python3.11-doc, reST sources)"
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file()), "this project's README and docs"


def model_qkv(n_max: int, scratch: Path) -> tuple[torch.Tensor, ...]:
    """(1, 12, n_max, 32) Q, K, V of layer LAYER of converted MiniLM over real text, 512-token windows."""
    from yoso_serve.model import EncoderModel, convert_bert_to_yoso, load_pretrained
    from yoso_serve.model.default import DEFAULT_SETTINGS, minilm_dir

    # The fallback default model (MiniLM converted), not a bundled distilled one: the reference is
    # softmax, and MiniLM's weights are the ones trained for softmax attention.
    converted = load_pretrained(convert_bert_to_yoso(minilm_dir(), scratch / "minilm", **DEFAULT_SETTINGS))
    model = EncoderModel(dataclasses.replace(converted.config, attention_type="softmax")).eval()
    model.load_state_dict(converted.state_dict())
    tok = converted.tokenizer
    text, _ = real_text()
    ids = tok.encode([text], add_special_tokens=False)[0]
    ids = (ids * (n_max // max(1, len(ids)) + 1))[:n_max]  # a short text is cycled (said in the docs)
    attention = model.encoder.encoder.layer[LAYER].attention.self
    grabbed: dict[str, list] = {"query": [], "key": [], "value": []}
    hooks = [getattr(attention, name).register_forward_hook(lambda _m, _i, out, name=name: grabbed[name].append(out))
             for name in grabbed]
    with torch.inference_mode():
        for start in tqdm(range(0, n_max, WINDOW - 2), desc="Q/K/V windows", leave=False):
            window = torch.tensor([tok.wrap(ids[start : start + WINDOW - 2])])
            model.last_hidden(window, torch.ones_like(window))
    for hook in hooks:
        hook.remove()
    rows = {name: torch.cat([x[0, 1:-1] for x in outs])[:n_max] for name, outs in grabbed.items()}  # no CLS/SEP
    return tuple(attention.split_heads(rows[name][None]).contiguous() for name in ("query", "key", "value"))


def build(method: str, n_max: int):
    """A callable (q, k, v) → (B, H, N, D) for ``method``, with the model's defaults for its type."""
    from yoso_serve.model import EncoderConfig
    from yoso_serve.model.attention import build_attention
    from yoso_serve.model.encoder import layer_seed

    if method == "linformer-pool":  # E = F = mean over k = 256 equal segments: the paper's pooling projection
        from yoso_serve.model.attention.linformer import linformer_attention

        pool = torch.zeros(256, n_max)
        for i in range(256):
            pool[i, i * n_max // 256 : (i + 1) * n_max // 256] = 256 / n_max
        return lambda q, k, v: linformer_attention(q, k, v, None, pool, pool)
    kinds = {"yoso-E": "yoso", "yoso-32": "yoso", "sparse-strided": "sparse", "sparse-fixed": "sparse"}
    kind = kinds.get(method, method)
    extra = {"sparse_pattern": "fixed"} if method == "sparse-fixed" else {}
    config = EncoderConfig(hidden_size=384, num_attention_heads=12, max_position_embeddings=max(n_max, 512),
                           attention_type=kind, hash_code_len=8, **extra)
    torch.manual_seed(0)  # Linformer's E, F
    core = build_attention(config, layer_seed(0, LAYER)).eval()
    if kind == "yoso":
        hashes = 0 if method == "yoso-E" else 32
        return lambda q, k, v: core(q, k, v, None, hashes=hashes)
    return lambda q, k, v: core(q, k, v, None)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def peak_extra_mib(fn, repeats: int = 1) -> tuple[float, float, object]:
    """(fastest seconds, peak RSS growth in MiB, result) of ``repeats`` calls after the high-water mark reset.

    The machine is shared, so the fastest call is the least noisy time; the peak covers all calls.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), max(0, _status_kib("VmHWM") - before) / 1024, out


def run_case(spec: str) -> None:
    """Child process: one (method, N) forward or one reversible training step; prints JSON."""
    case = json.loads(spec)
    if case["kind"] == "forward":
        q, k, v = (t[:, :, : case["n"]].contiguous() for t in torch.load(case["qkv"]))
        fn = build(case["method"], case["n"])
        with torch.inference_mode():
            fn(q, k, v)  # warm-up: code pages, allocator, thread pool
            seconds, extra, out = peak_extra_mib(lambda: fn(q, k, v), case["repeats"])
        torch.save(out.clone(), case["out"])
        print(json.dumps({"seconds": seconds, "extra_mib": extra}))
        return
    print(json.dumps(train_step(case["n"], case["reversible"])))


def train_step(n: int, reversible: bool) -> dict:
    """One forward + backward of a 6-layer MiniLM-size YOSO-32 encoder: activation bytes autograd
    saves (weights excluded), peak RSS growth and time."""
    from yoso_serve.model import EncoderConfig, EncoderModel

    config = EncoderConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                           intermediate_size=1536, max_position_embeddings=max(n, 512), pad_token_id=0,
                           use_expectation=False, num_hash=32, hash_code_len=8, reversible=reversible)
    torch.manual_seed(0)
    model = EncoderModel(config).train()
    ids = torch.randint(1000, 20000, (1, n))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved, but not activations

    def step() -> int:
        storages: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.last_hidden(ids, torch.ones_like(ids)).pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return sum(storages.values())

    step()  # warm-up
    seconds, extra, saved = peak_extra_mib(step)
    return {"seconds": seconds, "extra_mib": extra, "saved_mib": saved / 2**20}


def child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mean_angle(a: torch.Tensor, b: torch.Tensor) -> float:
    cos = F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1, 1)
    return math.degrees(torch.arccos(cos).mean().item())


def run_forward(args, scratch: Path) -> list[dict]:
    from yoso_serve.model.attention.reformer import shared_qk_attention_ref

    qkv_file = scratch / "qkv.pt"
    q, k, v = model_qkv(max(args.lengths), scratch)
    torch.save((q, k, v), qkv_file)
    cases = [(n, m) for n in args.lengths for m in args.methods if not (m == "yoso-E" and n > args.exact_max)]
    if "softmax" not in args.methods:
        raise SystemExit("softmax is the reference: keep it in --methods")
    rows, reference = [], {}
    for n, method in tqdm(cases, desc="zoo forwards"):
        out_file = scratch / f"{method}-{n}.pt"
        spec = dict(kind="forward", method=method, n=n, qkv=str(qkv_file), out=str(out_file), repeats=args.repeats)
        row = {"method": method, "n": n, **child(spec)}
        out = torch.load(out_file)
        out_file.unlink()
        if method == "softmax":
            reference[n] = out
        exact = reference[n]
        row["angle"] = mean_angle(out, exact)
        row["rel_error"] = None if method.startswith("yoso") else ((out - exact).norm() / exact.norm()).item()
        if method == "reformer" and n <= args.own_max:
            with torch.inference_mode():
                row["angle_own"] = mean_angle(out, shared_qk_attention_ref(q[:, :, :n], v[:, :, :n], None))
        rows.append(row)
    return rows


def forward_table(rows: list[dict]) -> str:
    lines = ["| method | N | forward (s) | peak extra (MiB) | angle to softmax (°) | rel. error |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        rel = "—" if r["rel_error"] is None else f"{r['rel_error']:.3f}"
        own = f" ({r['angle_own']:.1f} to own full)" if "angle_own" in r else ""
        lines.append(f"| {r['method']} | {r['n']} | {r['seconds']:.3f} | {r['extra_mib']:.0f} | "
                     f"{r['angle']:.1f}{own} | {rel} |")
    return "\n".join(lines)


def run_reversible(args) -> list[dict]:
    cases = [(n, rev) for n in args.rev_lengths for rev in (False, True)]
    return [{"n": n, "reversible": rev, **child(dict(kind="train", n=n, reversible=rev))}
            for n, rev in tqdm(cases, desc="reversible steps")]


def reversible_table(rows: list[dict]) -> str:
    lines = ["| layers | N | saved for backward (MiB) | peak extra (MiB) | step (s) |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {'reversible' if r['reversible'] else 'ordinary'} | {r['n']} | {r['saved_mib']:.1f} | "
                     f"{r['extra_mib']:.0f} | {r['seconds']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], rev_rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        sel = [r for r in rows if r["method"] == method]
        xs = [r["n"] for r in sel]
        style = dict(color=f"C{METHODS.index(method)}", label=method)  # one colour per method in every panel
        axes[0].plot(xs, [r["seconds"] for r in sel], "o-", **style)
        axes[1].plot(xs, [max(r["extra_mib"], 0.1) for r in sel], "o-", **style)
        axes[2].plot(xs, [r["angle"] for r in sel], "o-", **style)
    for ax, ylabel in zip(axes, ("one forward (s)", "peak RSS growth (MiB)", "mean angle to softmax (°)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length N (B=1, 12 heads × 32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Attention zoo, CPU: Q/K/V of MiniLM layer 2 on real text")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    if rev_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for rev in (False, True):
            sel = [r for r in rev_rows if r["reversible"] == rev]
            ax.plot([r["n"] for r in sel], [r["saved_mib"] for r in sel], "o-",
                    label="reversible" if rev else "ordinary")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("saved for backward (MiB)")
        ax.set_title("6-layer encoder, one training step")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(PLOT_REV, dpi=100)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.case:
        run_case(args.case)
        return
    _, source = real_text()
    print(f"machine: {machine()}\ntext: {source}\n")
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_forward(args, Path(scratch))
    print(forward_table(rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    rev_rows = run_reversible(args) if args.reversible else []
    if rev_rows:
        print("\n" + reversible_table(rev_rows))
    plot(rows, rev_rows)
    print(f"\nwrote {PLOT.relative_to(ROOT)}" + (f" and {PLOT_REV.relative_to(ROOT)}" if rev_rows else ""))


if __name__ == "__main__":
    main()
