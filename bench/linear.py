"""The encoder's dense layers: aten's ``F.linear`` (the BLAS call torch makes, MKL in the CPU wheel)
against the encoder's ``Linear`` (oneDNN's fp32 GEMM, with GELU or the residual add in its epilogue),
and the same ``Linear`` with ``--dense-dtype bf16`` (bf16 operands, fp32 sums), on the MiniLM shapes of one
layer, in GFLOP/s.

Per row count (batch × tokens) each GEMM shape of a layer runs both ways, interleaved inside every
repeat, each after a warm-up; the median of ``--repeats`` is shown. "epilogue" rows compare
``gelu(F.linear(x))`` with ``Linear.activated`` and ``F.linear(x) + r`` with ``Linear.plus``: what the
encoder runs. Prints a markdown table; ``--write-docs`` replaces the "## Dense layers" section of
docs/benchmarks.md.

    PYTHONSAFEPATH=1 .venv/bin/python bench/linear.py [--rows 128 2048 4096] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import alternated_medians, machine, write_section  # noqa: E402

SECTION = "## Dense layers"
# (what, in features, out features, epilogue): one MiniLM-L6 layer (hidden 384, intermediate 1536)
GEMMS = [("Q, K, V, attention output", 384, 384, None), ("FFN in, + GELU", 384, 1536, "gelu"),
         ("FFN out, + residual", 1536, 384, "add")]


def measure(rows: int, repeats: int) -> list[dict]:
    import copy

    from yoso_serve.model.linear import ONEDNN_LINEAR, Linear, set_dense_dtype

    if ONEDNN_LINEAR is None:
        raise SystemExit("this torch has no oneDNN linear: nothing to compare")
    # oneDNN's bf16 GEMM needs AVX-512 (the server refuses --dense-dtype bf16 without it): no bf16 column then
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    out = []
    torch.manual_seed(0)
    for what, d_in, d_out, epilogue in GEMMS:
        lin = Linear(d_in, d_out).eval()
        half = copy.deepcopy(lin)
        set_dense_dtype(half, "bf16")  # --dense-dtype bf16: bf16 operands, fp32 sums, fp32 out
        x, r = torch.randn(rows, d_in), torch.randn(rows, d_out)
        if epilogue == "gelu":
            runs = {"aten": lambda: F.gelu(F.linear(x, lin.weight, lin.bias)),
                    "oneDNN": lambda: lin.activated(x, "gelu", F.gelu),
                    "bf16": lambda: half.activated(x, "gelu", F.gelu)}
        elif epilogue == "add":
            runs = {"aten": lambda: F.linear(x, lin.weight, lin.bias) + r, "oneDNN": lambda: lin.plus(x, r),
                    "bf16": lambda: half.plus(x, r)}
        else:
            runs = {"aten": lambda: F.linear(x, lin.weight, lin.bias), "oneDNN": lambda: lin(x),
                    "bf16": lambda: half(x)}
        if not bf16:
            del runs["bf16"]
        with torch.inference_mode():
            times = alternated_medians(runs, repeats)
        flops = 2 * rows * d_in * d_out
        out.append({"rows": rows, "what": what, **times, "flops": flops})
    return out


def dense_pass(model, batch: int, tokens: int, dense: str):
    """A call running every dense layer of ``model`` once, as its forward runs them at ``--dense-dtype``
    ``dense`` on a (batch, tokens) input: Q, K, V, the attention output with its residual add, the FFN's two
    GEMMs with GELU and the residual add in their epilogues, chunked along the sequence as the layer chunks
    them. No attention, LayerNorm, embeddings or pooling: the floor of the served forward (bench/peer.py
    --floor)."""
    from yoso_serve.model.dense_int8 import project
    from yoso_serve.model.encoder import YosoLayer
    from yoso_serve.model.linear import set_dense_dtype

    set_dense_dtype(model, dense)
    layers = [m for m in model.modules() if isinstance(m, YosoLayer)]
    torch.manual_seed(0)
    x = torch.randn(batch, tokens, layers[0].config.hidden_size)

    def run() -> None:
        for layer in layers:
            attn = layer.attention.self
            project([attn.query, attn.key, attn.value], x)  # in int8 one product, as the forward runs them
            layer.attention.output.dense.plus(x, x)
            layer.chunked(lambda part: layer.output.dense.plus(layer.intermediate(part), part), x)

    return run


def dense_seconds(model, shapes: dict, dense: str, repeats: int) -> dict:
    """Median seconds of one dense pass per (batch, tokens) in ``shapes`` (name → shape), interleaved."""
    calls = {name: dense_pass(model, *shape, dense) for name, shape in shapes.items()}
    with torch.inference_mode():
        return alternated_medians(calls, repeats)


def table(results: list[dict]) -> str:
    lines = ["| rows | GEMM (in → out) | aten ms | GFLOP/s | oneDNN ms | GFLOP/s | aten / oneDNN time "
             "| oneDNN bf16 ms | GFLOP/s | fp32 / bf16 time |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        g = GEMMS[[w for w, *_ in GEMMS].index(r["what"])]
        lines.append(f"| {r['rows']} | {r['what']} ({g[1]} → {g[2]}) | {r['aten'] * 1e3:.2f} | "
                     f"{r['flops'] / r['aten'] / 1e9:.0f} | {r['oneDNN'] * 1e3:.2f} | "
                     f"{r['flops'] / r['oneDNN'] / 1e9:.0f} | {r['aten'] / r['oneDNN']:.2f}× | " +
                     (f"{r['bf16'] * 1e3:.2f} | {r['flops'] / r['bf16'] / 1e9:.0f} | {r['oneDNN'] / r['bf16']:.2f}× |"
                      if "bf16" in r else "— | — | no bf16 GEMM on this CPU |"))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 2048, 4096],
                   help="batch × tokens (2048: 16 texts of 128 tokens)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [r for rows in args.rows for r in measure(rows, args.repeats)]
    md = table(results)
    command = "PYTHONSAFEPATH=1 .venv/bin/python bench/linear.py " + " ".join(sys.argv[1:])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {machine()}; load average at the end {load}\ncommand: {command}\n\n{md}")
    if args.write_docs:
        write_section(SECTION, f"The dense layers of one MiniLM-L6 layer, aten's `F.linear` (MKL) against the "
                      f"encoder's `Linear` (oneDNN, epilogue fused) in fp32 and in bf16 (`--dense-dtype bf16`), "
                      f"medians of {args.repeats} interleaved runs. "
                      f"Command: `{command.strip()}`. Machine: {machine()}; load average at the end {load}."
                      f"\n\n{md}")


if __name__ == "__main__":
    main()
