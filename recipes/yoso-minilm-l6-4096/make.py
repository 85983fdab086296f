"""The recipe of the bundled default model ``yoso-minilm-l6-4096`` (``make default-model``).

Stages, each resumable and each writing under ``--work`` (default ``runs/default-model``)::

    data      Python docs (python3.11-doc) → JSONL: passages, long documents, topic labels;
              train / held-out split by page
    distill   all-MiniLM-L6-v2 → YOSO student (4096 positions), LSH attention in training
    refine    the student gains a YOSO-C value convolution (zero-initialised, so it starts as the
              distilled student) and distils further with it
    longdoc-data  Debian documentation packages → long documents (longdocs.py); PostgreSQL's kept out
    longdoc   contrastive long-document training of the refined student (spans → whole documents,
              short pairs, distillation on short texts), a length curriculum up to 4096 tokens
    longdoc2  the same training continued on whole 4096-token crops with harder contrast: a queue of
              1024 recent documents (about 128 of any one source: same-source negatives), a lower
              starting temperature, twice the short pairs and twice the distillation weight
    longdoc3  stage four continued with neighbouring documents (12 consecutive in key order) as each
              step's batch, and the temperature at 250× the model's lr
    longdoc-data-wide  the same documents plus seven more doc packages (``WIDE_SOURCES``) among the
              training sources, into longdoc-data-wide/ (the PostgreSQL documents are the same)
    longdoc4  stage five continued on the wider corpus with a quarter of the distillation weight
    longdoc-data-unseen  seven more doc packages no stage trains on (``UNSEEN_SOURCES``), into
              longdoc-data-unseen/transfer_docs.jsonl: a second source kept out
    serve-settings  the serving settings (int8 hashing) into the config.json of stage six's model and of the
              final one: the piece stages train with the served hashing, and every evaluation below
              measures what is served; and the final model's score_center (the cosine /rerank scores
              0.5), measured on short pairs of the training sources' held-out pages
    longdoc5  stage six continued with a third loss on the pieces of the one pass: span → the mean token
              states of the crop's consecutive 128-token pieces (``--w-segment``), so that a document indexed
              piece by piece beats chunks of the same size encoded alone
    longdoc6  stage seven continued with pieces of 64 or 128 tokens (one size drawn per step)
    longdoc7  stage eight continued as it (another seed)
    eval      student and the plain converted model against the teacher on held-out text; deep and
              short retrieval on held-out documents and on the sources kept out (the seven packages as
              two corpora of 300 documents), one vector per document and 128-token pieces
    finetune  topic classification (documentation area of a section): student and teacher
    bundle    fp16 copy + MODEL_CARD.md (+ training.json) into model/bundled/, only if the final
              model's deep retrieval on the source kept out beats every earlier stage's

``python -m yoso_serve.model.train.default_model all`` runs every stage in order; the model
that is evaluated and bundled is the long-document one (``final_model``).

``compare --model DIR [--baseline DIR]`` (not a stage of ``all``) scores a candidate against the bundle on the
corpora the targets are judged on, paired query by query (compare.py).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from collections import Counter, defaultdict
from pathlib import Path

from .longdocs import TRAIN_SOURCES, UNSEEN_SOURCES, WIDE_SOURCES, prepare_corpus
from .pydocs import DEFAULT_HTML_ROOT, is_heldout, iter_pages, topic_of, write_jsonl

NAME = "yoso-minilm-l6-4096"
BUNDLE_DIR = Path(__file__).resolve().parents[1] / "bundled" / NAME
PASSAGE_WORDS = 160  # ≈ 200–250 word pieces: under the teacher's 256-token training length
LONG_TOKENS = (2048, 4000)  # held-out "long documents" (special tokens leave room under 4096)
TOPIC_CAP = 60  # sections per topic in the classification training set: balanced, and CPU-sized
MIN_TOPIC_HELDOUT = 8
EVAL_TEXTS = 128  # held-out passages scored per hash count (every pair enters the Spearman)
EVAL_LONG_DOCS = 8


def passages(text_blocks: list[str], words: int = PASSAGE_WORDS) -> list[str]:
    """Pack consecutive paragraphs into passages of at most ``words`` words (long ones are cut)."""
    out, cur = [], []
    for block in text_blocks:
        toks = block.split()
        while toks:
            room = words - len(cur)
            if room <= 0:
                out.append(" ".join(cur))
                cur, room = [], words
            cur.extend(toks[:room])
            toks = toks[room:]
    if len(cur) >= 8:
        out.append(" ".join(cur))
    return out


def long_documents(pages, tokenizer, lo: int, hi: int) -> list[dict]:
    """Pages as consecutive sections whose token count lands in [lo, hi] (pages cut at a section edge)."""
    docs = []
    for rel, sections in pages:
        text, n = "", 0
        for sec in sections:
            candidate = (text + "\n" + sec.text).strip()
            m = len(tokenizer.encode([candidate])[0])
            if m > hi:
                break
            text, n = candidate, m
        if n >= lo:
            docs.append({"text": text, "doc": rel, "tokens": n})
    return docs


def prepare_data(out: Path, html_root: Path, tokenizer) -> dict:
    """Write the JSONL files of every later stage; returns (and saves) their row counts."""
    split: dict[str, list] = {"train": [], "heldout": []}
    for rel, sections in iter_pages(html_root):
        split["heldout" if is_heldout(rel) else "train"].append((rel, sections))
    counts = {}
    for side, pages in split.items():
        rows = [{"text": p, "doc": rel} for rel, secs in pages for p in passages([s.text for s in secs])]
        counts[f"{side}_passages"] = write_jsonl(out / f"{side}_passages.jsonl", rows)
        counts[f"{side}_long"] = write_jsonl(out / f"{side}_long.jsonl", long_documents(pages, tokenizer, *LONG_TOKENS))
    topics = {side: [{"text": s.text, "label": topic_of(rel), "doc": rel} for rel, secs in pages for s in secs
                     if len(s.text.split()) >= 20 and topic_of(rel) != "misc"] for side, pages in split.items()}
    held = Counter(r["label"] for r in topics["heldout"])
    keep = sorted(t for t, n in held.items() if n >= MIN_TOPIC_HELDOUT)
    by_topic = defaultdict(list)
    for row in topics["train"]:
        if row["label"] in keep:
            by_topic[row["label"]].append(row)
    rng = random.Random(0)
    train_rows = []
    for label in keep:
        rows = by_topic[label]
        rng.shuffle(rows)
        train_rows.extend(rows[:TOPIC_CAP])
    rng.shuffle(train_rows)
    counts["topics_train"] = write_jsonl(out / "topics_train.jsonl", train_rows)
    counts["topics_heldout"] = write_jsonl(out / "topics_heldout.jsonl",
                                           [r for r in topics["heldout"] if r["label"] in keep])
    counts["topics"] = keep
    counts["pages"] = {side: len(pages) for side, pages in split.items()}
    (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts


def _cli(argv: list[str]) -> None:
    from .cli import main

    print("+ yoso-train " + " ".join(argv), file=sys.stderr, flush=True)
    code = main(argv)
    if code:
        raise SystemExit(code)


DISTILL_STEPS = 1100  # ≈ 2.2 epochs of the passages; ≈ 80 min on 2 CPU cores


def _stage_argv(work: Path, teacher: Path, minutes: float, resume: bool, *, stage: str, student: list[str],
                model: list[str], schedule: list[str], seed: int) -> list[str]:
    """The ``yoso-train distill`` command of one distillation stage: the flags every stage shares
    (data, lengths, hash counts and family, gradient, dropout, batch, logging) around its own."""
    argv = ["distill", "--teacher", str(teacher), "--data", str(work / "data" / "train_passages.jsonl"), *student,
            "--out", str(work / stage), "--max-length", "256", "--train-hashes", "0,32",
            "--serve-hashes", "32", "--hash-family", "gaussian", "--exact-backward", "true", "--dropout", "0",
            *model, *schedule, "--save-every", "50", "--log-every", "10", "--seed", str(seed), "--save-fp16"]
    if minutes:
        argv += ["--max-minutes", str(minutes)]
    return argv + (["--resume"] if resume else [])


def distill_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage one: the converted teacher."""
    return _stage_argv(work, teacher, minutes, resume, stage="distill", student=[], model=[],
                       schedule=["--epochs", "3", "--max-steps", str(DISTILL_STEPS), "--batch-size", "16",
                                 "--lr", "1.5e-4", "--warmup", "0.03"], seed=0)


