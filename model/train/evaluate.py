"""``yoso-train eval``: agreement with a teacher, classification metrics and speed.

* ``--data``: texts cut to ``--max-length`` tokens (256 by default, the teacher's own limit):
  mean cosine of student and teacher embeddings at every ``--hashes`` count, and the
  Spearman correlation of all pairwise similarities (student pairs vs teacher pairs).
* ``--long-data``: long documents: the student's embedding of the whole text against the
  teacher's windowed embedding (mean of its windowed token states), and seconds per
  document of each.
* ``--labelled``: accuracy and F1 of the model's classification head.
* ``--retrieval-data``: held-out documents (rows as recipes/yoso-minilm-l6-4096/corpus.py writes them):
  deep retrieval (a paragraph from a document's second half → the document) for the student in one
  pass, the teacher truncated and the teacher over averaged windows, with docs/s; and short retrieval
  (first sentence → rest of a paragraph) for student and teacher (:mod:`.retrieval`).

Results go to ``results.json`` and ``metrics.jsonl`` in ``--out`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from yoso_serve.model import EncoderModel, load_pretrained
from yoso_serve.model import linear
from yoso_serve.model.linear import DENSE_DTYPES, set_dense_dtype
from yoso_serve.model.argtypes import bounded

from . import retrieval
from .common import MAX_SEED, read_texts, start
from .data import label_targets
from .embedders import embed_all
from .student import parse_hashes
from .metrics import multi_label_metrics, pairwise_upper, single_label_metrics, spearman
from .teacher import BertTeacher, pool



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="YOSO checkpoint directory")
    p.add_argument("--teacher", type=Path, help="BERT-family / sentence-transformers directory to compare with")
    p.add_argument("--data", type=Path, nargs="*", default=[], help="texts for embedding agreement")
    p.add_argument("--long-data", type=Path, nargs="*", default=[], help="long documents for windowed agreement")
    p.add_argument("--labelled", type=Path, nargs="*", default=[], help="JSONL/CSV with labels for the classifier")
    p.add_argument("--retrieval-data", type=Path, nargs="*", default=[],
                   help="document JSONL {doc, source, blocks, tokens} for deep and short retrieval")
    p.add_argument("--retrieval-docs", type=int, default=300, help="documents in the deep-retrieval corpus")
    p.add_argument("--retrieval-skip", type=int, default=0,
                   help="eligible documents passed over before the corpus is taken (a second, disjoint corpus "
                        "of a file with more than --retrieval-docs)")
    p.add_argument("--query-draws", type=int, default=1,
                   help="queries per document in deep retrieval, draw d as --seed + d would draw it (pooled)")
    p.add_argument("--query-unit", choices=("paragraph", "sentence"), default="paragraph",
                   help="deep-retrieval query: a late paragraph, or one sentence of one (context matters more)")
    p.add_argument("--retrieval-tokens", default="1200,4000", help="LO,HI token range of those documents")
    p.add_argument("--retrieval-hashes", default="auto",
                   help="student hash count in retrieval: 'auto' (the server's default: exact below the measured "
                        "crossover, the model's count above, per text) or an int (0 = exact)")
    p.add_argument("--window", type=int, default=240, help="teacher window in tokens for windowed retrieval")
    p.add_argument("--segment", type=int, default=None,
                   help="tokens per piece of the student's one pass in the multi-vector rows of deep retrieval "
                        "(default: --window, so both rows index pieces of one size; 0 = no multi-vector rows)")
    p.add_argument("--own-windows", action="store_true",
                   help="also the student over the same --window-token windows, each read alone, averaged (the "
                        "student as a chunker), and the one pass's margin over it: what reading the whole "
                        "document adds over chunking with the same model")
    p.add_argument("--short-pairs", type=int, default=500, help="pairs in the short-retrieval task")
    p.add_argument("--hashes", default="0,8,16,32,64", help="hash counts to evaluate (0 = exact)")
    p.add_argument("--long-hashes", default="32", help="hash counts for --long-data")
    p.add_argument("--dense-dtype", choices=DENSE_DTYPES, default="fp32",
                   help="the student's CPU inference GEMMs (the server's --dense-dtype); the teacher stays fp32")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--max-texts", type=bounded(int, 0), default=0,
                   help="score at most this many --data / --labelled texts")
    p.add_argument("--max-long-docs", type=bounded(int, 0), default=0,
                   help="score at most this many --long-data documents")
    p.add_argument("--batch-size", type=bounded(int, 1), default=32)
    p.add_argument("--out", required=True, type=Path, help="run directory for results.json and metrics.jsonl")
    p.add_argument("--seed", type=bounded(int, 0, MAX_SEED), default=0)
    p.add_argument("--device", default="auto")


def agreement(student: EncoderModel, teacher: BertTeacher, ids: list[torch.Tensor], hashes: list[int], *,
              batch_size: int, device: torch.device) -> list[dict]:
    """Per hash count: mean/min cosine to the teacher, Spearman of pairwise similarities, texts/s."""
    pad = student.tokenizer.pad_id
    t_emb, t_sec = embed_all(teacher.embed, ids, pad_id=pad, batch_size=batch_size, device=device, desc="teacher")
    t_pairs = pairwise_upper(t_emb)
    rows = []
    for h in hashes:
        s_emb, s_sec = embed_all(lambda i, m: student.embed(i, m, hashes=h), ids, pad_id=pad,
                                 batch_size=batch_size, device=device, desc=f"student, hashes={h}")
        cos = F.cosine_similarity(s_emb, t_emb, dim=-1)
        rows.append({"hashes": h, "texts": len(ids), "mean_cos": cos.mean().item(), "min_cos": cos.min().item(),
                     "spearman": spearman(pairwise_upper(s_emb), t_pairs),
                     "texts_per_s": len(ids) / s_sec, "teacher_texts_per_s": len(ids) / t_sec})
    return rows


@torch.no_grad()
def long_agreement(student: EncoderModel, teacher: BertTeacher, ids: list[torch.Tensor], hashes: list[int],
                   *, device: torch.device) -> list[dict]:
    """Per hash count: cosine of the student's whole-document embedding to the teacher's windowed one."""
    cls_id, sep_id = student.tokenizer.wrap([])
    targets, t_secs = [], []
    for seq in tqdm(ids, desc="teacher windows", unit="doc", dynamic_ncols=True):
        t0 = time.perf_counter()
        hidden = teacher.windowed_hidden(seq.tolist(), cls_id=cls_id, sep_id=sep_id)
        targets.append(pool(hidden[None], torch.ones(1, len(seq), device=device), teacher.pooling)[0].cpu())
        t_secs.append(time.perf_counter() - t0)
    rows = []
    for h in hashes:
        cos, secs = [], []
        for seq, target in tqdm(list(zip(ids, targets)), desc=f"long docs, hashes={h}", unit="doc",
                                dynamic_ncols=True):
            x = seq[None].long().to(device)
            t0 = time.perf_counter()
            emb = student.embed(x, torch.ones_like(x), hashes=h)[0].float().cpu()
            secs.append(time.perf_counter() - t0)
            cos.append(F.cosine_similarity(emb, target, dim=0).item())
        rows.append({"hashes": h, "docs": len(ids), "mean_tokens": sum(len(s) for s in ids) / len(ids),
                     "mean_cos": sum(cos) / len(cos), "min_cos": min(cos), "s_per_doc": sum(secs) / len(secs),
                     "teacher_windowed_s_per_doc": sum(t_secs) / len(t_secs)})
    return rows


@torch.no_grad()
def classification(model: EncoderModel, examples, ids: list[torch.Tensor], *, batch_size: int,
                   device: torch.device, hashes: int | None = None) -> dict[str, float]:
    """Accuracy / F1 of ``model.classify`` on labelled examples (labels must be in model.id2label)."""
    label2id = {v: k for k, v in model.id2label.items()}
    multi = model.config.problem_type == "multi_label_classification"
    keep = [i for i, ex in enumerate(examples) if all(x in label2id for x in ex.labels)]
    if not keep:
        raise ValueError(f"none of the labelled examples uses the model's labels {sorted(label2id)}")
    targets = label_targets([examples[i] for i in keep], label2id, multi_label=multi)
    logits, _ = embed_all(lambda i, m: model.classify(i, m, hashes=hashes), [ids[i] for i in keep],
                          pad_id=model.tokenizer.pad_id, batch_size=batch_size, device=device, desc="classify")
    metrics = multi_label_metrics(logits, targets) if multi else single_label_metrics(logits, targets, len(label2id))
    return {**metrics, "examples": len(keep), "unknown_label_rows": len(examples) - len(keep)}


TABLES = ("agreement", "long_agreement", "deep_retrieval", "deep_margin", "short_retrieval")


def retrieval_results(args: argparse.Namespace, model: EncoderModel, teacher: BertTeacher,
                      device: torch.device) -> dict:
    """The deep- and short-retrieval tables of ``--retrieval-data`` (see :mod:`.retrieval`)."""
    from .longdoc_data import read_documents

    try:
        lo, hi = (int(x) for x in args.retrieval_tokens.split(","))
        hashes = args.retrieval_hashes if args.retrieval_hashes == "auto" else int(args.retrieval_hashes)
    except ValueError:
        raise ValueError(f"--retrieval-tokens must be LO,HI and --retrieval-hashes 'auto' or an int, got "
                         f"{args.retrieval_tokens!r}, {args.retrieval_hashes!r}") from None
    if not 3 <= args.window <= teacher.max_positions:
        raise ValueError(f"--window must be in 3..{teacher.max_positions}, got {args.window}")
    if args.query_draws < 1:
        raise ValueError(f"--query-draws must be >= 1, got {args.query_draws}")
    segment = args.window if args.segment is None else args.segment
    if segment < 0:
        raise ValueError(f"--segment must be >= 0 (0 = no multi-vector rows), got {segment}")
    rows = read_documents(args.retrieval_data, "--retrieval-data")
    docs, queries = retrieval.deep_pairs(rows, lo=lo, hi=hi, max_docs=args.retrieval_docs, seed=args.seed,
                                         draws=args.query_draws, unit=args.query_unit, skip=args.retrieval_skip)
    if len(docs) < 2:
        raise ValueError(f"--retrieval-data: {len(docs)} documents of {lo}..{hi} tokens with a late paragraph; need 2")
    firsts, rests = retrieval.short_pairs(rows, max_pairs=args.short_pairs, seed=args.seed)
    emb = retrieval.Embedders(model, teacher, hashes=hashes, window=args.window, device=device)
    deep, margins, hits = retrieval.deep_retrieval(emb, docs, queries, segment=segment,
                                                     own_windows=args.own_windows)
    # what the hits are hits on: two evals' hits pair up query by query only if this matches
    corpus = hashlib.sha256("\x00".join([*docs, "\x01", *queries]).encode()).hexdigest()
    short, short_hits = retrieval.short_retrieval(emb, firsts, rests) if len(firsts) >= 2 else ([], {})
    return {"deep_retrieval": deep, "deep_margin": margins, "deep_hits": hits, "deep_corpus_sha256": corpus,
            "short_retrieval": short, "short_hits": short_hits,
            "short_corpus_sha256": hashlib.sha256("\x00".join([*firsts, "\x01", *rests]).encode()).hexdigest()}


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[k]:.4f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    session = start(args, "eval")
    if not session.dist.is_main:
        return 0
    if args.dense_dtype == "bf16" and session.device.type == "cpu" and not linear.bf16_gemms():
        raise ValueError("--dense-dtype bf16 but this CPU has no bf16 GEMM in oneDNN (it needs AVX-512); use fp32 or "
                         "int8, or bench/emulated.py for bf16's error")
    model = load_pretrained(args.model, device=session.device)
    set_dense_dtype(model, args.dense_dtype)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer files")
    teacher = BertTeacher.from_dir(args.teacher, device=session.device) if args.teacher else None
    if (args.data or args.long_data or args.retrieval_data) and teacher is None:
        raise ValueError("--data, --long-data and --retrieval-data compare with a teacher: pass --teacher")
    results: dict = {"model": str(args.model), "teacher": str(args.teacher) if args.teacher else None}
    cap = args.max_texts or None
    if args.data:
        _, ids = read_texts(session, args.data, model.tokenizer, max_length=args.max_length, name="data")
        results["agreement"] = agreement(model, teacher, ids[:cap], parse_hashes(args.hashes, "--hashes"),
                                         batch_size=args.batch_size, device=session.device)
    if args.long_data:
        _, ids = read_texts(session, args.long_data, model.tokenizer, max_length=model.config.max_length,
                            name="long_data")
        results["long_agreement"] = long_agreement(model, teacher, ids[:args.max_long_docs or None],
                                                   parse_hashes(args.long_hashes, "--long-hashes"),
                                                   device=session.device)
    if args.labelled:
        examples, ids = read_texts(session, args.labelled, model.tokenizer, max_length=args.max_length,
                                   name="labelled", need_labels=True)
        results["classification"] = classification(model, examples[:cap], ids[:cap], batch_size=args.batch_size,
                                                   device=session.device)
    if args.retrieval_data:
        results.update(retrieval_results(args, model, teacher, session.device))
    for key in TABLES:
        for row in results.get(key, []):
            session.run.log(key, **row)
    if "classification" in results:
        session.run.log("classification", **results["classification"])
    session.run.write_json("results.json", results)
    for key in TABLES:
        if results.get(key):
            print(f"\n### {key}\n\n{markdown(results[key])}")
    if "classification" in results:
        print(f"\n### classification\n\n{markdown([results['classification']])}")
    return 0
