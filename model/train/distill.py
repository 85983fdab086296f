"""``yoso-train distill``: a BERT-family teacher → a YOSO student initialised by conversion.

The student trains with LSH attention at the hash count(s) it will be served with, each
step drawing fresh hash projections, so that it learns to be right under sampling noise
rather than under one particular draw. Losses: cosine and MSE between the pooled
embeddings, MSE between the last hidden states of real tokens. Texts longer than the
teacher's positions get their targets from the teacher run in overlapping windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.model import EncoderModel, convert_bert_to_yoso, load_pretrained
from yoso_serve.model.encoder import YosoSelfAttention, yoso_conv
from yoso_serve.model.argtypes import bounded
from yoso_serve.model.hashes import MAX_HASHES

from .common import Session, add_common_arguments, prepare_model, read_texts, start, train_options
from .data import TokenizedDataset, pad_batch
from .student import fit_student, parse_hashes, set_hash_seeds
from .teacher import BertTeacher, pool
from .trainer import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", required=True, type=Path, help="BERT-family or sentence-transformers directory")
    p.add_argument("--data", required=True, type=Path, nargs="+", help="text / JSONL / CSV files (text only is used)")
    p.add_argument("--student", type=Path, help="start from this YOSO checkpoint instead of converting the teacher")
    p.add_argument("--max-positions", type=int, default=4096, help="student positions when converting")
    p.add_argument("--max-length", type=int, default=512, help="training texts are cut to this many tokens")
    p.add_argument("--train-hashes", default="32",
                   help="hash count(s) to train with, comma-separated; one is drawn per step (0 = exact)")
    p.add_argument("--serve-hashes", type=bounded(int, 0, MAX_HASHES), default=32,
                   help="num_hash written into the student's config")
    p.add_argument("--fixed-hash-seed", action="store_true",
                   help="train with the served hash projections only (default: a fresh draw each step)")
    p.add_argument("--window", type=bounded(int, 0), default=0, help="teacher window in tokens (0 = its max positions)")
    p.add_argument("--stride", type=bounded(int, 0), default=0, help="teacher window stride (0 = half a window)")
    p.add_argument("--w-cos", type=bounded(float, 0), default=1.0, help="weight of 1 - cos(pooled)")
    p.add_argument("--w-mse", type=bounded(float, 0), default=1.0, help="weight of MSE(pooled)")
    p.add_argument("--w-hidden", type=bounded(float, 0), default=1.0, help="weight of MSE(last hidden, real tokens)")
    p.add_argument("--w-layers", type=bounded(float, 0), default=0.0,
                   help="weight of MSE(hidden states after each earlier layer, real tokens), averaged over "
                        "those layers; needs as many student as teacher layers, and only rows the teacher "
                        "reads in one window enter it")
    p.add_argument("--hash-family", choices=("gaussian", "fast"),
                   help="LSH projections of the student (written to its config as use_fast_hash; default: "
                        "keep the student's). gaussian: unbiased collision rates; fast: HD3HD2HD1 rotations")
    p.add_argument("--conv-window", type=int,
                   help="give a student without one a YOSO-C depthwise convolution over the values of this "
                        "(odd) width, zero-initialised so training starts from the student's own outputs")
    p.add_argument("--conv-lr-scale", type=float, default=1.0,
                   help="learning rate of the YOSO-C kernels as a multiple of --lr (a zero-initialised conv "
                        "moves about lr per step under AdamW, so it needs a larger one to matter in a short run)")
    p.add_argument("--save-fp16", action="store_true", help="store model/ in fp16 (the bundled format)")
    # no dropout by default: the teacher's targets are deterministic, noise only blurs the fit
    add_common_arguments(p, lr=5e-5, batch_size=16, epochs=1, dropout=0.0)


class DistillLoss(nn.Module):
    """Student forward + the distillation losses; holds only the student's encoder."""

    def __init__(self, student: EncoderModel, weights: tuple[float, float, float], w_layers: float = 0.0) -> None:
        super().__init__()
        self.student = student.encoder
        self.pooling = student.config.pooling
        self.w_cos, self.w_mse, self.w_hidden = weights
        self.w_layers = w_layers
        self.taps = LayerTaps(self.student.encoder.layer[:-1]) if w_layers else None

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch["attention_mask"]
        if self.taps:
            self.taps.clear()
        hidden = self.student(batch["input_ids"], mask, hashes=int(batch["hashes"]))  # (B, N, D)
        loss, parts = distill_losses(hidden.float(), batch["t_hidden"], mask, self.pooling,
                                     (self.w_cos, self.w_mse, self.w_hidden))
        if self.taps:
            layers = layer_loss(self.taps.outputs, batch["t_layers"], mask, batch["t_single"])
            loss = loss + self.w_layers * layers
            parts["layers_mse"] = float(layers.detach())
        return loss, parts