REFINE_STEPS = 800  # ≈ 55 min on 2 CPU cores
CONV_WINDOW = 33  # YOSO-C as in the paper's LRA runs (Nyströmformer's 33-wide convolution)


def finished(run: Path) -> bool:
    """Whether the training run in ``run`` last stopped because its schedule was done."""
    from .runtime import read_events  # torch: only once a stage runs

    stops = read_events(run, "stop")
    return bool(stops) and stops[-1].get("reason") == "done"


def final_model(work: Path) -> Path:
    return work / "longdoc7" / "model"


def refine_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage two: the distilled student plus a zero-initialised YOSO-C convolution, trained at a low
    learning rate for the rest and 40× that for the new kernels (AdamW moves a zero-initialised
    weight about lr per step: at 5e-5 they would stay near zero for the whole stage)."""
    return _stage_argv(work, teacher, minutes, resume, stage="refine",
                       student=["--student", str(work / "distill" / "model")],
                       model=["--conv-window", str(CONV_WINDOW), "--conv-lr-scale", "40"],
                       schedule=["--epochs", "1", "--max-steps", str(REFINE_STEPS), "--batch-size", "16",
                                 "--lr", "5e-5", "--warmup", "0.05"], seed=1)


LONGDOC_STEPS = 240  # ≈ 5–8 hours on 2 CPU cores, most of it in the 4096-token stage
LONGDOC_CURRICULUM = "1024:0.35,2048:0.7,4096:1"


def longdoc_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage three: contrastive long-document training of the refined student. Documents run at the
    served 32 hashes with the served projections, spans and short texts exactly (what `auto` serves
    them with)."""
    argv = ["longdoc", "--model", str(work / "refine" / "model"), "--teacher", str(teacher),
            "--data", str(work / "longdoc-data" / "train_docs.jsonl"), "--out", str(work / "longdoc"),
            "--batch-size", "4", "--spans-per-doc", "4", "--short-pairs", "16", "--queue", "128",
            "--curriculum", LONGDOC_CURRICULUM, "--doc-hashes", "32", "--query-hashes", "0", "--lr", "3e-5",
            "--warmup", "0.05", "--max-steps", str(LONGDOC_STEPS), "--save-every", "10", "--log-every", "1",
            "--seed", "0", "--save-fp16"]
    if minutes:
        argv += ["--max-minutes", str(minutes)]
    return argv + (["--resume"] if resume else [])


