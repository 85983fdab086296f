"""Where one forward's time goes: the bundled model on random token ids at the served default (``hashes=auto``),
each part timed around its own calls, in the dense dtypes asked for. The parts: the GEMMs (``kernels.int8_sums`` in
int8, oneDNN's linear in bf16 and fp32), the attention core (YOSO with its norm and convolution), the C++ passes
around the GEMMs (quantizing inputs per row; scaling int32 sums back, with the blocks' output LayerNorms in int8;
FFN in's GELU and quantizing for FFN out in one pass; adding bf16 outputs to the residual, with AMX K-block parts
too), LayerNorm (in int8 only the embeddings'), and the rest (Python, views, embeddings, pooling).
The medians of ``--repeats`` forwards, after two to warm up, with the server's heap settings (service/heap.py);
prints a markdown table and writes a stacked-bar plot (docs/img/forward_parts.png).

    PYTHONSAFEPATH=1 .venv/bin/python bench/forward_parts.py [--dense int8 bf16] [--shapes 17x128 1x2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from statistics import median

import torch
from tqdm import tqdm

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine, parse_shapes, report  # noqa: E402

from yoso_serve.kernels import dense_int8  # noqa: E402
from yoso_serve.kernels._build import cpu_extension  # noqa: E402
from yoso_serve.model import default_model_dir, linear, load_pretrained  # noqa: E402
from yoso_serve.model.attention.yoso import YosoAttentionCore  # noqa: E402
from yoso_serve.model.hashes import AUTO_EXACT_BELOW  # noqa: E402
from yoso_serve.service.heap import retain_freed_memory  # noqa: E402

DOC_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
# part label → the C++ passes it names (the extension's functions)
PASSES = {"inputs quantized per row": ("quantize_rows",),
          "sums scaled back (bias, residual, int8: LayerNorm)": ("dequantize_rows",),
          "FFN in scaled back, GELU, quantized for FFN out": ("requantize_rows",),
          "bf16 outputs plus the residual (with AMX: K-block parts)": ("sum_parts",)}


class Clock:
    """Seconds and calls per part, for the forward being timed."""

    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed


@contextmanager
def patched(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def timing(clock: Clock) -> ExitStack:
    """Every part's calls routed through ``clock`` until the stack closes."""
    stack = ExitStack()
    stack.enter_context(patched(dense_int8, "int8_sums", clock.wrap("GEMMs", dense_int8.int8_sums)))
    onednn = linear.ONEDNN_LINEAR
    if onednn is not None:
        gemm = clock.wrap("GEMMs", onednn)
        gemm.binary = clock.wrap("GEMMs", onednn.binary)
        stack.enter_context(patched(linear, "ONEDNN_LINEAR", gemm))
    ext = cpu_extension()
    for label, names in PASSES.items():
        for name in names:
            if ext is not None and hasattr(ext, name):
                stack.enter_context(patched(ext, name, clock.wrap(label, getattr(ext, name))))
    stack.enter_context(patched(YosoAttentionCore, "forward", clock.wrap("attention", YosoAttentionCore.forward)))
    stack.enter_context(patched(torch.nn.LayerNorm, "forward", clock.wrap("LayerNorm", torch.nn.LayerNorm.forward)))
    return stack


def parts(model, batch: int, length: int, repeats: int, seed: int = 0) -> dict:
    """{"forward": median s, "parts": {label: (median s, calls per forward)}, "rest": the forward less the parts}
    of ``repeats`` forwards."""
    ids = torch.randint(1000, 20000, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    hashes = 0 if length < AUTO_EXACT_BELOW else None
    per_part, totals, calls = defaultdict(list), [], {}
    with torch.inference_mode():
        for _ in range(2):
            model.embed(ids, mask, hashes=hashes)
        for _ in range(repeats):
            clock = Clock()
            with timing(clock):
                start = time.perf_counter()
                model.embed(ids, mask, hashes=hashes)
                totals.append(time.perf_counter() - start)
            for label, s in clock.seconds.items():
                per_part[label].append(s)
            calls = dict(clock.calls)
    timed = {label: (median(v + [0.0] * (repeats - len(v))), calls[label]) for label, v in per_part.items()}
    forward = median(totals)
    return {"forward": forward, "parts": timed, "rest": forward - sum(s for s, _ in timed.values())}


def table(results: dict) -> str:
    """One markdown table: a row per part, a column (ms) per (dtype, shape)."""
    keys = list(results)
    labels = ["GEMMs", "attention", *PASSES, "LayerNorm"]
    labels = [lab for lab in labels if any(lab in results[k]["parts"] for k in keys)]
    head = "| part | " + " | ".join(f"{d} {b} × {n} (ms, calls)" for d, b, n in keys) + " |"
    lines = [head, "|---|" + "---:|" * len(keys)]
    for lab in labels:
        cells = [f"{results[k]['parts'][lab][0] * 1e3:.1f} ({results[k]['parts'][lab][1]})"
                 if lab in results[k]["parts"] else "—" for k in keys]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    lines.append("| the rest (Python, views, embeddings, pooling) | "
                 + " | ".join(f"{results[k]['rest'] * 1e3:.1f}" for k in keys) + " |")
    lines.append("| **forward** | " + " | ".join(f"**{results[k]['forward'] * 1e3:.1f}**" for k in keys) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    labels = sorted({lab for k in keys for lab in results[k]["parts"]}, key=lambda lab: -results[keys[0]]["parts"].get(
        lab, (0, 0))[0])
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(keys)))
    names = [f"{d} {b}×{n}" for d, b, n in keys]
    left = [0.0] * len(keys)
    for lab in [*labels, "rest"]:
        widths = [1e3 * (results[k]["rest"] if lab == "rest" else results[k]["parts"].get(lab, (0, 0))[0])
                  for k in keys]
        ax.barh(names, widths, left=left, label=lab)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_xlabel("ms per forward")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Where one forward's time goes (bundled model, hashes=auto)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", nargs="+", default=["int8", "bf16"], choices=linear.DENSE_DTYPES)
    parser.add_argument("--shapes", nargs="+", default=["17x128", "1x2048"], help="batch x tokens")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--plot", default=str(DOC_IMG / "forward_parts.png"), help="where the plot goes ('' for none)")
    args = parser.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    retain_freed_memory()  # the server's heap settings: freed tensors reused, not handed back and faulted in again
    model = load_pretrained(default_model_dir()).eval()
    results = {}
    for dense in tqdm(args.dense, desc="dense dtypes", unit="dtype"):
        linear.set_dense_dtype(model, dense)
        for b, n in shapes:
            results[(dense, b, n)] = parts(model, b, n, args.repeats)
    print(f"machine: {machine()}; medians of {args.repeats} forwards; random token ids, hashes=auto")
    report(table(results), lambda path: plot(results, path), args.plot)
    return results


if __name__ == "__main__":
    main()
