"""Two evals of the same queries, paired: recall@1 of a baseline run (``fp32``) and of a candidate run (int8,
bf16, another model) of ``yoso-train eval``, each row of the deep table and the short pairs, and the candidate
minus the baseline query by query with its 95 % interval (a bootstrap over documents, a short pair its own
document: ``retrieval.pooled_margin``), per corpus and pooled over the corpora. Whether a difference is within
``--bar`` (issue 77: recall@1 within 0.005 of fp32) is read off the point estimate; the interval says how far
the queries can tell.

Then what the candidate does to zero-shot scores (``/rerank``, ``/classify`` with labels: sigmoid(20 (cos −
centre)), each eval at its own model's centre), where both evals wrote the short pairs' cosines: for the related
pairs (a first sentence and its own rest) and the unrelated ones (the next pair's rest), the mean, 95th percentile
and largest change of a pair's score, and the share of pairs whose score crossed 0.5.

The evals must have read the same documents, queries and short pairs (their ``*_corpus_sha256``); each corpus
is given as NAME=BASELINE_DIR,CANDIDATE_DIR (the evals' ``--out`` folders):

    .venv/bin/python bench/paired_evals.py postgresql=/tmp/pg_fp32,/tmp/pg_int8 seven=/tmp/un_fp32,/tmp/un_int8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from yoso_serve.model.train.retrieval import pooled_margin
from yoso_serve.service.zero_shot import DEFAULT_SCORE_CENTER, calibrated

SHORT = "short texts, student"


def read_eval(folder: Path) -> dict:
    path = folder / "results.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no results.json (an eval's --out folder, finished)")
    return json.loads(path.read_text(encoding="utf-8"))


def hits_of(results: dict) -> dict[str, tuple[list[int], int]]:
    """Row name → (hits, documents) of one eval: the deep table's rows and the student's short pairs (one pair a
    document). An eval from before the short pairs' hits were written has the deep rows only."""
    rows = {}
    deep = results.get("deep_hits") or {}
    for name, hits in deep.items():
        if name != "docs":
            rows[name] = (hits, deep["docs"])
    short = results.get("short_hits") or {}
    if "student" in short:
        rows[SHORT] = (short["student"], short["pairs"])
    return rows


def _row(corpus: str, measure: str, parts: list[tuple]) -> dict:
    """One table row over ``parts`` ((candidate hits, baseline hits, documents) of one corpus or several):
    baseline and candidate recall@1 over all their queries, the paired difference and its interval."""
    base = [h for _, hb, _ in parts for h in hb]
    cand = [h for hc, _, _ in parts for h in hc]
    return {"corpus": corpus, "measure": measure, "queries": len(base), "baseline": sum(base) / len(base),
            "candidate": sum(cand) / len(cand), **pooled_margin(parts)}


def per_corpus_and_pooled(parts: list[tuple[str, str, tuple]], corpora: int, row) -> list[dict]:
    """``row(corpus, measure, [part, ...])`` for each (corpus, measure, part) of ``parts``, then for each measure
    over its parts of every corpus ("pooled"), where there are several corpora and each has that measure."""
    out, pooled = [], {}
    for corpus, measure, part in parts:
        out.append(row(corpus, measure, [part]))
        pooled.setdefault(measure, []).append(part)
    if corpora > 1:
        out += [row("pooled", measure, ps) for measure, ps in pooled.items() if len(ps) == corpora]
    return out


def paired(corpora: dict[str, tuple[dict, dict]]) -> list[dict]:
    """A row per (corpus, measure) both evals of a corpus have, then each measure pooled over the corpora that
    have it: baseline and candidate recall@1, the paired difference and its interval. ValueError where two evals
    of a corpus read different documents or short pairs."""
    parts = []
    for corpus, (base, cand) in corpora.items():
        for key in ("deep_corpus_sha256", "short_corpus_sha256"):
            if base.get(key) != cand.get(key):
                raise ValueError(f"{corpus}: the two evals read different {key.split('_')[0]} queries ({key} differs)")
        a, b = hits_of(base), hits_of(cand)
        for name in [n for n in a if n in b]:
            (hb, docs), (hc, _) = a[name], b[name]
            parts.append((corpus, name, (hc, hb, docs)))
    return per_corpus_and_pooled(parts, len(corpora), _row)