def _harder_argv(work: Path, teacher: Path, minutes: float, resume: bool, *, start: str, stage: str, steps: int,
                 seed: int, neighbourhood: int = 0, data: str = "longdoc-data", w_distill: str = "2",
                 segments: str = "") -> list[str]:
    """The ``yoso-train longdoc`` command of stages four to nine: the model of stage ``start`` trained on
    whole 4096-token crops of the documents in ``data`` with a 1024-document queue, a starting temperature
    of 0.03, 32 short pairs and distillation weight ``w_distill``; with ``neighbourhood``, a step's
    documents come from that many consecutive documents of one source and the temperature learns at 250×
    the lr; with ``segments`` (piece sizes, e.g. ``64,128``), the span → piece loss at weight 1."""
    near = (["--neighbourhood", str(neighbourhood), "--temperature", "0.03", "--temperature-lr-scale", "250"]
            if neighbourhood else ["--temperature", "0.03"])
    argv = ["longdoc", "--model", str(work / start / "model"), "--teacher", str(teacher),
            "--data", str(work / data / "train_docs.jsonl"), "--out", str(work / stage),
            "--batch-size", "4", "--spans-per-doc", "4", "--short-pairs", "32", "--queue", "1024", *near,
            "--w-distill", w_distill, "--curriculum", "4096:1", "--doc-hashes", "32", "--query-hashes", "0",
            "--lr", "2e-5", "--warmup", "0.02", "--max-steps", str(steps), "--save-every", "10",
            "--log-every", "1", "--seed", str(seed), "--save-fp16"]
    if segments:
        argv += ["--w-segment", "1", "--segment-tokens", segments]
    if minutes:
        argv += ["--max-minutes", str(minutes)]
    return argv + (["--resume"] if resume else [])


