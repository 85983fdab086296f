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
* segment (``--w-segment``): span → piece InfoNCE over the crops' pieces;
* kernel (``--w-kernel``): each span's distribution over the documents (batch and queue) by their one
  vector, pulled (KL) towards the distribution a kernel mean over the documents' own pieces gives
  (:func:`kernel_logits`, without gradient). Scored that way, documents are found far more often than by
  their one vector (0.74–0.84 against 0.67 recall@1 on the source kept out), so the soft targets say which
  wrong documents deserve to come close.

Documents run at ``--doc-hashes`` (LSH, with the served projections unless ``--fresh-hashes``), short
texts at ``--query-hashes``; one count of each list is drawn per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

import torch

from yoso_serve.model import load_pretrained
from yoso_serve.model.argtypes import bounded
from yoso_serve.model.encoder import POSITION_OFFSET

from .common import add_common_arguments, prepare_model, start, train_options
from .data import pad
from .distill import fit_student, parse_hashes, set_hash_seeds
from .longdoc_data import (DocCorpus, StepSlots, crop_length, draw_spans, hash_key, mine_neighbours,
                           parse_curriculum, read_documents, step_documents)
from .longdoc_loss import LongDocLoss
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
    p.add_argument("--fresh-hashes", action="store_true",
                   help="draw new hash projections each step (default: the served projections)")
    p.add_argument("--temperature", type=bounded(float, 0, lo_open=True), default=0.05,
                   help="initial InfoNCE temperature (learned)")
    p.add_argument("--temperature-lr-scale", type=float, default=1.0,
                   help="learning rate of the temperature as a multiple of --lr (at the model's lr of ~2e-5 "
                        "AdamW moves its log by ~lr per step, so it stays where it starts)")
    p.add_argument("--neighbourhood", type=int, default=0,
                   help="draw a step's documents from this many consecutive documents of one source in key "
                        "order (parts of one page, pages of one section: hard negatives); 0 = the whole source")
    p.add_argument("--mined-neighbours", type=int, default=0,
                   help="K > 0: a step's documents are one document and --batch-size − 1 of its K nearest of the "
                        "same source by the teacher's embedding of their first --mine-tokens tokens (mined once at "
                        "the start); 0 (default) draws them as --neighbourhood says")
    p.add_argument("--mine-tokens", type=int, default=256, help="tokens of each document's opening that are mined")
    p.add_argument("--w-short", type=bounded(float, 0), default=1.0, help="weight of the short-pair InfoNCE")
    p.add_argument("--w-distill", type=bounded(float, 0), default=1.0,
                   help="weight of 1 − cos(student, teacher) on short texts")
    p.add_argument("--w-segment", type=bounded(float, 0), default=0.0,
                   help="weight of span → segment InfoNCE: each span against the mean token states of the "
                        "batch's --segment-tokens pieces, its positives the pieces of its own block (0 = off)")
    p.add_argument("--segment-tokens", default="128",
                   help="piece sizes of --w-segment, one drawn per step (e.g. 64,128): consecutive pieces of each "
                        "crop, as `eval --segment` cuts them")
    p.add_argument("--w-kernel", type=bounded(float, 0), default=0.0,
                   help="weight of the KL from the pieces' kernel-mean scores to the one vector's (0 = off)")
    p.add_argument("--kernel-beta", type=bounded(float, 0, lo_open=True), default=20.0,
                   help="sharpness β of the kernel mean over pieces, mean exp(β (cos − 1))")
    p.add_argument("--kernel-temperature", type=bounded(float, 0, lo_open=True), default=0.5,
                   help="the target's logits are the log kernel mean divided by this")
    p.add_argument("--kernel-tokens", type=bounded(int, 1), default=64, help="piece size of --w-kernel's kernel mean")
    p.add_argument("--cut-negatives", action="store_true",
                   help="each crop also read with its spans' blocks cut out: a negative for its own spans that "
                        "differs from their document only by them")
    p.add_argument("--cut-fixed", action="store_true",
                   help="with --cut-negatives, read the cut copies without gradient: a fixed negative that moves only "
                        "the spans and their whole documents, and keeps no activations for the copies")
    p.add_argument("--w-own-windows", type=bounded(float, 0), default=0.0,
                   help="weight of a pull of each crop's one-pass embedding towards the student's own "
                        "--own-window-tokens windows of it, each read alone (exact, no gradient), unit and averaged: "
                        "what chunking with the same model keeps, as a floor for the whole read")
    p.add_argument("--own-window-tokens", type=bounded(int, 16), default=240,
                   help="window size of --w-own-windows, specials included")
    p.add_argument("--train-positions-from", type=bounded(int, 0), default=0,
                   help="train only the position embeddings of token positions N and up (counted from 0), everything "
                        "else frozen: inputs of at most N tokens embed bit for bit as the starting model's (0 = train "
                        "everything)")
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
    if args.mined_neighbours and (args.neighbourhood or args.mined_neighbours < args.batch_size - 1):
        raise ValueError(f"--mined-neighbours must be 0 or >= --batch-size - 1 ({args.batch_size - 1}), and not "
                         f"with --neighbourhood; got {args.mined_neighbours}")
    if args.cut_fixed and not args.cut_negatives:
        raise ValueError("--cut-fixed fixes the copies of --cut-negatives; pass both")
    if args.mine_tokens < 8:
        raise ValueError(f"--mine-tokens must be >= 8, got {args.mine_tokens}")
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
    if args.train_positions_from:  # checked before the teacher and the corpus load
        train_positions_only(student.encoder, args.train_positions_from)
    teacher = (FrozenStart(load_pretrained(args.model, device=session.device)) if str(args.teacher) == INIT_TEACHER
               else BertTeacher.from_dir(args.teacher, device=session.device))
    tok = student.tokenizer
    corpus = DocCorpus(read_documents(args.data), tok, min(args.span_tokens, teacher.max_positions))
    weights = corpus.source_weights(args.batch_size)
    if not weights:
        raise ValueError(f"--data: no source has --batch-size ({args.batch_size}) documents")
    if len(corpus.pairs) < args.short_pairs:
        raise ValueError(f"--data: {len(corpus.pairs)} short pairs, fewer than --short-pairs {args.short_pairs}")
    mined = (mine_neighbours(corpus, teacher.embed, k=args.mined_neighbours,
                             tokens=min(args.mine_tokens, teacher.max_positions), pad_id=tok.pad_id,
                             device=session.device) if args.mined_neighbours else None)
    prepare_model(args, student.encoder, student.config.num_hidden_layers)
    module = LongDocLoss(student, temperature=args.temperature, queue=args.queue,
                         weights=(args.w_short, args.w_distill), w_segment=args.w_segment,
                         segment=segment_sizes[0], w_kernel=args.w_kernel, kernel_beta=args.kernel_beta,
                         kernel_temperature=args.kernel_temperature, kernel_tokens=args.kernel_tokens,
                         max_tokens=stages[-1][0], w_own_windows=args.w_own_windows, cut_fixed=args.cut_fixed)
    sources = list(weights)
    trainer: Trainer

    def collate(items: list[dict]) -> dict:
        rng = random.Random(args.seed * 1_000_003 + trainer.step * 997 + trainer.batch_in_epoch)
        length = crop_length(stages, trainer.step, trainer.total_steps) - 2
        source = rng.choices(sources, weights=[weights[s] for s in sources])[0]
        docs, spans, span_doc, keys, where, cuts, cut_doc, flats = [], [], [], [], [], [], [], []
        for d in step_documents(rng, corpus, source, args.batch_size, args.neighbourhood, mined):
            total = sum(len(ids) for ids in corpus.ids[d])
            lo = rng.randrange(total - length + 1) if total > length else 0
            flat = [t for ids in corpus.ids[d] for t in ids][lo:lo + length]
            before = len(where)
            for span in draw_spans(rng, corpus, d, lo, lo + length, args.spans_per_doc, where):
                spans.append(span)
                span_doc.append(len(docs))
            if args.cut_negatives and len(where) > before:
                cut = set().union(*(range(a, z) for a, z in where[before:]))
                cuts.append(tok.wrap([t for i, t in enumerate(flat) if i not in cut]))
                cut_doc.append(len(docs))
            docs.append(tok.wrap(flat))
            flats.append(flat)
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
                 "doc_hashes": torch.tensor(rng.choice(doc_hashes)), "query_hashes": torch.tensor(rng.choice(query_hashes)),
                 "fresh_seed": torch.tensor(rng.randrange(1, 1 << 30))}
        if args.w_own_windows:  # each crop cut as retrieval.cut_windows cuts a document for a chunker
            from .retrieval import cut_windows  # retrieval imports this module

            owner, windows = cut_windows(flats, tok, args.own_window_tokens)
            batch["win_ids"], batch["win_mask"] = pad(windows, tok.pad_id)
            batch["win_doc"] = torch.tensor(owner, dtype=torch.long)
        if cuts:
            batch["cut_ids"], batch["cut_mask"] = pad(cuts, tok.pad_id)
            batch["cut_doc"] = torch.tensor(cut_doc, dtype=torch.long)
        if args.w_segment and len(segment_sizes) > 1:  # drawn last: the draws above stay those of one size
            batch["segment_tokens"] = torch.tensor(rng.choice(segment_sizes))
        return batch

    def prepare(batch: dict) -> dict:
        batch = {k: v.to(session.device) for k, v in batch.items()}
        if args.fresh_hashes:
            set_hash_seeds(student, int(batch["fresh_seed"]))
        with torch.no_grad():
            batch["t_short"] = teacher.embed(batch["short_ids"], batch["short_mask"])
        return batch

    options = dataclasses.replace(train_options(args), lr_scales=(("log_scale", args.temperature_lr_scale),),
                                  no_decay=(POSITION_WEIGHT,) if args.train_positions_from else ())
    options.batch_size = 1  # one slot per micro-batch; --batch-size documents are drawn inside it
    slots = max(1, sum(len(d) for d in corpus.by_source.values()) // args.batch_size)
    trainer = Trainer(module, StepSlots(slots), collate, prepare, options=options, run=session.run,
                      dist_=session.dist, device=session.device)
    return fit_student(trainer, student, session, args, "longdoc", lambda: (
        f"{len(corpus.keys)} documents from {len(weights)} sources ({', '.join(sources)}), "
        f"{len(corpus.pairs)} short pairs, {trainer.total_steps} steps, curriculum {stages}"))


INIT_TEACHER = "init"
POSITION_WEIGHT = "embeddings.position_embeddings.weight"


def train_positions_only(encoder: torch.nn.Module, first: int) -> None:
    """Freeze every parameter of ``encoder`` but the position embeddings of token positions ``first`` and up.
    The rows below get a zero gradient (so AdamW leaves them exactly as they are, with no weight decay on the
    table: ``POSITION_WEIGHT`` goes in ``no_decay``): an input of at most ``first`` tokens never reads a
    trained row, so it embeds bit for bit as before, at every hash count."""
    table, rows = encoder.embeddings.position_embeddings.weight, encoder.embeddings.max_positions
    if not 0 < first < rows:
        raise ValueError(f"--train-positions-from must be in 1..{rows - 1} (the model has {rows} positions), "
                         f"got {first}")
    for p in encoder.parameters():
        p.requires_grad_(False)
    table.requires_grad_(True)
    keep = torch.zeros(table.shape[0], 1, dtype=table.dtype, device=table.device)
    keep[first + POSITION_OFFSET:] = 1
    table.register_hook(lambda grad: grad * keep)


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


