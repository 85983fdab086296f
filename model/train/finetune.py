"""``yoso-train finetune``: a sequence-classification head on any YOSO checkpoint.

Single-label (cross-entropy) or multi-label (``labels`` lists, binary cross-entropy),
a validation split (``--val-data`` or a seeded ``--val-fraction`` of ``--data``),
accuracy and F1 after every epoch, and the best epoch kept in ``best/`` — an HF-format
directory with ``id2label`` that ``yoso-serve --model`` serves as it is.

``--model`` may also name a BERT-family (softmax) directory: that trains the same head on
the softmax encoder, as the baseline a YOSO model is compared with. Such a run reports its
metrics and keeps its weights in the training checkpoint only (it is not a YOSO model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from yoso_serve.model import EncoderConfig, EncoderModel, TextTokenizer, load_pretrained, save_pretrained
from yoso_serve.model.heads import ClassificationHead
from yoso_serve.model.argtypes import bounded
from yoso_serve.model.hashes import MAX_HASHES

from .common import add_common_arguments, prepare_model, read_texts, start, train_options
from .data import TokenizedDataset, label_targets, pad_batch, split_train_val
from .embedders import embed_all
from .metrics import multi_label_metrics, single_label_metrics
from .teacher import BertTeacher
from .trainer import Trainer

METRICS = ("f1", "accuracy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="YOSO checkpoint (or a BERT dir for the baseline)")
    p.add_argument("--data", required=True, type=Path, nargs="+", help="labelled JSONL / CSV")
    p.add_argument("--val-data", type=Path, nargs="*", default=[], help="validation files (else --val-fraction)")
    p.add_argument("--test-data", type=Path, nargs="*", default=[], help="scored once with the best checkpoint")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--multi-label", action="store_true", help="force multi-label (automatic when a row has "
                   "several labels)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--hashes", type=bounded(int, 0, MAX_HASHES), default=None,
                   help="hash count in training (default: the model's; "
                   "0 = exact, whose gradient is the true one with --exact-backward true)")
    p.add_argument("--eval-hashes", type=bounded(int, 0, MAX_HASHES), default=None,
                   help="hash count for validation and test scoring (default: --hashes)")
    p.add_argument("--metric", choices=METRICS, default="f1", help="validation metric that picks best/")
    add_common_arguments(p, lr=3e-5, batch_size=16, epochs=3)


class Classifier(nn.Module):
    """Backbone (YOSO or softmax BERT) → transformers' classification head → loss."""

    def __init__(self, backbone: nn.Module, head: ClassificationHead, *, multi_label: bool,
                 hashes: int | None) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head
        self.multi_label, self.hashes = multi_label, hashes

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hashes: int | None = None) -> torch.Tensor:
        """(B, num_labels) at ``hashes`` (None: the training count; a softmax backbone ignores it)."""
        if isinstance(self.backbone, BertTeacher):
            hidden = self.backbone(input_ids, attention_mask)
        else:
            hidden = self.backbone(input_ids, attention_mask, hashes=self.hashes if hashes is None else hashes)
        return self.head(hidden)  # (B, num_labels)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        logits = self.logits(batch["input_ids"], batch["attention_mask"]).float()
        if self.multi_label:
            return F.binary_cross_entropy_with_logits(logits, batch["labels"].float()), {}
        return F.cross_entropy(logits, batch["labels"]), {}


def build(args: argparse.Namespace, labels: list[str], multi: bool, device: torch.device):
    """(Classifier, EncoderModel to save or None for a softmax baseline, tokenizer)."""
    id2label = dict(enumerate(labels))
    problem = "multi_label_classification" if multi else "single_label_classification"
    if json.loads((args.model / "config.json").read_text()).get("model_type") != "yoso":
        backbone = BertTeacher.from_dir(args.model).requires_grad_(True)
        cfg = EncoderConfig(hidden_size=backbone.config["hidden_size"], num_attention_heads=1,
                            hidden_act=backbone.config.get("hidden_act", "gelu"), id2label=id2label)
        head = ClassificationHead(cfg, len(labels))
        for lin in (head.dense, head.out_proj):  # BERT's init, as the YOSO head gets
            nn.init.normal_(lin.weight, std=backbone.config.get("initializer_range", 0.02))
            nn.init.zeros_(lin.bias)
        return Classifier(backbone, head, multi_label=multi, hashes=None), None, TextTokenizer.from_dir(args.model)
    base = load_pretrained(args.model, device="cpu")
    config = EncoderConfig.from_dict({**base.config.to_dict(), "id2label": id2label, "label2id": None,
                                      "problem_type": problem})
    model = EncoderModel(config, with_classifier=True, tokenizer=base.tokenizer)
    model.yoso.load_state_dict(base.yoso.state_dict())
    if base.has_classifier and base.id2label == id2label:
        model.classifier.load_state_dict(base.classifier.state_dict())
    return Classifier(model.yoso, model.classifier, multi_label=multi, hashes=args.hashes), model, base.tokenizer