LONGDOC2_STEPS = 360  # ≈ 4–5 hours on 2 CPU cores at 4096 tokens


def longdoc2_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage four: stage three's model trained on, with harder contrast. After stage three, the in-batch
    task was solved (span top-1 ≈ 0.95 among 4 documents) and its 128-document queue held ~16 documents
    of the batch's source; deep retrieval had stopped improving while agreement with the teacher on short
    texts fell (1 − cos 0.07 → 0.12). So: 1024 queued documents, a starting temperature of 0.03, 32 short
    pairs and the distillation weight doubled."""
    return _harder_argv(work, teacher, minutes, resume, start="longdoc", stage="longdoc2", steps=LONGDOC2_STEPS,
                        seed=1)


LONGDOC3_STEPS = 160  # ≈ 70 min on 2 CPU cores at 4096 tokens


def longdoc3_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage five: stage four's model with neighbouring documents as the hard negatives. Of stage four's
    misses on the source kept out, a quarter landed on a page with the same name prefix (`arrays` →
    `functions-array`): neighbouring topics. So each step's documents come from 12 consecutive documents
    of a source in key order (pages of one section), and the temperature, which had not moved at the
    model's lr (0.0300 → 0.0300 in stage four), gets 250× it."""
    return _harder_argv(work, teacher, minutes, resume, start="longdoc2", stage="longdoc3", steps=LONGDOC3_STEPS,
                        seed=2, neighbourhood=12)


LONGDOC4_STEPS = 100  # ≈ 32 min on 2 CPU cores at 4096 tokens


def longdoc4_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage six: stage five's model continued as stage five on the wider corpus (``longdoc-data-wide``:
    seven more doc packages among the training sources) with the distillation weight at 0.5 instead of 2.
    Five other continuations of stage five (smaller neighbourhoods, more spans, mined neighbours, a higher
    lr, the wider corpus at weight 2) had landed at or below it on the source kept out; this one gained
    (docs/training.md)."""
    return _harder_argv(work, teacher, minutes, resume, start="longdoc3", stage="longdoc4", steps=LONGDOC4_STEPS,
                        seed=7, neighbourhood=12, data="longdoc-data-wide", w_distill="0.5")


SEGMENT_STEPS = 100  # each of stages seven to nine: ≈ 25–37 min on 2 CPU cores at 4096 tokens


def _segment_argv(work: Path, teacher: Path, minutes: float, resume: bool, *, start: str, stage: str, seed: int,
                  segments: str) -> list[str]:
    """Stages seven to nine: stage six's recipe (neighbourhood 12, the wider corpus, distillation weight
    0.5) plus the span → piece loss, from the model of stage ``start``."""
    return _harder_argv(work, teacher, minutes, resume, start=start, stage=stage, steps=SEGMENT_STEPS, seed=seed,
                        neighbourhood=12, data="longdoc-data-wide", w_distill="0.5", segments=segments)


def longdoc5_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage seven: stage six's model with a third loss on its pieces. Indexed piece by piece, stage six's
    one pass lost to the teacher's windows of the same size (0.866 vs 0.887 recall@1 at 128 tokens on the
    source kept out): no loss had scored anything but the mean of all token states. Each span now also
    finds the 128-token pieces of its own block among the batch's pieces (docs/training.md, item 8)."""
    return _segment_argv(work, teacher, minutes, resume, start="longdoc4", stage="longdoc5", seed=11,
                         segments="128")


