"""A candidate model against a baseline (the bundle, by default) on the corpora issue 16's targets are judged on.

``python recipes/yoso-minilm-l6-4096/make.py compare --model CANDIDATE [--baseline MODEL]`` runs the
pipeline's three transfer evals (``evals.transfer_evals``: the same documents, the same three
query draws) on both models and prints, pooled over the three corpora, each model's one-pass margin over the
teacher's 240-token windows averaged, the candidate's recall@1 minus the baseline's on the same queries (a
paired margin with its 95 % interval over documents), and short recall@1 on the first corpus of the seven
packages (the short target: 0.97 × the teacher's there).

A model's evals are kept under ``WORK/compare/KEY``, KEY a digest of its weights and config.json, so the
baseline is scored once per machine and a checkpoint retrained in place is scored again. The evals skip the
multi-vector rows and the student's own windows, which the comparison does not read. The report is also
written to ``WORK/compare/CANDIDATE-vs-BASELINE.json``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

from yoso_serve.model.checkpoint import CheckpointError, weight_files
from yoso_serve.model.train.retrieval import pooled_margin

from evals import pooled

ONE_PASS = "student, one pass"
# The corpus the short target is judged on (LOG.md): its teacher scores 0.490.
SHORT_CORPUS = "retrieval-unseen"
SHORT_TARGET = 0.97  # × the teacher's short recall@1
DEEP_TARGET = 0.05  # over the teacher's windows averaged, recall@1


def model_key(model_dir: Path) -> str:
    """A digest of the files that decide a model's vectors: its config.json (served settings such as
    ``hash_int8`` live there) and its weights, the files the model package's one rule says they are read from."""
    digest = hashlib.sha256()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir}: no config.json; --model and --baseline take a saved model directory")
    try:
        files = [model_dir / "config.json", *weight_files(model_dir)]
    except CheckpointError as exc:
        raise ValueError(f"{exc}; --model and --baseline take a saved model directory") from None
    for path in files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def compare_argv(argv: list[str]) -> list[str]:
    """A transfer eval's argv without what the comparison does not read: the student's own windows and the
    multi-vector rows (neither changes the documents or the queries)."""
    return [a for a in argv if a != "--own-windows"] + ["--segment", "0"]


def score(model_dir: Path, argvs: dict[str, list[str]], out: Path, run: Callable[[list[str]], None]) -> dict:
    """Each eval of ``argvs`` (name → argv, whose --model and --out this rewrites) of ``model_dir``, run by
    ``run`` unless ``out``/name already holds its results; name → results."""
    results = {}
    for name, argv in argvs.items():
        argv = compare_argv(argv)
        argv[argv.index("--model") + 1] = str(model_dir)
        argv[argv.index("--out") + 1] = str(out / name)
        path = out / name / "results.json"
        if not path.is_file():
            shutil.rmtree(out / name, ignore_errors=True)  # an eval stopped before its results: start it again
            run(argv)
        results[name] = json.loads(path.read_text(encoding="utf-8"))
    return results


def compare(candidate: dict, baseline: dict) -> dict:
    """The report of two models' results (corpus name → an eval's results, the same corpora): per corpus and
    pooled, recall@1 of each one pass and of the teacher's windows, each margin over the windows, the paired
    margin candidate − baseline; short recall@1 on SHORT_CORPUS."""
    if set(candidate) != set(baseline) or not candidate:
        raise ValueError(f"the two models were scored on different corpora: {sorted(candidate)} and {sorted(baseline)}")
    corpora, pairs = [], []
    for name in candidate:
        a, b = candidate[name], baseline[name]
        if a.get("deep_corpus_sha256") is None or a.get("deep_corpus_sha256") != b.get("deep_corpus_sha256"):
            raise ValueError(f"{name}: the two models' evals read different documents or queries (a corpus rebuilt "
                             "since one of them ran?): delete the older one under WORK/compare and run again")
        windows = a["deep_margin"][0]["teacher"]
        recall = {who: sum(res["deep_hits"][ONE_PASS]) / len(res["deep_hits"][ONE_PASS])
                  for who, res in (("candidate", a), ("baseline", b))}
        teacher = sum(a["deep_hits"][windows]) / len(a["deep_hits"][windows])
        corpora.append({"corpus": name, "docs": a["deep_hits"]["docs"], "queries": len(a["deep_hits"][ONE_PASS]),
                        **recall, "teacher_windows": teacher})
        pairs.append((a["deep_hits"][ONE_PASS], b["deep_hits"][ONE_PASS], a["deep_hits"]["docs"]))
    short = {}
    if all(res.get(SHORT_CORPUS, {}).get("short_retrieval") for res in (candidate, baseline)):
        rows = {who: {r["method"]: r["recall_at_1"] for r in res[SHORT_CORPUS]["short_retrieval"]}
                for who, res in (("candidate", candidate), ("baseline", baseline))}
        short = {"corpus": SHORT_CORPUS, "candidate": rows["candidate"]["student"],
                 "baseline": rows["baseline"]["student"], "teacher": rows["candidate"]["teacher"],
                 "target": SHORT_TARGET * rows["candidate"]["teacher"]}
    over_windows = {"candidate": pooled(*candidate.values()), "baseline": pooled(*baseline.values())}
    return {"corpora": corpora, "over_windows": over_windows, "paired": pooled_margin(pairs), "short": short,
            "deep_target": DEEP_TARGET}


def _interval(m: dict) -> str:
    return f"{m['recall_at_1']:+.3f} ({m['ci95_low']:+.3f} to {m['ci95_high']:+.3f})"


def table(report: dict, candidate: str, baseline: str) -> str:
    """The report as Markdown: a row per corpus, then the pooled margins and the short texts."""
    lines = ["| corpus | docs | queries | candidate | baseline | teacher's windows averaged |", "|---|---|---|---|---|---|"]
    for c in report["corpora"]:
        lines.append(f"| {c['corpus']} | {c['docs']} | {c['queries']} | {c['candidate']:.3f} | {c['baseline']:.3f} "
                     f"| {c['teacher_windows']:.3f} |")
    windows = report["over_windows"]
    lines += ["", f"candidate: {candidate}", f"baseline:  {baseline}",
              f"pooled margin over the teacher's windows (target {report['deep_target']:+.2f}): candidate "
              f"{_interval(windows['candidate'])}, baseline {_interval(windows['baseline'])}",
              f"paired, candidate - baseline: {_interval(report['paired'])}"]
    if report["short"]:
        s = report["short"]
        lines.append(f"short recall@1 ({s['corpus']}): candidate {s['candidate']:.3f}, baseline {s['baseline']:.3f}, "
                     f"teacher {s['teacher']:.3f}, target {s['target']:.3f}")
    return "\n".join(lines)


def run_compare(work: Path, candidate: Path, baseline: Path, argvs: dict[str, list[str]],
                run: Callable[[list[str]], None]) -> dict:
    """Score both models (cached), print the table and write the report; returns it."""
    cache = work / "compare"
    keys = {"candidate": model_key(candidate), "baseline": model_key(baseline)}  # each model's files read once
    scored = {who: score(path, argvs, cache / keys[who], run)
              for who, path in (("candidate", candidate), ("baseline", baseline))}
    report = compare(scored["candidate"], scored["baseline"])
    report.update(candidate=str(candidate), baseline=str(baseline))
    path = cache / f"{keys['candidate']}-vs-{keys['baseline']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(table(report, str(candidate), str(baseline)))
    print(f"\nwritten to {path}")
    return report
