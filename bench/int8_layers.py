"""Where int8 dense layers lose accuracy: the bundled model with one kind of ``Linear`` (or one layer's) in int8
at a time, the rest fp32, and the cosine of its embeddings to all-fp32 at the served default (``hashes=auto``:
exact below 288 tokens, 32 hashes above), on short texts and on long ones. For each kind, what its inputs
look like (how far one channel stands above the row, which sets the row's int8 step) and the error of the
GEMM's output with only the activations or only the weights quantized.

Texts: Debian's Python docs sources (python3.11-doc, as bench/peer.py), never man pages.

With ``--time``, instead: the whole forward at the served default with every dense layer in fp32, bf16
and int8, interleaved, the median of ``--repeats`` in each of ``--runs`` runs.

    PYTHONSAFEPATH=1 .venv/bin/python bench/int8_layers.py [--short 64] [--long 4] [--per-layer]
    PYTHONSAFEPATH=1 .venv/bin/python bench/int8_layers.py --time [--shapes 8x128 1x512 1x2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parent))
from _sections import alternated_medians, machine  # noqa: E402
from peer import corpus  # noqa: E402

from yoso_serve.kernels import int8_rows  # noqa: E402
from yoso_serve.model import default_model_dir, encoder, linear, load_pretrained  # noqa: E402
from yoso_serve.model.dense_int8 import quantize_weight, shift_int8, shift_of, smooth_int8  # noqa: E402
from yoso_serve.model.hashes import AUTO_EXACT_BELOW  # noqa: E402

KINDS = {"Q": "attention.self.query", "K": "attention.self.key", "V": "attention.self.value",
         "attention out": "attention.output.dense", "FFN in": "intermediate.dense", "FFN out": "output.dense"}


def texts(tok, n_short: int, n_long: int, short_tokens: int = 128, long_tokens: int = 2000):
    """(short ids (n_short, short_tokens), [long ids (1, long_tokens)]) cut in order from the docs' sources."""
    ids = tok.encode([corpus(8 * (n_short * short_tokens + n_long * long_tokens))], add_special_tokens=False)[0]
    cls, sep = tok.wrap([])
    rows, pos = [], 0
    for n in [short_tokens] * n_short + [long_tokens] * n_long:
        rows.append([cls, *ids[pos: pos + n - 2], sep])
        pos += n - 2
    return torch.tensor(rows[:n_short]), [torch.tensor([r]) for r in rows[n_short:]]