def longdoc6_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage eight: stage seven continued with pieces of 64 or 128 tokens, one size drawn per step."""
    return _segment_argv(work, teacher, minutes, resume, start="longdoc5", stage="longdoc6", seed=12,
                         segments="64,128")


def longdoc7_argv(work: Path, teacher: Path, minutes: float, resume: bool) -> list[str]:
    """Stage nine: stage eight continued as stage eight with another seed."""
    return _segment_argv(work, teacher, minutes, resume, start="longdoc6", stage="longdoc7", seed=13,
                         segments="64,128")


# Settings the final model is evaluated and served with, written into its config.json after training.
# hash_int8: LSH codes from int8 rows and planes, ~3× faster hashing on AVX-512 VNNI CPUs; deep retrieval on
# the source kept out moved within noise with it (docs/benchmarks.md, "Int8 hashing").
SERVED_SETTINGS = {"hash_int8": True}


# The model the piece stages start from: serve-settings writes into it too, so that they train (and save)
# with the served hashing, as they were first run.
SERVED_FROM = "longdoc4"


# Short pairs of the held-out pages of the training sources (never the sources kept out, which measure
# transfer) from which serve-settings measures the final model's score_center (retrieval.calibrate_center).
CALIBRATION_DATA = ("longdoc-data-wide", "heldout_docs.jsonl")


def write_score_center(model_dir: Path, data: Path) -> dict:
    """Measure ``score_center`` of the model in ``model_dir`` on the documents of ``data`` (JSONL) and write it
    into its config.json; returns the measurement."""
    from yoso_serve.model import load_pretrained

    from .retrieval import calibrate_center

    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    found = calibrate_center(load_pretrained(model_dir), rows)
    update_config(model_dir, {"score_center": found["score_center"]})
    return found


def update_config(model_dir: Path, values: dict) -> dict:
    """Write ``values`` into ``model_dir``/config.json (idempotent); returns the config."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(values)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config


def apply_served_settings(model_dir: Path) -> dict:
    """Write SERVED_SETTINGS into ``model_dir``/config.json (idempotent); returns the config."""
    return update_config(model_dir, SERVED_SETTINGS)


# Training stages in pipeline order → the builder of each one's command.
STAGES = {"distill": distill_argv, "refine": refine_argv, "longdoc": longdoc_argv, "longdoc2": longdoc2_argv,
          "longdoc3": longdoc3_argv, "longdoc4": longdoc4_argv, "longdoc5": longdoc5_argv,
          "longdoc6": longdoc6_argv, "longdoc7": longdoc7_argv}


# Deep-retrieval queries per document, pooled: one draw of 300 queries has a standard error of about 0.027
# in recall@1, half the target margin, and single draws of the same model differed by up to 0.06.
QUERY_DRAWS = 3
# Documents per deep-retrieval corpus. The seven packages kept out have about twice that: retrieval-unseen-2
# takes the next RETRIEVAL_DOCS of them, a second corpus of other documents.
RETRIEVAL_DOCS = 300


def retrieval_argv(work: Path, model: Path, teacher: Path, name: str, docs: str,
                   corpus: str = "longdoc-data") -> list[str]:
    """Deep and short retrieval of ``model`` against the teacher on ``{corpus}/{docs}_docs.jsonl``,
    QUERY_DRAWS queries per document."""
    return ["eval", "--model", str(model), "--teacher", str(teacher), "--retrieval-data",
            str(work / corpus / f"{docs}_docs.jsonl"), "--out", str(work / name), "--seed", "0",
            "--query-draws", str(QUERY_DRAWS), "--retrieval-docs", str(RETRIEVAL_DOCS), "--own-windows"]


def transfer_evals(work: Path, model: Path, teacher: Path) -> dict[str, list[str]]:
    """The deep-retrieval evals the targets are judged on, name → argv: the PostgreSQL documents and the two
    corpora of the seven packages no stage trains on (the second past the first's documents), each written
    to ``work``/name."""
    return {"retrieval-transfer": retrieval_argv(work, model, teacher, "retrieval-transfer", "transfer"),
            "retrieval-unseen": retrieval_argv(work, model, teacher, "retrieval-unseen", "transfer",
                                               corpus="longdoc-data-unseen"),
            "retrieval-unseen-2": retrieval_argv(work, model, teacher, "retrieval-unseen-2", "transfer",
                                                 corpus="longdoc-data-unseen") + ["--retrieval-skip",
                                                                                  str(RETRIEVAL_DOCS)]}


