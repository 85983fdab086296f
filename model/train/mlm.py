"""``yoso-train mlm``: masked-LM pretraining from a config, or continued pretraining from a checkpoint.

BERT's masking: ``--mask-prob`` of the real, non-special tokens are chosen; of those 80 %
become the mask token, 10 % a random token, 10 % stay. The loss is cross-entropy on the
chosen positions; the masked-token accuracy is logged, and with ``--val-data`` the
validation loss (fixed masks, so epochs compare) is reported every epoch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer, load_pretrained, save_pretrained
from yoso_serve.model.argtypes import bounded
from yoso_serve.model.hashes import MAX_HASHES

from .common import add_common_arguments, prepare_model, read_texts, start, train_options
from .data import TokenizedDataset, pad_batch
from .trainer import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="YOSO checkpoint to continue pretraining (MLM head added if absent)")
    src.add_argument("--config", type=Path, help="config.json of a new model (pretraining from scratch)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (with --config)")
    p.add_argument("--data", required=True, type=Path, nargs="+", help="text / JSONL / CSV files")
    p.add_argument("--val-data", type=Path, nargs="*", default=[])
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--mask-prob", type=bounded(float, 0, 1, lo_open=True), default=0.15)
    p.add_argument("--hashes", type=bounded(int, 0, MAX_HASHES), default=None,
                   help="hash count in training (default: the model's)")
    add_common_arguments(p, lr=1e-4, batch_size=16, epochs=1)


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, special_ids: list[int], mask_id: int,
                vocab_size: int, prob: float, generator: torch.Generator | None = None):
    """(B, N) ids → (masked ids, labels with -100 where no loss). BERT's 80/10/10 rule."""
    device = input_ids.device
    candidates = attention_mask.bool() & ~torch.isin(input_ids, torch.tensor(special_ids, device=device))
    draw = torch.rand(input_ids.shape, generator=generator, device="cpu").to(device)
    chosen = candidates & (draw < prob)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    action = torch.rand(input_ids.shape, generator=generator, device="cpu").to(device)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device="cpu").to(device)
    out = torch.where(chosen & (action < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    out = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, out)
    return out, labels


class MaskedLM(nn.Module):
    def __init__(self, model: EncoderModel, hashes: int | None) -> None:
        super().__init__()
        self.model, self.hashes = model, hashes

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.model.mlm_logits(batch["input_ids"], batch["attention_mask"], hashes=self.hashes).float()
        labels = batch["labels"]
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        chosen = labels != -100
        acc = (logits.argmax(-1)[chosen] == labels[chosen]).float().mean() if chosen.any() else torch.tensor(0.0)
        return loss, {"masked_acc": float(acc)}


def build_model(args: argparse.Namespace) -> EncoderModel:
    """The model to train; its tokenizer and vocabulary are checked here, as they fail only mid-training."""
    if args.model:
        base = load_pretrained(args.model)
        if base.tokenizer is None:
            raise ValueError(f"--model: no tokenizer in {args.model} (tokenizer.json or vocab.txt)")
        if base.has_mlm_head:
            model = base
        else:
            model = EncoderModel(base.config, with_mlm=True, tokenizer=base.tokenizer)
            model.yoso.load_state_dict(base.yoso.state_dict())
    else:
        if args.tokenizer is None:
            raise ValueError("--config needs --tokenizer (a directory with tokenizer.json or vocab.txt)")
        if not args.config.is_file():
            raise ValueError(f"--config: {args.config} is not a file")
        try:
            data = json.loads(args.config.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config: {args.config} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {args.config} must hold a JSON object, not {type(data).__name__}")
        model = EncoderModel(EncoderConfig.from_dict(data), with_mlm=True,
                             tokenizer=TextTokenizer.from_dir(args.tokenizer))
    if model.tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"vocab_size {model.config.vocab_size} of the model is below the tokenizer's "
                         f"{model.tokenizer.vocab_size}")
    return model


def run(args: argparse.Namespace) -> int:
    if not 0.0 < args.mask_prob < 1.0:
        raise ValueError(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    session = start(args, "mlm")
    model = build_model(args)
    tok = model.tokenizer
    mask_name = tok.specials.get("mask_token", "[MASK]")
    mask_id = tok.tokenizer.token_to_id(mask_name)
    if mask_id is None:
        raise ValueError(f"the tokenizer has no mask token {mask_name!r}")
    special = sorted({*tok.wrap([]), tok.pad_id, mask_id})
    max_length = min(args.max_length, model.config.max_length)
    _, ids = read_texts(session, args.data, tok, max_length=max_length, name="train")
    prepare_model(args, model.yoso, model.config.num_hidden_layers)
    masking = dict(special_ids=special, mask_id=mask_id, vocab_size=model.config.vocab_size, prob=args.mask_prob)
    trainer: Trainer

    def prepare(batch: dict) -> dict:
        # the mask is a function of (seed, rank, step): a resumed run masks the same way
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + session.dist.rank * 7919
                                            + trainer.step * 131 + trainer.batch_in_epoch)
        batch = {k: v.to(session.device) for k, v in batch.items()}
        batch["input_ids"], batch["labels"] = mask_tokens(batch["input_ids"], batch["attention_mask"],
                                                          generator=gen, **masking)
        return batch

    module = MaskedLM(model, args.hashes)

    def collate(items: list[dict]) -> dict:
        return pad_batch(items, tok.pad_id)

    trainer = Trainer(module, TokenizedDataset(ids), collate, prepare, options=train_options(args),
                      run=session.run, dist_=session.dist, device=session.device)
    if args.val_data:
        _, val_ids = read_texts(session, args.val_data, tok, max_length=max_length, name="validation")

        @torch.no_grad()
        def on_epoch_end(epoch: int) -> dict[str, float]:
            module.eval()
            gen = torch.Generator().manual_seed(args.seed)
            total, n = 0.0, 0
            for s in range(0, len(val_ids), args.batch_size):
                batch = collate([{"input_ids": x} for x in val_ids[s:s + args.batch_size]])
                batch = {k: v.to(session.device) for k, v in batch.items()}
                batch["input_ids"], batch["labels"] = mask_tokens(batch["input_ids"], batch["attention_mask"],
                                                                  generator=gen, **masking)
                loss, _ = module(batch)
                total, n = total + float(loss), n + 1
            module.train()
            return {"val_loss": total / max(1, n)}

        trainer.on_epoch_end = on_epoch_end

    def export() -> None:
        if session.dist.is_main:
            save_pretrained(model, session.run.path / "model")

    trainer.on_save = export
    if args.resume:
        trainer.resume()
    session.say(f"mlm: {len(ids)} texts, {trainer.total_steps} steps, world size {session.dist.world_size}")
    trainer.fit()
    return 0
