"""``yoso-train {finetune, distill, longdoc, mlm, eval, export-onnx}`` — one entry point, one module per command.

Multi-GPU / multi-node: start the same command under torchrun, e.g.
``torchrun --nproc_per_node 8 -m yoso_serve.model.train.cli distill ...`` (see docs/training.md).
"""

from __future__ import annotations

import argparse
import sys

from . import distill, evaluate, export_onnx, finetune, longdoc, mlm
from .runtime import shutdown_distributed

COMMANDS = {
    "finetune": (finetune, "a classification head on a YOSO checkpoint (single- or multi-label)"),
    "distill": (distill, "a BERT-family teacher into a YOSO student initialised by conversion"),
    "longdoc": (longdoc, "contrastive long-document training: spans → whole documents, short pairs, distillation"),
    "mlm": (mlm, "masked-LM pretraining or continued pretraining from a checkpoint"),
    "eval": (evaluate, "agreement with a teacher, classification metrics, speed"),
    "export-onnx": (export_onnx, "a checkpoint to ONNX: model.onnx + config.json + tokenizer (docs/onnx.md)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yoso-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # configuration and data errors: one line, no traceback
        print(f"yoso-train {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing, unreadable or unwritable path: one line too
        print(f"yoso-train {args.command}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