PIECE_TOKENS = 128  # the piece size the piece evaluations index (the teacher's windows the same size)


def pieces_argv(work: Path, model: Path, teacher: Path, name: str, corpus: str) -> list[str]:
    """Deep retrieval as :func:`retrieval_argv` (the same queries), each document also indexed as its
    PIECE_TOKENS-token pieces: the one pass's pieces against the teacher's windows of that size."""
    return retrieval_argv(work, model, teacher, name, "transfer", corpus) + [
        "--window", str(PIECE_TOKENS), "--segment", str(PIECE_TOKENS)]


def eval_argv(work: Path, model: Path, teacher: Path, name: str) -> list[str]:
    data = work / "data"
    return ["eval", "--model", str(model), "--teacher", str(teacher), "--data", str(data / "heldout_passages.jsonl"),
            "--long-data", str(data / "heldout_long.jsonl"), "--out", str(work / name), "--hashes", "0,8,16,32,64",
            "--long-hashes", "32", "--max-texts", str(EVAL_TEXTS), "--max-long-docs", str(EVAL_LONG_DOCS),
            "--seed", "0"]


def finetune_argv(work: Path, model: Path, name: str) -> list[str]:
    """Topic fine-tuning, the same recipe for the teacher and the student. The student trains in exact
    mode (the true gradient; LSH training follows the paper's lower bound, which fine-tunes far
    worse here) and is scored at the 32 hashes it is served with."""
    data = work / "data"
    return ["finetune", "--model", str(model), "--data", str(data / "topics_train.jsonl"),
            "--test-data", str(data / "topics_heldout.jsonl"), "--out", str(work / name), "--epochs", "4",
            "--max-length", "128", "--batch-size", "16", "--lr", "3e-4", "--seed", "0",
            "--hashes", "0", "--eval-hashes", "32"]


# Long-document corpora: stage (and directory under --work) → prepare_corpus's sources. longdoc-data-unseen
# trains nothing: its transfer documents are the seven packages no stage trains on, a second source of transfer.
CORPORA = {"longdoc-data": {"train_sources": TRAIN_SOURCES}, "longdoc-data-wide": {"train_sources": WIDE_SOURCES},
           "longdoc-data-unseen": {"train_sources": (), "transfer_sources": UNSEEN_SOURCES}}

