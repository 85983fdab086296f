"""The student's life cycle shared by the training commands: hash-count lists of the command line, the hash
projections the student trains and is saved with, and fitting with an export of ``model/`` at every checkpoint."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from yoso_serve.model import EncoderModel, save_pretrained
from yoso_serve.model.encoder import YosoSelfAttention, layer_seed
from yoso_serve.model.hashes import MAX_HASHES

from .common import Session
from .trainer import Trainer


def parse_hashes(text: str, option: str = "--train-hashes") -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated ints, got {text!r}") from None
    if not values or any(v < 0 or v > MAX_HASHES for v in values):
        raise ValueError(f"{option} must be ints in [0, {MAX_HASHES}], got {text!r}")
    return values


def set_hash_seeds(module: nn.Module, base: int) -> None:
    """Point every YOSO attention layer at the projections of hash seed ``base``."""
    layers = [m for m in module.modules() if isinstance(m, YosoSelfAttention)]
    for i, layer in enumerate(layers):
        layer.seed = layer_seed(base, i)


def export_student(student: EncoderModel, session: Session, *, fp16: bool) -> None:
    """Write ``student`` to the run's ``model/`` with the served hash projections (rank 0 only)."""
    if session.dist.is_main:
        set_hash_seeds(student, student.config.hash_seed)
        save_pretrained(student, session.run.path / "model", dtype=torch.float16 if fp16 else None)


def fit_student(trainer: Trainer, student: EncoderModel, session: Session, args: argparse.Namespace,
                command: str, summary) -> int:
    """Resume if asked, say ``summary()``, train, exporting the student to ``model/`` at every checkpoint."""
    trainer.on_save = lambda: export_student(student, session, fp16=args.save_fp16)
    if args.resume:
        trainer.resume()
    session.say(f"{command}: {summary()}")
    stop = trainer.fit()
    session.say(f"{command}: stopped ({stop}) at step {trainer.step}; model in {session.run.path / 'model'}")
    return 0
