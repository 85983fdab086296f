"""`make.py compare`: a candidate against a baseline on the corpora issue 16's targets are judged on,
paired query by query, each model scored once."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import compare
import evals
import make as default_model
from yoso_serve.model.train import retrieval

WORDS = {"greek": "alpha beta gamma delta".split(), "code": "python module function class".split(),
         "flow": "loop while for if else".split()}
COMMON = "value list dict string number file path error".split()


def _docs(n: int, seed: int) -> list[dict]:
    rng, topics, rows = random.Random(seed), list(WORDS), []
    for d in range(n):
        words = WORDS[topics[d % len(topics)]]
        sentence = lambda n: " ".join(rng.choice(words if rng.random() < 0.4 else COMMON)  # noqa: E731
                                      for _ in range(n)).capitalize() + "."
        blocks = [sentence(6) + " " + sentence(14) for _ in range(6)]  # a short pair in every paragraph
        rows.append({"doc": f"p/{seed}/{d}", "source": "s", "page": f"p/{seed}/{d}", "blocks": blocks, "tokens": 1500})
    return rows


def _results(one_pass: list[int], windows: list[int], docs: int, corpus: str = "c", short=(0.5, 0.6)) -> dict:
    names = ("student, one pass", "teacher, 240-token windows averaged")
    return {"deep_hits": {"docs": docs, names[0]: one_pass, names[1]: windows}, "deep_corpus_sha256": corpus,
            "deep_margin": [{"student": names[0], "teacher": names[1]}],
            "short_retrieval": [{"method": "student", "recall_at_1": short[0]},
                                {"method": "teacher", "recall_at_1": short[1]}]}


def test_the_report_pairs_the_two_models_query_by_query_and_pools_the_corpora():
    a = {"retrieval-transfer": _results([1, 1, 0, 1], [0, 1, 0, 1], 2),
         "retrieval-unseen": _results([1, 0, 1], [1, 0, 0], 3, short=(0.48, 0.49))}
    b = {"retrieval-transfer": _results([1, 0, 0, 1], [0, 1, 0, 1], 2),
         "retrieval-unseen": _results([0, 0, 1], [1, 0, 0], 3, short=(0.47, 0.49))}
    report = compare.compare(a, b)
    assert [(c["corpus"], c["candidate"], c["baseline"], c["teacher_windows"]) for c in report["corpora"]] == [
        ("retrieval-transfer", 0.75, 0.5, 0.5), ("retrieval-unseen", 2 / 3, 1 / 3, 1 / 3)]
    # paired: 2 more hits in 7 queries; the interval is the stratified bootstrap's over the same pairs
    assert report["paired"]["recall_at_1"] == pytest.approx(2 / 7)
    assert report["paired"] == retrieval.pooled_margin([([1, 1, 0, 1], [1, 0, 0, 1], 2), ([1, 0, 1], [0, 0, 1], 3)])
    assert report["over_windows"]["candidate"]["recall_at_1"] == pytest.approx(2 / 7)
    assert report["over_windows"]["baseline"]["recall_at_1"] == pytest.approx(0.0)
    assert report["short"] == {"corpus": "retrieval-unseen", "candidate": 0.48, "baseline": 0.47, "teacher": 0.49,
                               "target": pytest.approx(0.97 * 0.49)}
    text = compare.table(report, "cand", "base")
    assert "| retrieval-transfer | 2 | 4 | 0.750 | 0.500 | 0.500 |" in text
    assert "paired, candidate - baseline: +0.286" in text and "target 0.475" in text
    # hits of different queries never pair
    b["retrieval-unseen"]["deep_corpus_sha256"] = "other"
    with pytest.raises(ValueError, match="retrieval-unseen: the two models' evals read different documents"):
        compare.compare(a, b)
    with pytest.raises(ValueError, match="different corpora"):
        compare.compare(a, {"retrieval-transfer": b["retrieval-transfer"]})


def test_compare_scores_each_model_once_on_the_pipelines_corpora(tiny_bert, tiny_yoso, tmp_path, monkeypatch,
                                                                  capsys, write_jsonl):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    # the candidate: the tiny student with its weights moved a little
    candidate = tmp_path / "candidate"
    shutil.copytree(tiny_yoso, candidate)
    weights = load_file(candidate / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
               for k, v in weights.items()}, candidate / "model.safetensors")
    work = tmp_path / "work"
    (work / "longdoc-data").mkdir(parents=True)
    (work / "longdoc-data-unseen").mkdir()
    write_jsonl(work / "longdoc-data" / "transfer_docs.jsonl", _docs(5, 0))
    write_jsonl(work / "longdoc-data-unseen" / "transfer_docs.jsonl", _docs(9, 1))
    monkeypatch.setattr(evals, "RETRIEVAL_DOCS", 4)  # the unseen packages' second corpus: docs 5..9
    monkeypatch.setattr("yoso_serve.model.default.minilm_dir", lambda: tiny_bert)
    runs = []
    real_cli = default_model._cli
    # the tiny teacher reads 64 positions: 16-token windows instead of 240
    monkeypatch.setattr(default_model, "_cli", lambda argv: runs.append(argv) or real_cli([*argv, "--window", "16"]))

    argv = ["compare", "--work", str(work), "--model", str(candidate), "--baseline", str(tiny_yoso)]
    assert default_model.main(argv) == 0
    # three corpora for each model, the pipeline's queries (3 draws, seed 0), without the rows it does not read
    assert len(runs) == 6
    for run in runs:
        assert run[run.index("--query-draws") + 1] == "3" and run[run.index("--seed") + 1] == "0"
        assert "--own-windows" not in run and run[run.index("--segment") + 1] == "0"
    assert {r[r.index("--model") + 1] for r in runs} == {str(candidate), str(tiny_yoso)}
    report_path = work / "compare" / f"{compare.model_key(candidate)}-vs-{compare.model_key(tiny_yoso)}.json"
    report = json.loads(report_path.read_text())
    assert [c["corpus"] for c in report["corpora"]] == ["retrieval-transfer", "retrieval-unseen", "retrieval-unseen-2"]
    assert [(c["docs"], c["queries"]) for c in report["corpora"]] == [(4, 12), (4, 12), (4, 12)]
    assert report["short"]["corpus"] == "retrieval-unseen" and 0 <= report["short"]["candidate"] <= 1
    printed = capsys.readouterr().out
    assert "paired, candidate - baseline:" in printed and str(report_path) in printed

    # the baseline's evals are kept: a second candidate costs three evals, not six; the model itself its own.
    # An eval stopped before it wrote its results (a run directory without results.json) runs again.
    base = work / "compare" / compare.model_key(tiny_yoso)
    (base / "retrieval-unseen-2" / "results.json").unlink()
    runs.clear()
    assert default_model.main(["compare", "--work", str(work), "--model", str(tiny_yoso),
                               "--baseline", str(tiny_yoso)]) == 0
    assert [Path(r[r.index("--out") + 1]) for r in runs] == [base / "retrieval-unseen-2"]
    same = json.loads((work / "compare" / f"{compare.model_key(tiny_yoso)}-vs-{compare.model_key(tiny_yoso)}.json")
                      .read_text())
    assert same["paired"] == {"recall_at_1": 0.0, "ci95_low": 0.0, "ci95_high": 0.0}


def test_compare_needs_a_model_and_only_compare_takes_one(tmp_path, capsys):
    for argv in (["compare"], ["bundle", "--model", "x"], ["eval", "--baseline", "x"]):
        with pytest.raises(SystemExit) as exc:
            default_model.main([*argv, "--work", str(tmp_path)])
        assert exc.value.code == 2
        assert "--model (with --baseline optional) goes with the compare stage" in capsys.readouterr().err
    assert default_model.main(["compare", "--model", str(tmp_path / "none"), "--work", str(tmp_path)]) == 2
    assert "none: no config.json; --model and --baseline take a saved model directory" in capsys.readouterr().err