def table(rows: list[dict], bar: float) -> str:
    lines = ["| corpus | measure | queries | baseline | candidate | candidate − baseline (95 % interval) | "
             f"within {bar} |", "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        within = "yes" if r["recall_at_1"] >= -bar else "**no**"
        lines.append(f"| {r['corpus']} | {r['measure']} | {r['queries']} | {r['baseline']:.3f} | {r['candidate']:.3f} "
                     f"| {r['recall_at_1']:+.4f} ({r['ci95_low']:+.3f} to {r['ci95_high']:+.3f}) | {within} |")
    return "\n".join(lines)


def served_scores(results: dict) -> dict[str, np.ndarray] | None:
    """The student's short pairs as zero-shot scores at its model's centre (the service's default where the model
    has none): {"related": ..., "unrelated": ...}, or None for an eval from before the cosines were written."""
    cos = (results.get("short_hits") or {}).get("student_cosines")
    if cos is None:
        return None
    center = DEFAULT_SCORE_CENTER if cos["score_center"] is None else cos["score_center"]
    return {kind: calibrated(np.asarray(cos[kind], dtype=np.float64), center) for kind in ("related", "unrelated")}


def score_rows(corpora: dict[str, tuple[dict, dict]]) -> list[dict]:
    """A row per (corpus, related or unrelated) and pooled over the corpora: how far the candidate moved each
    pair's zero-shot score from the baseline's (mean, 95th percentile, largest |change|, mean change) and the
    share of pairs on the other side of 0.5. Corpora whose evals lack the cosines are left out."""
    parts = []
    for corpus, (base, cand) in corpora.items():
        a, b = served_scores(base), served_scores(cand)
        if a is not None and b is not None:
            parts += [(corpus, kind, (a[kind], b[kind])) for kind in a]
    return per_corpus_and_pooled(parts, len(corpora), _score_row)


def _score_row(corpus: str, kind: str, parts: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    base, cand = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    change = cand - base
    return {"corpus": corpus, "pairs": kind, "n": len(base), "mean_abs": float(np.abs(change).mean()),
            "p95_abs": float(np.quantile(np.abs(change), 0.95)), "max_abs": float(np.abs(change).max()),
            "mean": float(change.mean()), "crossed": float(((base >= 0.5) != (cand >= 0.5)).mean())}


def score_table(rows: list[dict]) -> str:
    lines = ["| corpus | pairs | n | mean \\|change\\| | 95th pct | largest | mean change | crossed 0.5 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['corpus']} | {r['pairs']} | {r['n']} | {r['mean_abs']:.4f} | {r['p95_abs']:.4f} | "
              f"{r['max_abs']:.4f} | {r['mean']:+.4f} | {100 * r['crossed']:.1f} % |" for r in rows]
    return "\n".join(lines)


def parse_corpus(text: str) -> tuple[str, Path, Path]:
    name, sep, dirs = text.partition("=")
    parts = dirs.split(",")
    if not sep or not name or len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected NAME=BASELINE_DIR,CANDIDATE_DIR, got {text!r}")
    return name, Path(parts[0]), Path(parts[1])


def main(argv=None) -> tuple[list[dict], list[dict]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpora", nargs="+", type=parse_corpus, metavar="NAME=BASELINE_DIR,CANDIDATE_DIR")
    parser.add_argument("--bar", type=float, default=0.005, help="the largest loss of recall@1 that passes")
    args = parser.parse_args(argv)
    names = [name for name, _, _ in args.corpora]
    if len(set(names)) < len(names):
        parser.error(f"each corpus NAME once, got {names}")
    try:
        evals = {name: (read_eval(a), read_eval(b)) for name, a, b in args.corpora}
        rows = paired(evals)
    except ValueError as exc:
        parser.error(str(exc))
    print(table(rows, args.bar))
    scores = score_rows(evals)
    if scores:
        print("\nZero-shot scores, candidate against baseline (sigmoid(20 (cos - centre)) of each short pair):\n")
        print(score_table(scores))
    return rows, scores


if __name__ == "__main__":
    main()
