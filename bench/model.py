"""Whole-model forward: the bundled YOSO weights with YOSO-32 and exact YOSO-E against the same weights
with softmax attention, tokens/s side by side.

The bundled model (model/bundled/yoso-minilm-l6-4096: 6 layers, 384 hidden, 12 heads, τ = 8, a YOSO-C
convolution) is loaded once; the softmax model is the same config with ``attention_type="softmax"``
and the same weights (its convolution dropped: softmax has none). Per shape (batch × N, random
token ids, all real tokens) the three modes are interleaved inside every repeat after one warm-up
each, and the median of ``--repeats`` is reported, so the ratios compare runs taken seconds apart.
Prints a markdown table, writes docs/img/model_forward.png, and with ``--write-docs`` replaces the
"## Model forward" section of docs/benchmarks.md.

    PYTHONSAFEPATH=1 .venv/bin/python bench/model.py [--shapes 8x128 1x512 1x4096] [--write-docs]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

# appended, not prepended: bench/onnx.py must not shadow the onnx package (PYTHONSAFEPATH keeps bench/ off the path)
sys.path.append(str(Path(__file__).resolve().parent))
from _sections import machine, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "model" / "bundled" / "yoso-minilm-l6-4096"
PLOT = ROOT / "docs" / "img" / "model_forward.png"
SECTION = "## Model forward"
WINDOW = 240  # what a user of a 512-token model does with a long text: windows of 238 tokens + [CLS], [SEP]
WINDOWS = f"softmax, {WINDOW}-token windows"
# mode -> (hash count, int8 hashing, dense layers' GEMMs); None: the model's own setting (the bundled model
# hashes in int8). WINDOWS: the softmax model over the same tokens cut into windows, all windows of a shape in
# one batch. The bf16 modes run the dense layers' GEMMs in bf16 (the server's --dense-dtype bf16).
MODES = {"softmax": (None, None, "fp32"), WINDOWS: (None, None, "fp32"), "YOSO-32": (32, None, "fp32"),
         "YOSO-32, fp32 hashing": (32, False, "fp32"), "YOSO-E (exact)": (0, None, "fp32"),
         "YOSO-32, bf16 dense": (32, None, "bf16"), f"{WINDOWS}, bf16 dense": (None, None, "bf16")}


def set_int8_hashing(model, on: bool) -> None:
    """Hash q and k in int8 (kernels/hashing.py) or fp32 in every YOSO layer of ``model``."""
    for layer in model.encoder.encoder.layer:
        layer.attention.self.core.int8_hash = on


def models(path: Path):
    """(YOSO model, softmax model with the same weights)."""
    from yoso_serve.model import load_pretrained
    from yoso_serve.model.encoder_model import EncoderModel

    yoso = load_pretrained(path)
    config = dataclasses.replace(yoso.config, attention_type="softmax", conv_window=None)
    softmax = EncoderModel(config).eval()
    dropped = softmax.load_state_dict(yoso.state_dict(), strict=False)
    if dropped.missing_keys or any(".conv." not in key for key in dropped.unexpected_keys):
        raise RuntimeError(f"softmax twin does not share the weights: {dropped}")
    return yoso, softmax


def windows(ids: torch.Tensor, tok, size: int = WINDOW) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of every row of ``ids`` cut into windows as the retrieval eval's windowed teacher cuts a
    text, padded (mask 0) to the longest window."""
    from yoso_serve.model.train.longdoc import pad
    from yoso_serve.model.train.retrieval import cut_windows

    return pad(cut_windows(ids.tolist(), tok, size)[1], tok.pad_id)


