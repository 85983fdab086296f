"""``yoso-train export-onnx``: a checkpoint directory to ONNX (model.onnx + config.json + tokenizer).

The exporter itself is :func:`yoso_serve.model.export.export_onnx`; this is its command line, beside the
other training commands. ``python -m yoso_serve.model.train.export_onnx`` runs the same command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from yoso_serve.model.argtypes import bounded

from ..export import DEFAULT_OPSET, MAX_OPSET, ONNX_FILE, export_onnx


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``export-onnx`` flags (the ``yoso-train`` subcommand protocol: add_arguments + run)."""
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory (config.json + weights)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (model.onnx, config.json, tokenizer)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--hashes", type=int, default=None,
                      help="hash count fixed in the graph (default: the model's default_hashes)")
    mode.add_argument("--exact", action="store_true", help="export exact YOSO-E (same as --hashes 0)")
    parser.add_argument("--opset", type=bounded(int, 16, MAX_OPSET), default=DEFAULT_OPSET,
                        help=f"ONNX opset (16 to {MAX_OPSET}, default {DEFAULT_OPSET})")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``export-onnx`` command; a bad checkpoint or flag exits 2 with its message."""
    try:
        out = export_onnx(args.model, args.out, hashes=0 if args.exact else args.hashes, opset=args.opset)
    except ValueError as exc:  # CheckpointError included
        print(f"export-onnx: error: {exc}", file=sys.stderr)
        return 2
    onnx = json.loads((out / "config.json").read_text(encoding="utf-8"))["onnx"]
    print(f"wrote {out / ONNX_FILE} (hashes {onnx['hashes']}, opset {onnx['opset']})")
    return 0


def main_export_onnx(argv: list[str] | None = None) -> int:
    """``yoso-train export-onnx --model DIR --out DIR [--hashes m | --exact] [--opset N]``."""
    parser = argparse.ArgumentParser(prog="yoso-train export-onnx",
                                     description="Export a YOSO checkpoint directory to ONNX.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main_export_onnx())