@torch.no_grad()
def score(clf: Classifier, ids, targets: torch.Tensor, *, multi: bool, num_labels: int, pad_id: int,
          device: torch.device, batch_size: int, hashes: int | None) -> dict[str, float]:
    """Metrics of ``clf`` on ``ids`` with ``hashes`` (None: the training count) in eval mode."""
    was = clf.training
    clf.eval()
    try:
        logits, _ = embed_all(lambda x, mask: clf.logits(x, mask, hashes), ids, pad_id=pad_id,
                              batch_size=batch_size, device=device, desc="validation")
    finally:
        clf.train(was)
    loss = (F.binary_cross_entropy_with_logits(logits, targets) if multi else F.cross_entropy(logits, targets)).item()
    metrics = multi_label_metrics(logits, targets) if multi else single_label_metrics(logits, targets, num_labels)
    return {"loss": loss, **metrics}


def run(args: argparse.Namespace) -> int:
    session = start(args, "finetune")
    tok = TextTokenizer.from_dir(args.model)
    examples, ids = read_texts(session, args.data, tok, max_length=args.max_length, name="train", need_labels=True)
    if args.val_data:
        val_ex, val_ids = read_texts(session, args.val_data, tok, max_length=args.max_length, name="validation",
                                     need_labels=True)
        train_idx = list(range(len(examples)))
    else:
        train_idx, val_idx = split_train_val(len(examples), args.val_fraction, args.seed)
        val_ex, val_ids = [examples[i] for i in val_idx], [ids[i] for i in val_idx]
    multi = args.multi_label or any(len(ex.labels) != 1 for ex in examples)
    labels = sorted({x for ex in examples for x in ex.labels})
    label2id = {x: i for i, x in enumerate(labels)}
    val_keep = [i for i, ex in enumerate(val_ex) if all(x in label2id for x in ex.labels)]
    if not val_keep:  # scoring nothing fails only after training
        raise ValueError(f"{'--val-data' if args.val_data else '--val-fraction'}: no validation row has only labels "
                         f"seen in training ({labels})")
    if args.test_data:
        test_ex, test_ids = read_texts(session, args.test_data, tok, max_length=args.max_length, name="test",
                                       need_labels=True)
        test_keep = [i for i, ex in enumerate(test_ex) if all(x in label2id for x in ex.labels)]
        if not test_keep:
            raise ValueError(f"--test-data: no row has only labels seen in training ({labels})")
    val_targets = label_targets([val_ex[i] for i in val_keep], label2id, multi_label=multi)
    val_ids = [val_ids[i] for i in val_keep]
    clf, model, tok = build(args, labels, multi, session.device)
    if model is not None:
        prepare_model(args, model.yoso, model.config.num_hidden_layers)
    train_ds = TokenizedDataset([ids[i] for i in train_idx],
                                label_targets([examples[i] for i in train_idx], label2id, multi_label=multi))
    trainer = Trainer(clf, train_ds, lambda items: pad_batch(items, tok.pad_id),
                      lambda b: {k: v.to(session.device) for k, v in b.items()},
                      options=train_options(args), run=session.run, dist_=session.dist, device=session.device)
    evaluate = dict(multi=multi, num_labels=len(labels), pad_id=tok.pad_id, device=session.device,
                    batch_size=args.batch_size, hashes=args.eval_hashes)

    def on_epoch_end(epoch: int) -> dict[str, float]:
        if not session.dist.is_main:
            return {}
        metrics = score(clf, val_ids, val_targets, **evaluate)
        session.say(f"epoch {epoch}: " + ", ".join(f"val_{k} {v:.4f}" for k, v in metrics.items()))
        best = trainer.extra.get("best")
        if best is None or metrics[args.metric] > best[args.metric]:
            trainer.extra["best"] = {"epoch": epoch, **metrics}
            trainer.extra["best_state"] = {k: v.detach().cpu().clone() for k, v in clf.state_dict().items()}
            if model is not None:
                save_pretrained(model, session.run.path / "best")
        return {f"val_{k}": v for k, v in metrics.items()}

    trainer.on_epoch_end = on_epoch_end
    if args.resume:
        trainer.resume()
    session.say(f"finetune: {len(train_ds)} train / {len(val_ids)} validation examples, labels {labels}, "
                f"{'multi' if multi else 'single'}-label, {trainer.total_steps} steps")
    trainer.fit()
    if session.dist.is_main:
        if model is not None:
            save_pretrained(model, session.run.path / "model")
        result = {"best": trainer.extra.get("best"), "labels": labels, "multi_label": multi}
        if args.test_data and trainer.extra.get("best_state") is not None:
            clf.load_state_dict(trainer.extra["best_state"])
            keep = test_keep
            targets = label_targets([test_ex[i] for i in keep], label2id, multi_label=multi)
            result["test"] = score(clf, [test_ids[i] for i in keep], targets, **evaluate)
            result["test"]["examples"] = len(keep)
            session.run.log("test", **result["test"])
            session.say("test: " + ", ".join(f"{k} {v:.4f}" for k, v in result["test"].items()))
        session.run.write_json("results.json", {k: v for k, v in result.items()})
    return 0