def measure(yoso, softmax, batch: int, n: int, repeats: int, clock=time.perf_counter) -> dict[str, float]:
    """mode -> median seconds of one forward of (batch, n) tokens, by ``clock``."""
    ids = torch.randint(1000, 20000, (batch, n), generator=torch.Generator().manual_seed(n))
    mask = torch.ones_like(ids)
    windowed = windows(ids, yoso.tokenizer)
    served = bool(yoso.config.hash_int8)
    from yoso_serve.model.linear import set_dense_dtype

    runs = {mode: (softmax if hashes is None else yoso, hashes, served if int8 is None else int8, dense)
            for mode, (hashes, int8, dense) in MODES.items()}
    times = {mode: [] for mode in runs}
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up
            for mode, (model, hashes, int8, dense) in runs.items():
                if hashes is not None:
                    set_int8_hashing(model, int8)
                set_dense_dtype(model, dense)
                start = clock()
                model.last_hidden(*(windowed if mode.startswith(WINDOWS) else (ids, mask)), hashes=hashes)
                times[mode].append(clock() - start)
        set_int8_hashing(yoso, served)
        set_dense_dtype(yoso, "fp32")
        set_dense_dtype(softmax, "fp32")
    times = {mode: t[1:] for mode, t in times.items()}
    return {mode: median(t) for mode, t in times.items()}




def table(rows: list[dict]) -> str:
    lines = ["| batch × N | mode | forward (ms) | tokens/s | × softmax tokens/s | × windows tokens/s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        for mode, seconds in r["seconds"].items():
            tokens = r["batch"] * r["n"] / seconds  # the text's tokens, whatever a mode adds (windows: specials)
            lines.append(f"| {r['batch']} × {r['n']} | {mode} | {1e3 * seconds:.0f} | {tokens:.0f} "
                         f"| {r['seconds']['softmax'] / seconds:.2f}× | {r['seconds'][WINDOWS] / seconds:.2f}× |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['batch']}×{r['n']}" for r in rows]
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        tokens = [r["batch"] * r["n"] / r["seconds"][mode] for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], tokens, width, label=mode)
    ax.set_xticks([x + width * (len(MODES) - 1) / 2 for x in range(len(rows))], labels)
    ax.set(xlabel="batch × sequence length", ylabel="tokens/s (median)",
           title="bundled YOSO MiniLM-L6 vs the same weights with softmax, CPU")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8x128", "1x512", "8x512", "1x4096"],
                        help="batch x N per point (default 8x128 1x512 8x512 1x4096)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved forwards per mode; the median counts")
    parser.add_argument("--model", type=Path, default=BUNDLED)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with --threads 1: the work, whatever else loads the machine)")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"where the plot goes (default {PLOT})")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from yoso_serve.kernels import backend_info

    yoso, softmax = models(args.model)
    rows = []
    for shape in args.shapes:
        batch, n = (int(x) for x in shape.split("x"))
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        rows.append({"batch": batch, "n": n, "seconds": measure(yoso, softmax, batch, n, args.repeats, clock)})
        print(rows[-1], file=sys.stderr, flush=True)
    md = table(rows)
    command = "PYTHONSAFEPATH=1 .venv/bin/python bench/model.py " + " ".join(sys.argv[1:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {machine()}; 1/5/15-min load average at the end {load}\n"
          f"backend: {backend_info()['backend']}\ncommand: {command}\n\n{md}")
    plot(rows, args.plot)
    if args.write_docs:
        write_section(SECTION,
            f"One forward of the bundled model ({args.model.name}: 6 layers, 384 hidden, 12 heads of 32, τ = 8, "
            f"YOSO-C width {yoso.config.conv_window}, {'int8' if yoso.config.hash_int8 else 'fp32'} hashing as "
            f"served) with 32 hashes (and, for comparison, 32 hashes in fp32, and 32 hashes with the dense layers' "
            f"GEMMs in bf16) and exact YOSO-E, against the same weights "
            f"with softmax attention (`attention_type=\"softmax\"`, convolution dropped), random token ids, no "
            f"padding. The modes run interleaved inside each of {args.repeats} repeats in one process; "
            f"the median is shown. Command: `{command.strip()}`. Machine: {machine()}; 1/5/15-min load "
            f"average at the end {load}.\n\n{md}\n\n"
            f"![model forward](img/{PLOT.name})")


if __name__ == "__main__":
    main()
