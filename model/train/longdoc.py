"""``yoso-train longdoc``: contrastive long-document training, so that one pass over a whole document
finds what is deep inside it.

Each step takes ``--batch-size`` documents of one source (in-batch negatives of the same source are the
hard ones), cropped to the length of the curriculum's current stage, and ``--spans-per-doc`` spans of
each: a block (paragraph, list item) or one of its sentences, drawn uniformly over the document's
tokens. Losses, summed:

* long: symmetric InfoNCE between spans and documents (span → its document among the batch's and a
  queue of recent documents' embeddings; document → each of its spans among the batch's spans) with a
  learned temperature;
* short (``--w-short``): symmetric InfoNCE between the first sentence of a paragraph and the rest of it;
* distill (``--w-distill``): 1 − cos between the student's and the teacher's embedding of every short
  text (spans and short pairs), so short-text quality stays the teacher's;
* segment (``--w-segment``): span → piece InfoNCE over the crops' pieces.

The loss is a list of these terms (:mod:`.longdoc_loss`). Documents run at ``--doc-hashes`` (LSH, with the
served projections), short texts at ``--query-hashes``; one count of each list is drawn per step. What else
was tried here, and what it measured, is in the bundled recipe's LOG.md (docs/training.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import torch

from yoso_serve.model import load_pretrained
from yoso_serve.model.argtypes import bounded

from .common import add_common_arguments, prepare_model, start, train_options
from .data import pad
from .longdoc_data import (DocCorpus, StepSlots, crop_length, draw_spans, hash_key, parse_curriculum,
                           read_documents, step_documents)
from .longdoc_loss import Distill, LongDocLoss, ShortPairs, SpanDocument, SpanPiece
from .student import fit_student, parse_hashes
from .teacher import BertTeacher
from .trainer import Trainer



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="YOSO checkpoint to start from")
    p.add_argument("--teacher", required=True, type=Path,
                   help="BERT-family teacher of the short-text term, or `init`: the starting --model, frozen "
                        "(holds short texts where the student starts; for machines without the teacher's weights)")
    p.add_argument("--data", required=True, type=Path, nargs="+",
                   help="document JSONL: {doc, source, blocks: [text, ...]} per line "
                        "(recipes/yoso-minilm-l6-4096/corpus.py writes it)")
    p.add_argument("--spans-per-doc", type=int, default=4)
    p.add_argument("--span-tokens", type=int, default=128, help="spans and short texts are cut to this")
    p.add_argument("--short-pairs", type=int, default=16, help="first-sentence → rest pairs per step")
    p.add_argument("--queue", type=int, default=128, help="recent document embeddings kept as extra negatives")
    p.add_argument("--curriculum", default="1024:0.3,2048:0.65,4096:1",
                   help="LENGTH:UNTIL,... documents are cropped to LENGTH tokens until that fraction of the steps")
    p.add_argument("--doc-hashes", default="32", help="hash counts of documents, one drawn per step (0 = exact)")
    p.add_argument("--query-hashes", default="0", help="hash counts of spans and short texts, one drawn per step")
    p.add_argument("--temperature", type=bounded(float, 0, lo_open=True), default=0.05,
                   help="initial InfoNCE temperature (learned)")
    p.add_argument("--temperature-lr-scale", type=float, default=1.0,
                   help="learning rate of the temperature as a multiple of --lr (at the model's lr of ~2e-5 "
                        "AdamW moves its log by ~lr per step, so it stays where it starts)")
    p.add_argument("--neighbourhood", type=int, default=0,
                   help="draw a step's documents from this many consecutive documents of one source in key "
                        "order (parts of one page, pages of one section: hard negatives); 0 = the whole source")
    p.add_argument("--w-short", type=bounded(float, 0), default=1.0, help="weight of the short-pair InfoNCE")
    p.add_argument("--w-distill", type=bounded(float, 0), default=1.0,
                   help="weight of 1 − cos(student, teacher) on short texts")
    p.add_argument("--w-segment", type=bounded(float, 0), default=0.0,
                   help="weight of span → segment InfoNCE: each span against the mean token states of the "
                        "batch's --segment-tokens pieces, its positives the pieces of its own block (0 = off)")
    p.add_argument("--segment-tokens", default="128",
                   help="piece sizes of --w-segment, one drawn per step (e.g. 64,128): consecutive pieces of each "
                        "crop, as `eval --segment` cuts them")
    p.add_argument("--save-fp16", action="store_true", help="store model/ in fp16 (the bundled format)")
    add_common_arguments(p, lr=2e-5, batch_size=4, epochs=1, dropout=0.0)


def run(args: argparse.Namespace) -> int:
    for name in ("spans_per_doc", "span_tokens", "short_pairs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size < 2 or args.queue < 0 or not args.temperature > 0:
        raise ValueError("--batch-size must be >= 2 (in-batch negatives), --queue >= 0, --temperature > 0")
    if args.neighbourhood and args.neighbourhood < args.batch_size:
        raise ValueError(f"--neighbourhood must be 0 or >= --batch-size ({args.batch_size}), got {args.neighbourhood}")
    if args.w_segment < 0:
        raise ValueError(f"--w-segment must be >= 0, got {args.w_segment}")
    try:
        segment_sizes = [int(x) for x in args.segment_tokens.split(",")]
    except ValueError:
        segment_sizes = []
    if not segment_sizes or min(segment_sizes) < 1:
        raise ValueError(f"--segment-tokens must be piece sizes >= 1 separated by commas, got {args.segment_tokens!r}")
    if not args.temperature_lr_scale > 0:
        raise ValueError(f"--temperature-lr-scale must be > 0, got {args.temperature_lr_scale}")
    stages = parse_curriculum(args.curriculum)
    doc_hashes = parse_hashes(args.doc_hashes, "--doc-hashes")
    query_hashes = parse_hashes(args.query_hashes, "--query-hashes")
    session = start(args, "longdoc")
    student = load_pretrained(args.model, device=session.device)
    if student.tokenizer is None:
        raise ValueError("the student checkpoint has no tokenizer files")
    if stages[-1][0] > student.config.max_length:
        raise ValueError(f"--curriculum reaches {stages[-1][0]} tokens; the model has {student.config.max_length}")
    teacher = (FrozenStart(load_pretrained(args.model, device=session.device)) if str(args.teacher) == INIT_TEACHER
               else BertTeacher.from_dir(args.teacher, device=session.device))
    tok = student.tokenizer
    corpus = DocCorpus(read_documents(args.data), tok, min(args.span_tokens, teacher.max_positions))
    weights = corpus.source_weights(args.batch_size)
    if not weights:
        raise ValueError(f"--data: no source has --batch-size ({args.batch_size}) documents")
    if len(corpus.pairs) < args.short_pairs:
        raise ValueError(f"--data: {len(corpus.pairs)} short pairs, fewer than --short-pairs {args.short_pairs}")
    prepare_model(args, student.encoder, student.config.num_hidden_layers)
    terms = [SpanDocument(), ShortPairs(args.w_short), Distill(args.w_distill)]
    if args.w_segment:
        terms.append(SpanPiece(args.w_segment, segment_sizes[0]))
    module = LongDocLoss(student, temperature=args.temperature, queue=args.queue, terms=terms)
    sources = list(weights)
    trainer: Trainer

    def collate(items: list[dict]) -> dict:
        rng = random.Random(args.seed * 1_000_003 + trainer.step * 997 + trainer.batch_in_epoch)
        length = crop_length(stages, trainer.step, trainer.total_steps) - 2
        source = rng.choices(sources, weights=[weights[s] for s in sources])[0]
        docs, spans, span_doc, keys, where = [], [], [], [], []
        for d in step_documents(rng, corpus, source, args.batch_size, args.neighbourhood):
            total = sum(len(ids) for ids in corpus.ids[d])
            lo = rng.randrange(total - length + 1) if total > length else 0
            flat = [t for ids in corpus.ids[d] for t in ids][lo:lo + length]
            for span in draw_spans(rng, corpus, d, lo, lo + length, args.spans_per_doc, where):
                spans.append(span)
                span_doc.append(len(docs))
            docs.append(tok.wrap(flat))
            keys.append(corpus.keys[d])
        pairs = rng.sample(corpus.pairs, args.short_pairs)
        room = corpus.span_tokens
        short = spans + tok.encode([a for a, _ in pairs], max_length=room) + tok.encode([b for _, b in pairs], max_length=room)
        ids, mask = pad(docs, tok.pad_id)
        short_ids, short_mask = pad(short, tok.pad_id)
        batch = {"input_ids": ids, "attention_mask": mask, "short_ids": short_ids, "short_mask": short_mask,
                 "span_doc": torch.tensor(span_doc, dtype=torch.long), "n_pairs": torch.tensor(len(pairs)),
                 # each span's block as sequence positions of its crop (+ 1: the crop starts with [CLS])
                 "span_lo": torch.tensor([a + 1 for a, _ in where], dtype=torch.long),
                 "span_hi": torch.tensor([z + 1 for _, z in where], dtype=torch.long),
                 "doc_keys": torch.tensor([hash_key(k) for k in keys]),
                 "doc_hashes": torch.tensor(rng.choice(doc_hashes)), "query_hashes": torch.tensor(rng.choice(query_hashes))}
        rng.randrange(1, 1 << 30)  # the draw of a deleted option's seed, kept so the draws after it stay the recipe's
        if args.w_segment and len(segment_sizes) > 1:  # drawn last: the draws above stay those of one size
            batch["segment_tokens"] = torch.tensor(rng.choice(segment_sizes))
        return batch

    def prepare(batch: dict) -> dict:
        batch = {k: v.to(session.device) for k, v in batch.items()}
        with torch.no_grad():
            batch["t_short"] = teacher.embed(batch["short_ids"], batch["short_mask"])
        return batch

    options = dataclasses.replace(train_options(args), lr_scales=(("log_scale", args.temperature_lr_scale),))
    options.batch_size = 1  # one slot per micro-batch; --batch-size documents are drawn inside it
    slots = max(1, sum(len(d) for d in corpus.by_source.values()) // args.batch_size)
    trainer = Trainer(module, StepSlots(slots), collate, prepare, options=options, run=session.run,
                      dist_=session.dist, device=session.device)
    return fit_student(trainer, student, session, args, "longdoc", lambda: (
        f"{len(corpus.keys)} documents from {len(weights)} sources ({', '.join(sources)}), "
        f"{len(corpus.pairs)} short pairs, {trainer.total_steps} steps, curriculum {stages}"))


INIT_TEACHER = "init"


class FrozenStart:
    """``--teacher init``: the starting model, frozen, as the teacher of the short-text term. Short texts
    (at most ``max_positions`` tokens, as a BERT teacher's) are embedded exactly, as the student embeds them
    in training and ``auto`` serves them, so the distillation term holds the student's short-text embeddings
    where they started instead of pulling them to another model's."""

    max_positions = 512

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids, attention_mask, hashes=0)


