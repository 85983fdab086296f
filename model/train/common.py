"""Arguments and start-up shared by every ``yoso-train`` command."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from yoso_serve.model.argtypes import bounded

from .data import RowReport, iter_examples, tokenize
from .runtime import Distributed, RunDir, enable_gradient_checkpointing, init_distributed, seed_everything
from .trainer import TrainOptions


MAX_SEED = 2**32 - 1  # numpy's seed range (seed_everything)


def add_common_arguments(p: argparse.ArgumentParser, *, lr: float, batch_size: int, epochs: int,
                         dropout: float | None = None) -> None:
    g = p.add_argument_group("model in training")
    g.add_argument("--exact-backward", default="true", choices=("true", "bound"),
                   help="gradient of exact-mode (hashes=0) YOSO attention: the derivative of its forward "
                        "(true), or the paper's lower bound that LSH training uses (bound, as transformers)")
    g.add_argument("--dropout", type=bounded(float, 0, 1, hi_open=True), default=dropout,
                   help="dropout probability in training (default: the checkpoint's config"
                        + ("" if dropout is None else f"; this command: {dropout}") + ")")
    g = p.add_argument_group("run")
    g.add_argument("--out", required=True, type=Path, help="run directory (config.json, metrics.jsonl, checkpoints)")
    g.add_argument("--resume", action="store_true", help="continue the run in --out from checkpoints/last.pt")
    g.add_argument("--seed", type=bounded(int, 0, MAX_SEED), default=0)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (torchrun: one GPU per process)")
    g.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="autocast dtype on CUDA (auto = bf16 where supported); CPU always trains in fp32")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=epochs)
    g.add_argument("--max-steps", type=bounded(int, 0), default=0, help="optimizer steps; 0 = --epochs decide")
    g.add_argument("--batch-size", type=int, default=batch_size, help="per process, per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=bounded(float, 0, lo_open=True), default=lr)
    g.add_argument("--weight-decay", type=bounded(float, 0), default=0.01)
    g.add_argument("--warmup", type=float, default=0.06, help="fraction of the steps with a linear warm-up")
    g.add_argument("--schedule", default="linear", choices=("linear", "constant"),
                   help="learning rate after warm-up: linear decay to 0, or constant")
    g.add_argument("--max-grad-norm", type=bounded(float, 0, lo_open=True), default=1.0)
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each layer in backward (long sequences: memory for time)")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--save-every", type=int, default=200, help="optimizer steps between checkpoints")
    g.add_argument("--max-minutes", type=bounded(float, 0), default=0.0,
                   help="stop cleanly (checkpoint saved) after this many minutes; 0 = no limit")


def train_options(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                        grad_accum=args.grad_accum, lr=args.lr, weight_decay=args.weight_decay,
                        warmup=args.warmup, schedule=args.schedule, max_grad_norm=args.max_grad_norm, precision=args.precision,
                        seed=args.seed, log_every=args.log_every, save_every=args.save_every,
                        max_minutes=args.max_minutes)


@dataclass
class Session:
    """What a command works with: its place in the job, its device and its run directory."""

    dist: Distributed
    device: torch.device
    run: RunDir

    def say(self, message: str) -> None:
        if self.dist.is_main:
            print(message, file=sys.stderr, flush=True)


def start(args: argparse.Namespace, command: str) -> Session:
    """Join torchrun (if any), seed, and open the run directory with the command's config."""
    dist_, device = init_distributed(args.device)
    seed_everything(args.seed)
    config = {"command": command, **{k: v for k, v in vars(args).items() if k != "func"},
              "world_size": dist_.world_size, "device": str(device), "torch": torch.__version__,
              "python": platform.python_version(), "argv": sys.argv}
    return Session(dist_, device, RunDir(args.out, config=config, resume=getattr(args, "resume", False), dist_=dist_))


def read_texts(session: Session, paths: list[Path], tokenizer, *, max_length: int, name: str,
               need_labels: bool = False):
    """Stream ``paths`` → (examples, token ids); skipped rows go to the run's data report."""
    report = RowReport()
    examples = list(iter_examples(paths, report, need_labels=need_labels))
    ids = tokenize((ex.text for ex in examples), tokenizer, max_length=max_length)
    session.say(f"{name}: {report.summary()}")
    reports = json.loads((session.run.path / "data_report.json").read_text()) \
        if (session.run.path / "data_report.json").is_file() else {}
    reports[name] = {"files": [str(p) for p in paths], **report.to_dict()}
    session.run.write_json("data_report.json", reports)
    if not examples:
        raise ValueError(f"{name}: no usable rows in {[str(p) for p in paths]} ({report.summary()})")
    return examples, ids


def prepare_model(args: argparse.Namespace, module: torch.nn.Module, num_layers: int) -> None:
    """Training-only settings on a YOSO encoder: gradient checkpointing, the exact-mode
    backward and the dropout probability (none of them is saved with the checkpoint)."""
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(module, num_layers)
    for m in module.modules():
        if hasattr(m, "exact_backward"):
            m.exact_backward = args.exact_backward
        if args.dropout is not None and isinstance(m, torch.nn.Dropout):
            m.p = args.dropout
