"""The default-model recipe: passages, the model card's numbers and the bundling rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from yoso_serve.model import load_pretrained
from yoso_serve.model.train import default_model
from yoso_serve.model.train.default_model import passages
from yoso_serve.model.train.model_card import bundle


def test_passages_pack_paragraphs_up_to_the_word_limit():
    blocks = ["one two three", "four five", "six " * 17 + "end", "x"]
    out = passages(blocks, words=10)
    # paragraphs run on into the next passage; the 4-word tail ("six six end x") is dropped
    assert out == ["one two three four five six six six six six", " ".join(["six"] * 10)]
    assert passages(["tiny"], words=5) == []  # a tail of fewer than 8 words is not a passage


def _deep(student: float, refined: float | None = None) -> list[dict]:
    rows = [{"method": "student, one pass", "docs": 300, "queries": 900, "recall_at_1": student,
             "mrr_at_10": student + 0.05, "docs_per_s": 2.0},
            {"method": "teacher, 240-token windows averaged", "docs": 300, "queries": 900, "recall_at_1": 0.66,
             "mrr_at_10": 0.7, "docs_per_s": 3.0},
            {"method": "teacher, truncated at 512", "docs": 300, "queries": 900, "recall_at_1": 0.46,
             "mrr_at_10": 0.5, "docs_per_s": 9.0}]
    return rows


def stage(run: Path, config: dict, start: float, stop: float, steps: int) -> None:
    """A finished training run directory: its config and one session from ``start`` to ``stop``."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(config))
    events = [{"event": "start", "time": start, "step": 0}, {"event": "stop", "time": stop, "step": steps}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _work(tmp_path: Path, model: Path, student_recall: float, refined_recall: float, short: float = 0.9,
          stage3_recall: float = 0.5, stage4_recall: float = 0.55, stage5_recall: float = 0.58) -> Path:
    work = tmp_path / "work"
    shutil.copytree(model, work / "longdoc4" / "model")  # the final model is stage six's
    common = {"train_hashes": "0,32", "batch_size": 16, "grad_accum": 1, "max_minutes": 30.0, "teacher": "/teacher"}
    (work / "distill").mkdir()
    (work / "distill" / "config.json").write_text(json.dumps({**common, "seed": 0, "lr": 1.5e-4}))
    # stage one in two sessions: 20 min, stopped by a time limit, then 10.5 min after --resume
    events = [{"event": "start", "time": 1000.0, "step": 0}, {"event": "stop", "time": 2200.0, "step": 25},
              {"event": "resume", "time": 5000.0, "step": 25}, {"event": "start", "time": 5000.0, "step": 25},
              {"event": "stop", "time": 5630.0, "step": 40}]
    (work / "distill" / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    stage(work / "refine", {**common, "seed": 1, "lr": 5e-5, "conv_window": 33, "conv_lr_scale": 40.0}, 6000.0, 6300.0, 12)
    stage(work / "longdoc", {**common, "seed": 0, "lr": 3e-5, "batch_size": 4, "spans_per_doc": 4, "queue": 128,
                             "short_pairs": 16, "curriculum": "1024:0.35,2048:0.7,4096:1", "doc_hashes": "32",
                             "query_hashes": "0"}, 7000.0, 7600.0, 30)
    harder = {**common, "lr": 2e-5, "batch_size": 4, "spans_per_doc": 4, "queue": 1024, "short_pairs": 32,
              "curriculum": "4096:1", "doc_hashes": "32", "query_hashes": "0", "temperature": 0.03, "w_distill": 2.0}
    stage(work / "longdoc2", {**harder, "seed": 1}, 8000.0, 8900.0, 50)
    near = {"neighbourhood": 12, "temperature_lr_scale": 250.0}
    stage(work / "longdoc3", {**harder, **near, "seed": 2}, 9000.0, 9420.0, 20)
    stage(work / "longdoc4", {**harder, **near, "seed": 7, "w_distill": 0.5}, 9500.0, 9860.0, 10)
    (work / "longdoc-data").mkdir()
    (work / "longdoc-data" / "counts.json").write_text(json.dumps(
        {"train_docs": 50, "train_tokens": 1.5e6, "train_by_source": {"linux": 30, "python": 20},
         "heldout_docs": 5, "transfer_docs": 8}))
    (work / "longdoc-data-wide").mkdir()
    (work / "longdoc-data-wide" / "counts.json").write_text(json.dumps(
        {"train_docs": 65, "train_tokens": 1.9e6, "train_by_source": {"apache": 9, "linux": 30, "node": 6, "python": 20},
         "heldout_docs": 6, "transfer_docs": 8}))
    shorts = [{"method": "student", "pairs": 40, "recall_at_1": short, "mrr_at_10": 0.95},
              {"method": "teacher", "pairs": 40, "recall_at_1": 0.9, "mrr_at_10": 0.95}]
    for name, recall in (("retrieval-transfer", student_recall), ("retrieval-heldout", student_recall),
                         ("retrieval-refined", refined_recall), ("retrieval-longdoc", stage3_recall),
                         ("retrieval-longdoc2", stage4_recall), ("retrieval-longdoc3", stage5_recall)):
        (work / name).mkdir()
        (work / name / "results.json").write_text(json.dumps({"deep_retrieval": _deep(recall),
                                                              "short_retrieval": shorts}))
    (work / "data").mkdir()
    (work / "data" / "counts.json").write_text(json.dumps(
        {"pages": {"train": 9, "heldout": 1}, "train_passages": 90, "heldout_passages": 10, "heldout_long": 2,
         "topics": ["a", "b"], "topics_train": 20}))
    for name, cos in (("eval-student", 0.95), ("eval-converted", 0.85)):
        (work / name).mkdir()
        rows = [{"hashes": h, "texts": 10, "mean_cos": cos - h / 1000, "spearman": 0.9, "texts_per_s": 5.0,
                 "teacher_texts_per_s": 9.0} for h in (0, 32)]
        (work / name / "results.json").write_text(json.dumps({"agreement": rows, "long_agreement": []}))
    return work


def test_bundle_ships_only_a_student_whose_deep_retrieval_improved(tiny_yoso, tmp_path):
    target = tmp_path / "bundled" / "yoso-test"
    losing = _work(tmp_path / "lose", tiny_yoso, student_recall=0.60, refined_recall=0.62)
    assert not bundle(losing, target)
    assert not target.exists()
    card = (losing / "MODEL_CARD.md").read_text()
    assert "| student, one pass | 300 | 900 | 0.600 | 0.650 | 2.00 |" in card
    assert "| refined model (stage 2), one pass | 300 | 900 | 0.620 | 0.670 | 2.00 |" in card
    assert "| teacher, 240-token windows averaged | 300 | 900 | 0.660 | 0.700 | 3.00 |" in card
    assert "drawn 3 times per document with 3 seeds and pooled" in card
    assert "deep recall@1 at least the windowed teacher's + 0.05: not met" in card
    assert "short recall@1 at least 0.97 × the teacher's: met" in card
    assert "| stage 3's model, one pass | 300 | 900 | 0.500 | 0.550 | 2.00 |" in card
    assert "improves deep retrieval on the source kept out over every earlier stage measured: no" in card
    assert "1. distill (seed 0): the converted teacher trained 40 optimizer steps (batch 16 × 1, lr 0.00015) " \
           "in 30.5 minutes of wall-clock time over 2 session(s)" in card
    assert "2. refine (seed 1): a YOSO-C depthwise convolution over the values (width 33" in card
    assert "12 optimizer steps (batch 16 × 1, lr 5e-05, the convolution at 40× that) in 5.0 minutes" in card
    assert "3. longdoc (seed 0): 30 optimizer steps of 4 documents" in card and "in 10.0 minutes" not in card
    assert "10.0 minutes over 1 session(s)" in card
    assert "4. longdoc2 (seed 1): stage 3 continued for 50 optimizer steps on crops of 4096:1" in card
    assert "a queue of 1024 documents, a starting temperature of 0.03, 32 short pairs" in card
    assert "15.0 minutes over 1 session(s)" in card and "yoso-train longdoc --model" in card
    assert "| stage 4's model, one pass | 300 | 900 | 0.550 | 0.600 | 2.00 |" in card
    assert "5. longdoc3 (seed 2): stage 4 continued for 20 optimizer steps with neighbouring documents" in card
    assert "drawn from 12 consecutive documents of one source in key order" in card
    assert "at 250× the lr of the rest, lr 2e-05, otherwise as stage 4. 7.0 minutes over 1 session(s)" in card
    assert "--neighbourhood 12 --temperature 0.03 --temperature-lr-scale 250" in card
    assert "--conv-window 33 --conv-lr-scale 40" in card and "yoso-train longdoc --model" in card
    assert "| 32 | 0.9180 | 0.8180 |" in card  # agreement is still reported
    assert "int8 hashing" not in card  # the tiny model hashes in fp32
    assert "| stage 5's model, one pass | 300 | 900 | 0.580 | 0.630 | 2.00 |" in card
    assert "6. longdoc4 (seed 7): stage 5 continued for 10 optimizer steps on the wider corpus (Data above) with " \
           "the distillation weight at 0.5, otherwise as stage 5. 6.0 minutes over 1 session(s)." in card
    assert "Stage 6: the same plus 2 more documentation packages among the training sources (apache2-doc, " \
           "nodejs-doc; their renderings of manual pages skipped as well)" in card
    assert "65 training documents (1.9M tokens; the added sources: apache 9, node 6)" in card
    assert "--data /" in card and "longdoc-data-wide/train_docs.jsonl" in card and "--w-distill 0.5" in card
    assert "Not measured for this model (`retrieval-unseen`)." in card
    assert "The same on the seven packages" not in card and "Kept out of every stage as well" not in card


    winning = _work(tmp_path / "win", tiny_yoso, student_recall=0.75, refined_recall=0.62, short=0.85)
    (winning / "retrieval-unseen").mkdir()
    shorts = [{"method": "student", "pairs": 30, "recall_at_1": 0.5, "mrr_at_10": 0.6},
              {"method": "teacher", "pairs": 30, "recall_at_1": 0.45, "mrr_at_10": 0.55}]
    (winning / "retrieval-unseen" / "results.json").write_text(json.dumps({"deep_retrieval": _deep(0.69),
                                                                          "short_retrieval": shorts}))
    (winning / "longdoc-data-unseen").mkdir()
    (winning / "longdoc-data-unseen" / "counts.json").write_text(json.dumps(
        {"transfer_docs": 12, "transfer_by_source": {"pandas": 5, "vim": 7}}))
    default_model.apply_served_settings(winning / "longdoc4" / "model")
    assert bundle(winning, target)
    card = (target / "MODEL_CARD.md").read_text()
    assert "int8 hashing (`hash_int8`" in card and load_pretrained(target).config.hash_int8
    assert card == (winning / "MODEL_CARD.md").read_text()
    assert "deep recall@1 at least the windowed teacher's + 0.05: met" in card
    assert "short recall@1 at least 0.97 × the teacher's: not met" in card  # 0.85 < 0.97 × 0.9
    # the seven packages no stage trains on: their own table, short row and verdicts (0.69 < 0.66 + 0.05)
    unseen = card.split("Seven more documentation packages no stage trained on (python-sqlalchemy-doc, ")[1]
    assert unseen.split("Held-out pages")[0].count("| student, one pass | 300 | 900 | 0.690 | 0.740 | 2.00 |") == 1
    assert "| seven packages not trained on | student | 30 | 0.500 | 0.600 |" in card
    assert "The same on the seven packages: not met; met." in card
    assert "Kept out of every stage as well, a second measure of transfer: 12 documents of 7 more packages " \
           "(pandas 5, vim 7)." in card
    assert load_pretrained(target).config.hidden_size == 32
    # beating the refined model is not enough when stage three or four did better than the final model
    assert not bundle(_work(tmp_path / "worse", tiny_yoso, student_recall=0.70, refined_recall=0.62,
                            stage3_recall=0.72), tmp_path / "bundled-worse" / "yoso-test")
    assert not bundle(_work(tmp_path / "worse4", tiny_yoso, student_recall=0.70, refined_recall=0.62,
                            stage4_recall=0.71), tmp_path / "bundled-worse4" / "yoso-test")
    assert not bundle(_work(tmp_path / "worse5", tiny_yoso, student_recall=0.70, refined_recall=0.62,
                            stage5_recall=0.70), tmp_path / "bundled-worse5" / "yoso-test")  # a tie is not a gain


def test_a_pipeline_started_from_a_bundle_reports_its_earlier_stages_from_the_bundles_record(tiny_yoso, tmp_path):
    target = tmp_path / "bundled" / "yoso-test"
    first = _work(tmp_path / "first", tiny_yoso, student_recall=0.75, refined_recall=0.62)
    assert bundle(first, target)
    record = json.loads((target / "training.json").read_text())["stages"]
    assert {k: (v["steps"], v["minutes"], v["sessions"]) for k, v in record.items()} == \
        {"distill": (40, 30.5, 2), "refine": (12, 5.0, 1), "longdoc": (30, 10.0, 1), "longdoc2": (50, 15.0, 1),
         "longdoc3": (20, 7.0, 1), "longdoc4": (10, 6.0, 1)}
    # another machine: only the bundle (as the starting model) and a new long-document run
    again = _work(tmp_path / "again", tiny_yoso, student_recall=0.8, refined_recall=0.75)
    for name in ("distill", "refine", "retrieval-heldout"):
        shutil.rmtree(again / name)
    shutil.copytree(target, again / "refine" / "model")
    assert bundle(again, tmp_path / "bundled2" / "yoso-test")
    card = (again / "MODEL_CARD.md").read_text()
    assert "1. distill (seed 0): the converted teacher trained 40 optimizer steps (batch 16 × 1, lr 0.00015) " \
           "in 30.5 minutes of wall-clock time over 2 session(s)" in card
    assert "12 optimizer steps (batch 16 × 1, lr 5e-05, the convolution at 40× that) in 5.0 minutes" in card
    assert "Not measured for this model (`retrieval-heldout`)." in card  # a skipped eval is said, not hidden
    # without the record, the card says which stage it cannot report instead of inventing it
    (again / "refine" / "model" / "training.json").unlink()
    with pytest.raises(FileNotFoundError, match="no record of stage 'distill'"):
        bundle(again, tmp_path / "bundled3" / "yoso-test")


def test_pipeline_waits_for_a_stage_stopped_by_its_time_limit(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(default_model, "_cli", lambda argv: calls.append(argv[argv.index("--out") + 1]))
    monkeypatch.setattr(default_model, "prepare_data", lambda *a: {})
    work = tmp_path / "work"
    (work / "distill").mkdir(parents=True)
    stop = {"event": "stop", "time": 1.0, "step": 5, "reason": "time limit"}
    (work / "distill" / "metrics.jsonl").write_text(json.dumps(stop) + "\n")
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls == [str(work / "distill")]  # neither refine nor eval started from a half-trained student

    (work / "distill" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    (work / "refine").mkdir()
    (work / "refine" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    calls.clear()
    monkeypatch.setattr(default_model, "prepare_corpus", lambda out, tok, **kw: calls.append(out.name) or {})
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls == [str(work / "distill"), str(work / "refine"), "longdoc-data", str(work / "longdoc")]

    (work / "longdoc").mkdir()
    (work / "longdoc" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    calls.clear()
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls[-1] == str(work / "longdoc2")  # stage four starts after stage three finished, then waits

    (work / "longdoc2").mkdir()
    (work / "longdoc2" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    calls.clear()
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls[-1] == str(work / "longdoc3")  # and stage five after stage four

    (work / "longdoc3").mkdir()
    (work / "longdoc3" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    calls.clear()
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls[-2:] == ["longdoc-data-wide", str(work / "longdoc4")]  # stage six on the wider corpus

    (work / "longdoc4").mkdir()
    (work / "longdoc4" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    calls.clear()
    monkeypatch.setattr("yoso_serve.model.train.model_card.bundle", lambda *a: calls.append("bundle"))
    (work / "longdoc4" / "model").mkdir()
    (work / "longdoc4" / "model" / "config.json").write_text(json.dumps({"num_hash": 32, "hash_int8": False}))
    assert default_model.main(["all", "--work", str(work)]) == 0
    # the evaluations and the bundle see the served settings
    assert json.loads((work / "longdoc4" / "model" / "config.json").read_text()) == {"num_hash": 32, "hash_int8": True}
    assert calls[:9] == [str(work / "distill"), str(work / "refine"), "longdoc-data", str(work / "longdoc"),
                         str(work / "longdoc2"), str(work / "longdoc3"), "longdoc-data-wide", str(work / "longdoc4"),
                         "longdoc-data-unseen"]
    assert calls[9:18] == [str(work / n) for n in ("eval-converted", "eval-student", "retrieval-transfer",
                                                   "retrieval-unseen", "retrieval-heldout", "retrieval-refined",
                                                   "retrieval-longdoc", "retrieval-longdoc2", "retrieval-longdoc3")]
    assert calls[-1] == "bundle" and len(calls) == 21  # + topics-teacher, topics-student


def test_the_wider_corpus_and_the_unseen_packages_are_stages_of_their_own(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(default_model, "prepare_corpus", lambda out, tok, **kw: seen.append((out, kw)) or {})
    assert default_model.main(["longdoc-data-wide", "--work", str(tmp_path)]) == 0
    assert default_model.main(["longdoc-data-unseen", "--work", str(tmp_path)]) == 0
    assert seen == [(tmp_path / "longdoc-data-wide", {"train_sources": default_model.WIDE_SOURCES}),
                    (tmp_path / "longdoc-data-unseen", {"train_sources": (),
                                                        "transfer_sources": default_model.UNSEEN_SOURCES})]


def test_every_retrieval_eval_of_the_pipeline_pools_the_same_query_draws(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(default_model, "_cli", lambda argv: seen.update({argv[argv.index("--out") + 1]: argv}))
    for name in [e for e in default_model.EVALS if e.startswith("retrieval-")]:
        assert default_model.main([name, "--work", str(tmp_path)]) == 0
    assert len(seen) == 7
    for argv in seen.values():  # the final model and the earlier stages are judged on the same 3 × 300 queries
        assert argv[argv.index("--query-draws") + 1] == "3" and argv[argv.index("--seed") + 1] == "0"
    data = {Path(out).name: Path(argv[argv.index("--retrieval-data") + 1]) for out, argv in seen.items()}
    assert data["retrieval-unseen"] == tmp_path / "longdoc-data-unseen" / "transfer_docs.jsonl"
    assert data["retrieval-transfer"] == tmp_path / "longdoc-data" / "transfer_docs.jsonl"