class LayerTaps:
    """Forward hooks that keep the output of each of ``layers`` from the latest forward pass."""

    def __init__(self, layers) -> None:
        self.outputs: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(lambda _m, _i, out: self.outputs.append(out))
                        for layer in layers]

    def clear(self) -> None:
        self.outputs = []

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def layer_loss(student: list[torch.Tensor], teacher: list[torch.Tensor], mask: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    """Mean over layers of MSE(student, teacher) on the real tokens of ``rows`` (B,) bool; each list
    holds (B, N, D) per layer. Zero when no row qualifies."""
    if len(student) != len(teacher):
        raise ValueError(f"--w-layers: the student taps {len(student)} layers, the teacher {len(teacher)}")
    real = mask.bool() & rows[:, None]
    if not real.any():
        return student[0].sum() * 0.0
    return torch.stack([F.mse_loss(s.float()[real], t[real]) for s, t in zip(student, teacher)]).mean()


def distill_losses(hidden: torch.Tensor, t_hidden: torch.Tensor, mask: torch.Tensor, pooling: str,
                   weights: tuple[float, float, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """hidden, t_hidden: (B, N, D) fp32; mask (B, N) → (weighted loss, its parts as floats)."""
    s_pool, t_pool = pool(hidden, mask, pooling), pool(t_hidden, mask, pooling)
    cos = 1.0 - F.cosine_similarity(s_pool, t_pool, dim=-1).mean()
    mse = F.mse_loss(s_pool, t_pool)
    real = mask.bool()
    tok = F.mse_loss(hidden[real], t_hidden[real])
    loss = weights[0] * cos + weights[1] * mse + weights[2] * tok
    return loss, {"cos_loss": float(cos.detach()), "pooled_mse": float(mse.detach()), "hidden_mse": float(tok.detach())}


@torch.no_grad()
def teacher_targets(teacher: BertTeacher, input_ids: torch.Tensor, mask: torch.Tensor, *, cls_id: int,
                    sep_id: int, window: int, stride: int, layers: bool = False) -> dict[str, torch.Tensor]:
    """(B, N) right-padded ids → {"t_hidden": teacher hidden states (B, N, D)}; rows longer than the
    teacher allows are encoded in overlapping windows, the rest in one batched forward. With
    ``layers``, also "t_layers" (the output of each layer but the last, (L-1, B, N, D)) and
    "t_single" ((B,) bool: the rows read in one window, the only ones those targets hold)."""
    lengths = mask.sum(1).tolist()
    limit = teacher.max_positions
    short = [i for i, n in enumerate(lengths) if n <= limit]
    shape = (*input_ids.shape, teacher.config["hidden_size"])
    out = torch.zeros(shape, device=input_ids.device)
    taps = LayerTaps(teacher.encoder.layer[:-1]) if layers else None
    if short:
        n = max(lengths[i] for i in short)
        out[short, :n] = teacher(input_ids[short, :n], mask[short, :n])
    targets = {}
    if taps:
        per_layer = torch.zeros((len(teacher.encoder.layer) - 1, *shape), device=input_ids.device)
        for j, t in enumerate(taps.outputs):
            per_layer[j, short, :t.shape[1]] = t
        targets["t_layers"] = per_layer * mask[..., None]
        targets["t_single"] = mask.sum(1) <= limit
        taps.remove()
    for i, n in enumerate(lengths):
        if n > limit:
            out[i, :n] = teacher.windowed_hidden(input_ids[i, :n].tolist(), cls_id=cls_id, sep_id=sep_id,
                                                 window=window or None, stride=stride or None)
    return {"t_hidden": out * mask[..., None], **targets}


def add_conv(student: EncoderModel, window: int) -> None:
    """Add a zero-initialised YOSO-C convolution of ``window`` to every attention layer of ``student``
    (a no-op at the start: the student's outputs are unchanged until the kernels train)."""
    have = student.config.conv_window
    if have == window:
        return
    if have is not None:
        raise ValueError(f"--conv-window {window}: the student already has conv_window {have}")
    student.config.conv_window = window
    student.config.validate()
    for m in student.modules():
        if isinstance(m, YosoSelfAttention):
            ref = m.query.weight
            m.conv = yoso_conv(m.heads, window).to(device=ref.device, dtype=ref.dtype)
            nn.init.zeros_(m.conv.weight)


def init_student(args: argparse.Namespace, session: Session) -> Path:
    """The student's starting directory: --student, or the teacher converted into the run dir."""
    if args.student:
        return args.student
    init = session.run.path / "init"
    if session.dist.is_main and not (init / "config.json").is_file():
        convert_bert_to_yoso(args.teacher, init, max_positions=args.max_positions)
    session.dist.barrier()
    return init


def run(args: argparse.Namespace) -> int:
    if args.conv_lr_scale <= 0:
        raise ValueError(f"--conv-lr-scale must be > 0, got {args.conv_lr_scale}")
    session = start(args, "distill")
    train_hashes = parse_hashes(args.train_hashes)
    student = load_pretrained(init_student(args, session), device=session.device)
    if student.tokenizer is None:
        raise ValueError("the student checkpoint has no tokenizer files")
    student.config.use_expectation = args.serve_hashes == 0
    student.config.num_hash = args.serve_hashes or student.config.num_hash
    if args.conv_window is not None:
        add_conv(student, args.conv_window)
    if args.hash_family:
        student.config.use_fast_hash = args.hash_family == "fast"
        for m in student.modules():
            if hasattr(m, "fast_hash"):
                m.fast_hash = student.config.use_fast_hash
    teacher = BertTeacher.from_dir(args.teacher, device=session.device)
    if teacher.config["vocab_size"] != student.config.vocab_size:
        raise ValueError(f"teacher vocab_size {teacher.config['vocab_size']} != student {student.config.vocab_size}")
    tok = student.tokenizer
    cls_id, sep_id = tok.wrap([])
    max_length = min(args.max_length, student.config.max_length)
    _, ids = read_texts(session, args.data, tok, max_length=max_length, name="train")
    prepare_model(args, student.encoder, student.config.num_hidden_layers)
    if args.w_layers and teacher.config["num_hidden_layers"] != student.config.num_hidden_layers:
        raise ValueError(f"--w-layers needs as many layers in the student ({student.config.num_hidden_layers}) "
                         f"as in the teacher ({teacher.config['num_hidden_layers']})")
    if args.w_layers and student.config.reversible:
        raise ValueError("--w-layers does not apply to a reversible student (its layers are not tapped)")
    module = DistillLoss(student, (args.w_cos, args.w_mse, args.w_hidden), args.w_layers)
    trainer: Trainer

    def prepare(batch: dict) -> dict:
        batch = {k: v.to(session.device) for k, v in batch.items()}
        rng = random.Random(args.seed * 1_000_003 + trainer.step * 997 + trainer.batch_in_epoch)
        batch["hashes"] = rng.choice(train_hashes)
        if not args.fixed_hash_seed:
            set_hash_seeds(student, rng.randrange(1, 1 << 30))
        batch.update(teacher_targets(teacher, batch["input_ids"], batch["attention_mask"], cls_id=cls_id,
                                     sep_id=sep_id, window=args.window, stride=args.stride,
                                     layers=bool(args.w_layers)))
        return batch

    options = dataclasses.replace(train_options(args), lr_scales=(("attention.self.conv.weight", args.conv_lr_scale),))
    trainer = Trainer(module, TokenizedDataset(ids), lambda items: pad_batch(items, tok.pad_id), prepare,
                      options=options, run=session.run, dist_=session.dist, device=session.device)
    return fit_student(trainer, student, session, args, "distill", lambda: f"{len(ids)} texts, {trainer.total_steps} "
                       f"steps, hashes {train_hashes}, world size {session.dist.world_size}")