EVALS = ("eval-converted", "eval-student", "retrieval-transfer", "retrieval-unseen", "retrieval-unseen-2",
         "retrieval-heldout",
         "retrieval-refined", "retrieval-longdoc", "retrieval-longdoc2", "retrieval-longdoc3", "retrieval-longdoc4",
         "pieces-transfer", "pieces-unseen")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="default_model", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("data", *CORPORA, *STAGES, "serve-settings", "eval", *EVALS, "finetune",
                                      "topics-teacher", "topics-student", "bundle", "all", "compare"))
    p.add_argument("--work", type=Path, default=Path("runs/default-model"))
    p.add_argument("--html-root", type=Path, default=DEFAULT_HTML_ROOT)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="time limit of each distillation stage (0 = full schedule)")
    p.add_argument("--model", type=Path, help="compare: the candidate model directory")
    p.add_argument("--baseline", type=Path,
                   help="compare: the model it is compared with (default: the bundled model)")
    args = p.parse_args(argv)
    if (args.stage == "compare") != (args.model is not None) or args.baseline and args.stage != "compare":
        p.error("--model (with --baseline optional) goes with the compare stage, and compare needs --model")
    try:
        return _run_stages(args)
    except ValueError as exc:  # a bad path or data: one line, as yoso-train says it
        print(f"default_model {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"default_model {args.stage}: error: {exc}", file=sys.stderr)
        return 1


def _run_stages(args: argparse.Namespace) -> int:
    from yoso_serve.model import TextTokenizer
    from yoso_serve.model.default import minilm_dir

    teacher = minilm_dir()
    work = args.work
    runs = {
        "eval-converted": lambda: _cli(eval_argv(work, work / "distill" / "init", teacher, "eval-converted")),
        "eval-student": lambda: _cli(eval_argv(work, final_model(work), teacher, "eval-student")),
        **{name: (lambda argv=argv: _cli(argv))
           for name, argv in transfer_evals(work, final_model(work), teacher).items()},
        "retrieval-heldout": lambda: _cli(retrieval_argv(work, final_model(work), teacher, "retrieval-heldout",
                                                         "heldout")),
        "retrieval-refined": lambda: _cli(retrieval_argv(work, work / "refine" / "model", teacher,
                                                         "retrieval-refined", "transfer")),
        "retrieval-longdoc": lambda: _cli(retrieval_argv(work, work / "longdoc" / "model", teacher,
                                                         "retrieval-longdoc", "transfer")),
        "retrieval-longdoc2": lambda: _cli(retrieval_argv(work, work / "longdoc2" / "model", teacher,
                                                          "retrieval-longdoc2", "transfer")),
        "retrieval-longdoc3": lambda: _cli(retrieval_argv(work, work / "longdoc3" / "model", teacher,
                                                          "retrieval-longdoc3", "transfer")),
        "retrieval-longdoc4": lambda: _cli(retrieval_argv(work, work / "longdoc4" / "model", teacher,
                                                          "retrieval-longdoc4", "transfer")),
        "pieces-transfer": lambda: _cli(pieces_argv(work, final_model(work), teacher, "pieces-transfer",
                                                    "longdoc-data")),
        "pieces-unseen": lambda: _cli(pieces_argv(work, final_model(work), teacher, "pieces-unseen",
                                                  "longdoc-data-unseen")),
        "topics-teacher": lambda: _cli(finetune_argv(work, teacher, "topics-teacher")),
        "topics-student": lambda: _cli(finetune_argv(work, final_model(work), "topics-student")),
    }
    if args.stage == "compare":
        from .compare import run_compare
        from yoso_serve.model.default import bundled_model_dir

        baseline = args.baseline or bundled_model_dir()
        if baseline is None:
            raise ValueError("no bundled model to compare with: pass --baseline")
        run_compare(work, args.model, baseline, transfer_evals(work, args.model, teacher), _cli)
        return 0
    groups = {"eval": list(EVALS), "finetune": ["topics-teacher", "topics-student"]}
    order = ["data", "distill", "refine", "longdoc-data", "longdoc", "longdoc2", "longdoc3", "longdoc-data-wide",
             "longdoc4", "longdoc-data-unseen", "serve-settings", "longdoc5", "longdoc6", "longdoc7",
             "serve-settings", "eval", "finetune", "bundle"] \
        if args.stage == "all" else [args.stage]
    for stage in (s for group in order for s in groups.get(group, [group])):
        if stage == "data":
            print(json.dumps(prepare_data(work / "data", args.html_root, TextTokenizer.from_dir(teacher))))
        elif stage in CORPORA:
            print(json.dumps(prepare_corpus(work / stage, TextTokenizer.from_dir(teacher), **CORPORA[stage])))
        elif stage in STAGES:
            resume = (work / stage / "checkpoints" / "last.pt").is_file()
            _cli(STAGES[stage](work, teacher, args.minutes, resume))
            if not finished(work / stage):
                print(f"{stage} stopped before the end of its schedule; run the same command again to resume it",
                      file=sys.stderr)
                return 0
        elif stage == "serve-settings":
            for model in dict.fromkeys((work / SERVED_FROM / "model", final_model(work))):
                if (model / "config.json").is_file():
                    apply_served_settings(model)
                    print(f"{model}: served with {SERVED_SETTINGS}")
            final = final_model(work)
            # once per trained final model: retraining writes a config.json without it (the stages start from
            # models that never had one)
            config = final / "config.json"
            if config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("score_center") is None:
                print(f"{final}: {json.dumps(write_score_center(final, work.joinpath(*CALIBRATION_DATA)))}")
        elif stage == "bundle":
            from .model_card import bundle

            bundle(work, BUNDLE_DIR)
        else:
            shutil.rmtree(work / stage, ignore_errors=True)
            runs[stage]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