def embed(model, short, longs) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit embeddings of the short texts (one batch) and of each long text, at hashes=auto."""
    with torch.inference_mode():
        s = model.embed(short, torch.ones_like(short), hashes=0 if short.shape[1] < AUTO_EXACT_BELOW else None)
        lo = [model.embed(x, torch.ones_like(x)) for x in longs]
    return F.normalize(s, dim=-1), F.normalize(torch.cat(lo), dim=-1) if lo else None


def linears(model, kind: str) -> list[linear.Linear]:
    return [layer.get_submodule(KINDS[kind]) for layer in model.encoder.encoder.layer]


def cosines(model, short, longs, ref, quantized: list[linear.Linear]) -> tuple[float, float, float]:
    """(mean short, min short, mean long: nan without ``longs``) cosine to ``ref`` with only ``quantized`` in int8."""
    linear.set_dense_dtype(model, "fp32")
    for m in quantized:
        m.int8 = True
    s, lo = embed(model, short, longs)
    linear.set_dense_dtype(model, "fp32")
    cs = (s * ref[0]).sum(-1)
    return cs.mean().item(), cs.min().item(), (lo * ref[1]).sum(-1).mean().item() if longs else float("nan")


def captured_inputs(model, short) -> dict[linear.Linear, torch.Tensor]:
    """Every Linear's fp32 input on the short texts (rows, in): each module runs its int8 path with its
    ``_int8`` replaced by a recording fp32 product."""
    seen = {}
    for m in model.modules():
        if isinstance(m, linear.Linear):
            def record(x, start=None, gelu=False, norm=None, m=m):
                seen[m] = x.reshape(-1, x.shape[-1]).float().clone()
                out = F.linear(x.float(), m.weight, m.bias)
                out = out if start is None else out + start
                out = F.gelu(out) if gelu else out
                return out if norm is None else F.layer_norm(out, out.shape[-1:], norm.weight, norm.bias, norm.eps)
            m._int8, m.int8 = record, True
    # Q, K, V one by one, and FFN in and out each through its own _int8 (not the fused int8 feed-forward)
    fused = encoder.project, encoder.int8_feed_forward
    encoder.project = lambda group, x, **_: [lin(x) for lin in group]
    encoder.int8_feed_forward = lambda *_: None
    try:
        embed(model, short, [])
    finally:
        encoder.project, encoder.int8_feed_forward = fused
    for m in seen:
        del m._int8
        m.int8 = False
    return seen


def fake_rows(x: torch.Tensor, shift: float | None = None) -> torch.Tensor:
    q, scale = int8_rows(x, shift=shift)
    return q.float() * scale - (shift or 0.0)


@torch.inference_mode()
def input_stats(m: linear.Linear, x: torch.Tensor) -> dict[str, float]:
    """How the row's int8 step is set, and the GEMM output's relative error with each side quantized."""
    amax = x.abs().amax(dim=1)
    rms = x.pow(2).mean(dim=1).sqrt()
    channel = x.abs().amax(dim=0)  # (in,)
    argmax = x.abs().argmax(dim=1)
    top_share = torch.bincount(argmax, minlength=x.shape[1]).max().item() / len(x)
    shift = shift_of(m)  # FFN out on the u8 route: its input shifted, its weights at ±127 (model/dense_int8.py)
    q, s = quantize_weight(m.weight, levels=127 if shift is not None else None)
    w_fake = q.float() * s[:, None]
    ref = F.linear(x, m.weight)

    def err(out):
        return ((out - ref).norm() / ref.norm()).item()

    return {"row max / rms": (amax / rms).median().item(),
            "channel max / median": (channel.max() / channel.median()).item(),
            "rows whose max is the same channel": top_share,
            "int8 x only": err(F.linear(fake_rows(x, shift), m.weight)),
            "int8 W only": err(F.linear(x, w_fake)), "both": err(F.linear(fake_rows(x, shift), w_fake))}


def timing(model, shapes: list[str], runs: int, repeats: int) -> None:
    """Milliseconds of one forward per dense dtype (the median over runs of each run's median) and the ratios."""
    dtypes = [d for d in linear.DENSE_DTYPES if d != "bf16" or torch.ops.mkldnn._is_mkldnn_bf16_supported()]
    print(f"machine: {machine()}\n| batch × N | " + " | ".join(f"{d} ms" for d in dtypes)
          + " | fp32 / int8 time | bf16 / int8 time |\n|---|" + "---:|" * (len(dtypes) + 2))
    for shape in shapes:
        batch, n = map(int, shape.split("x"))
        ids = torch.randint(1000, 20000, (batch, n), generator=torch.Generator().manual_seed(n))
        hashes = 0 if n < AUTO_EXACT_BELOW else None  # hashes=auto

        def forward(dense):
            def call():
                linear.set_dense_dtype(model, dense)
                model.last_hidden(ids, torch.ones_like(ids), hashes=hashes)
            return call

        with torch.inference_mode():
            per_run = [alternated_medians({d: forward(d) for d in dtypes}, repeats) for _ in range(runs)]
        ms = {d: 1e3 * median(r[d] for r in per_run) for d in dtypes}
        ratio = {d: median(r[d] / r["int8"] for r in per_run) for d in dtypes}
        print(f"| {batch} × {n} | " + " | ".join(f"{ms[d]:.0f}" for d in dtypes)
              + f" | {ratio['fp32']:.2f}× | " + (f"{ratio['bf16']:.2f}× |" if "bf16" in ratio else "— |"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", type=int, default=64, help="short texts")
    p.add_argument("--short-tokens", type=int, default=16, help="tokens of a short text, [CLS] and [SEP] included")
    p.add_argument("--long", type=int, default=4, help="2000-token texts")
    p.add_argument("--per-layer", action="store_true",
                   help="also every layer's Linear of each kind alone (short texts only)")
    p.add_argument("--time", action="store_true", help="time the forward per dense dtype instead")
    p.add_argument("--shapes", nargs="+", default=["8x128", "1x512", "1x2048"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    model = load_pretrained(default_model_dir())
    if args.time:
        return timing(model, args.shapes, args.runs, args.repeats)
    short, longs = texts(model.tokenizer, args.short, args.long, args.short_tokens)
    ref = embed(model, short, longs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.short} texts of {args.short_tokens} "
          f"tokens (exact), {args.long} of 2000 (32 hashes); cosine to fp32: mean short (min) / mean long")
    every = [m for kind in KINDS for m in linears(model, kind)]
    shift_int8(model)  # FFN out's input shifted on the u8 route, as --dense-dtype int8 serves it
    inputs = captured_inputs(model, short)
    print("| int8 | short | min | long | row max / rms | channel max / median | rows whose max is the same channel "
          "| rel. err. int8 x only | W only | both |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("| all, not smoothed | %.4f | %.4f | %.4f | | | | | | |" % cosines(model, short, longs, ref, every))
    smooth_int8(model)  # what --dense-dtype int8 serves; the input columns below are the inputs as they come
    print("| all | %.4f | %.4f | %.4f | | | | | | |" % cosines(model, short, longs, ref, every))
    for kind in KINDS:
        stats = [input_stats(m, inputs[m]) for m in linears(model, kind)]
        mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
        print(f"| {kind} | %.4f | %.4f | %.4f | " % cosines(model, short, longs, ref, linears(model, kind))
              + " | ".join(f"{v:.3g}" for v in mean.values()) + " |")
    if args.per_layer:
        for kind in KINDS:
            for i, m in enumerate(linears(model, kind)):
                st = input_stats(m, inputs[m])
                print(f"| layer {i} {kind} | %.4f | %.4f | %.4f | " % cosines(model, short, [], ref, [m])
                      + " | ".join(f"{v:.3g}" for v in st.values()) + " |")


if __name__ == "__main__":
    main()
