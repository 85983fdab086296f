"""The recipe: passages, the model card's numbers, the bundling rule and the pipeline's order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import corpus
import evals
import make as default_model
import stages
from card import bundle, targets
from python_docs import passages
from yoso_serve.model import load_pretrained
from yoso_serve.model.train import retrieval


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


def _pieces(student: float, teacher: float = 0.88) -> list[dict]:
    """deep_retrieval rows of a piece evaluation: the single-vector rows, then the two multi-vector ones."""
    return _deep(0.67)[:2] + [
        {"method": "multi-vector: teacher, each 128-token window, best", "docs": 300, "queries": 900,
         "recall_at_1": teacher, "mrr_at_10": teacher + 0.04, "docs_per_s": 3.0},
        {"method": "multi-vector: student, one pass, each 128-token segment, best", "docs": 300, "queries": 900,
         "recall_at_1": student, "mrr_at_10": student + 0.03, "docs_per_s": 2.0}]


def _work(tmp_path: Path, model: Path, student_recall: float, refined_recall: float, short: float = 0.9,
          stage3_recall: float = 0.5, stage4_recall: float = 0.55, stage5_recall: float = 0.58,
          stage6_recall: float = 0.59, pieces_recall: float | None = 0.9) -> Path:
    work = tmp_path / "work"
    shutil.copytree(model, work / "longdoc7" / "model")  # the final model is stage nine's
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
    for i, (seed, sizes) in enumerate(((11, 128), (12, "64,128"), (13, "64,128"))):
        stage(work / f"longdoc{5 + i}", {**harder, **near, "seed": seed, "w_distill": 0.5, "w_segment": 1.0,
                                         "segment_tokens": sizes}, 10000.0 + 1000 * i, 10240.0 + 1000 * i, 8)
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
                         ("retrieval-longdoc2", stage4_recall), ("retrieval-longdoc3", stage5_recall),
                         ("retrieval-longdoc4", stage6_recall)):
        (work / name).mkdir()
        (work / name / "results.json").write_text(json.dumps({"deep_retrieval": _deep(recall),
                                                              "short_retrieval": shorts}))
    if pieces_recall is not None:
        (work / "pieces-transfer").mkdir()
        (work / "pieces-transfer" / "results.json").write_text(json.dumps({"deep_retrieval": _pieces(pieces_recall),
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
    assert "minus the windowed teacher's" not in card  # results from before the eval's deep_margin table
    assert "Package versions read" not in card  # corpora counted before the versions were recorded
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
    assert "score_center" not in card  # nor was its centre measured
    assert "| stage 5's model, one pass | 300 | 900 | 0.580 | 0.630 | 2.00 |" in card
    assert "6. longdoc4 (seed 7): stage 5 continued for 10 optimizer steps on the wider corpus (Data above) with " \
           "the distillation weight at 0.5, otherwise as stage 5. 6.0 minutes over 1 session(s)." in card
    assert "Stages 6–9: the same plus 2 more documentation packages among the training sources (apache2-doc, " \
           "nodejs-doc; their renderings of manual pages skipped as well)" in card
    assert "65 training documents (1.9M tokens; the added sources: apache 9, node 6)" in card
    assert "--data /" in card and "longdoc-data-wide/train_docs.jsonl" in card and "--w-distill 0.5" in card
    assert "Not measured for this model (`retrieval-unseen`)." in card
    assert "The same on the seven packages" not in card and "Kept out of every stage as well" not in card
    assert "| stage 6's model, one pass | 300 | 900 | 0.590 | 0.640 | 2.00 |" in card
    assert "7. longdoc5 (seed 11): stage 6 continued for 8 optimizer steps with a third loss, span → piece: each " \
           "span against the mean token states of the consecutive 128-token pieces" in card
    assert "its positives the pieces of its own block, weight 1; otherwise as stage 6. 4.0 minutes" in card
    assert "8. longdoc6 (seed 12): stage 7 continued for 8 optimizer steps with pieces of 64 or 128 tokens " \
           "(one size drawn per step). 4.0 minutes over 1 session(s)." in card
    assert "9. longdoc7 (seed 13): stage 8 continued for 8 optimizer steps as stage 8" in card
    assert "--w-segment 1 --segment-tokens 128 " in card and card.count("--w-segment 1 --segment-tokens 64,128") == 2
    assert "# its nine training stages:" in card
    # the pieces: their own section, from the piece evaluation of the PostgreSQL documents
    pieces = card.split("## Pieces: each 128-token piece of the one pass its own vector")[1].split("## Short")[0]
    assert "| multi-vector: student, one pass, each 128-token segment, best | 300 | 900 | 0.900 | 0.930 | 2.00 |" \
        in pieces
    assert "| multi-vector: teacher, each 128-token window, best | 300 | 900 | 0.880 | 0.920 | 3.00 |" in pieces
    assert "Not measured for this model (`pieces-unseen`)." in pieces


    winning = _work(tmp_path / "win", tiny_yoso, student_recall=0.75, refined_recall=0.62, short=0.85)
    for corpus, packages in (("longdoc-data", {"postgresql-doc-15": "15.20-0+deb12u1", "linux-doc": "6.1"}),
                             ("longdoc-data-wide", {"linux-doc": "6.1", "nodejs-doc": None})):
        counts = winning / corpus / "counts.json"
        counts.write_text(json.dumps({**json.loads(counts.read_text()), "packages": packages}))
    (winning / "retrieval-unseen").mkdir()
    shorts = [{"method": "student", "pairs": 30, "recall_at_1": 0.5, "mrr_at_10": 0.6},
              {"method": "teacher", "pairs": 30, "recall_at_1": 0.45, "mrr_at_10": 0.55}]
    (winning / "retrieval-unseen" / "results.json").write_text(json.dumps({"deep_retrieval": _deep(0.69),
                                                                          "short_retrieval": shorts}))
    (winning / "longdoc-data-unseen").mkdir()
    (winning / "longdoc-data-unseen" / "counts.json").write_text(json.dumps(
        {"transfer_docs": 12, "transfer_by_source": {"pandas": 5, "vim": 7}}))
    # the eval's deep_margin rows (the one vector against the averaged windows, with the interval over documents)
    for name, (d, low, high) in (("retrieval-transfer", (0.09, 0.06, 0.12)), ("retrieval-unseen", (0.03, -0.01, 0.07))):
        path = winning / name / "results.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "deep_margin": [
            {"student": "student, one pass", "teacher": "teacher, 240-token windows averaged", "docs": 300,
             "queries": 900, "recall_at_1": d, "ci95_low": low, "ci95_high": high}]}))
    # the seven packages' second corpus, and every corpus's per-query hits: the margin pooled over the three
    (winning / "retrieval-unseen-2").mkdir()
    (winning / "retrieval-unseen-2" / "results.json").write_text(json.dumps({"deep_retrieval": _deep(0.72),
                                                                            "short_retrieval": shorts}))
    names = ("student, one pass", "teacher, 240-token windows averaged")
    hits = {"retrieval-transfer": ([1] * 9 + [0], [1] * 8 + [0] * 2, 5),
            "retrieval-unseen": ([1, 0, 0, 1], [0, 1, 0, 1], 2), "retrieval-unseen-2": ([1, 1, 0], [0, 1, 0], 3)}
    for name, (a, b, docs) in hits.items():
        path = winning / name / "results.json"
        res = json.loads(path.read_text())
        res["deep_hits"] = {"docs": docs, names[0]: a, names[1]: b}
        res.setdefault("deep_margin", [{"student": names[0], "teacher": names[1], "docs": docs, "queries": len(a),
                                        "recall_at_1": 1 / 3, "ci95_low": 0.0, "ci95_high": 1.0}])
        path.write_text(json.dumps(res))
    want = retrieval.pooled_margin(list(hits.values()))
    assert want["recall_at_1"] == pytest.approx(2 / 17)
    default_model.apply_served_settings(winning / "longdoc7" / "model")
    served = winning / "longdoc7" / "model" / "config.json"
    served.write_text(json.dumps({**json.loads(served.read_text()), "score_center": 0.43}))  # serve-settings' centre
    assert bundle(winning, target)
    card = (target / "MODEL_CARD.md").read_text()
    assert "int8 hashing (`hash_int8`" in card and load_pretrained(target).config.hash_int8
    assert ("Package versions read: linux-doc 6.1, nodejs-doc not installed, postgresql-doc-15 15.20-0+deb12u1. "
            "Another version of a package changes its pages") in card
    assert "Its `score_center` is 0.43: the cosine that best separates" in card
    assert load_pretrained(target).config.score_center == 0.43
    assert card == (winning / "MODEL_CARD.md").read_text()
    assert "deep recall@1 at least the windowed teacher's + 0.05: met" in card
    assert ("The one vector's recall@1 minus the windowed teacher's: +0.090 (95 % interval over documents +0.060 to "
            "+0.120) on PostgreSQL, +0.030 (95 % interval over documents -0.010 to +0.070) on the seven packages and "
            "+0.333 (95 % interval over documents +0.000 to +1.000) on their second corpus.") in card
    assert (f"Pooled over these corpora, all 10 documents of sources never trained on (17 queries; the bootstrap "
            f"resamples each corpus's documents): +0.118 (95 % interval {want['ci95_low']:+.3f} to "
            f"{want['ci95_high']:+.3f}): at or above the target's + 0.05 by its point estimate.") in card
    second = card.split("then the next (`retrieval-unseen-2`).")[1].split("Held-out pages")[0]
    assert "| student, one pass | 300 | 900 | 0.690 |" in second
    assert "| student, one pass | 300 | 900 | 0.720 |" in second
    assert "short recall@1 at least 0.97 × the teacher's: not met" in card  # 0.85 < 0.97 × 0.9
    # the seven packages no stage trains on: their own table, short row and verdicts (0.69 < 0.66 + 0.05)
    unseen = card.split("Seven more documentation packages no stage trained on (python-sqlalchemy-doc, ")[1]
    assert unseen.split("Held-out pages")[0].count("| student, one pass | 300 | 900 | 0.690 | 0.740 | 2.00 |") == 1
    assert "| seven packages not trained on | student | 30 | 0.500 | 0.600 |" in card
    assert "The same on the seven packages: not met; met; on their second corpus: met; met." in card
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
    assert not bundle(_work(tmp_path / "worse6", tiny_yoso, student_recall=0.70, refined_recall=0.62,
                            stage6_recall=0.71), tmp_path / "bundled-worse6" / "yoso-test")
    # the one vector wins, but the pieces do not beat the teacher's windows (a tie), or were not measured
    for name, pieces in (("tie", 0.88), ("unmeasured", None)):
        work = _work(tmp_path / name, tiny_yoso, student_recall=0.75, refined_recall=0.62, pieces_recall=pieces)
        assert not bundle(work, tmp_path / f"bundled-{name}" / "yoso-test")
        assert "over every earlier stage measured: yes; its 128-token pieces beat the teacher's windows of that " \
               "size there: no." in (work / "MODEL_CARD.md").read_text()
        # no per-query hits (results from before the eval wrote them): no pooled margin, and no second corpus
        assert "Pooled over" not in (work / "MODEL_CARD.md").read_text()
        assert "Not measured for this model (`retrieval-unseen-2`)." in (work / "MODEL_CARD.md").read_text()


def test_a_pipeline_started_from_a_bundle_reports_its_earlier_stages_from_the_bundles_record(tiny_yoso, tmp_path):
    target = tmp_path / "bundled" / "yoso-test"
    first = _work(tmp_path / "first", tiny_yoso, student_recall=0.75, refined_recall=0.62)
    assert bundle(first, target)
    record = json.loads((target / "training.json").read_text())["stages"]
    assert {k: (v["steps"], v["minutes"], v["sessions"]) for k, v in record.items()} == \
        {"distill": (40, 30.5, 2), "refine": (12, 5.0, 1), "longdoc": (30, 10.0, 1), "longdoc2": (50, 15.0, 1),
         "longdoc3": (20, 7.0, 1), "longdoc4": (10, 6.0, 1), "longdoc5": (8, 4.0, 1), "longdoc6": (8, 4.0, 1),
         "longdoc7": (8, 4.0, 1)}
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
    (work / "longdoc4" / "model").mkdir()
    (work / "longdoc4" / "model" / "config.json").write_text(json.dumps({"num_hash": 32, "hash_int8": False}))
    calls.clear()
    assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
    assert calls[-2:] == ["longdoc-data-unseen", str(work / "longdoc5")]  # then the piece stages
    # stage six's model got the served settings first: the piece stages train with the served hashing
    assert json.loads((work / "longdoc4" / "model" / "config.json").read_text()) == {"num_hash": 32, "hash_int8": True}

    for name in ("longdoc5", "longdoc6"):
        (work / name).mkdir()
        (work / name / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
        calls.clear()
        assert default_model.main(["all", "--work", str(work), "--minutes", "1"]) == 0
        assert calls[-1] == str(work / f"longdoc{int(name[-1]) + 1}")  # each waits for the one before

    (work / "longdoc7").mkdir()
    (work / "longdoc7" / "metrics.jsonl").write_text(json.dumps({**stop, "reason": "done"}) + "\n")
    (work / "longdoc7" / "model").mkdir()
    (work / "longdoc7" / "model" / "config.json").write_text(json.dumps({"num_hash": 32, "hash_int8": False}))
    calls.clear()
    monkeypatch.setattr("card.write_card", lambda *a: calls.append("card"))
    centred = []

    def write_center(model_dir, data):  # the measurement itself: tests/train/test_calibration.py
        centred.append((model_dir, data))
        path = model_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "score_center": 0.43}))
        return {"score_center": 0.43}

    monkeypatch.setattr(default_model, "write_score_center", write_center)
    assert default_model.main(["all", "--work", str(work)]) == 0
    # the evaluations and the bundle see the served settings, and the final model's score centre
    assert json.loads((work / "longdoc7" / "model" / "config.json").read_text()) == \
        {"num_hash": 32, "hash_int8": True, "score_center": 0.43}
    assert centred == [(work / "longdoc7" / "model", work / "longdoc-data-wide" / "heldout_docs.jsonl")]
    assert calls[:12] == [str(work / "distill"), str(work / "refine"), "longdoc-data", str(work / "longdoc"),
                          str(work / "longdoc2"), str(work / "longdoc3"), "longdoc-data-wide", str(work / "longdoc4"),
                          "longdoc-data-unseen", str(work / "longdoc5"), str(work / "longdoc6"),
                          str(work / "longdoc7")]
    assert calls[12:25] == [str(work / n) for n in ("eval-converted", "eval-student", "retrieval-transfer",
                                                    "retrieval-unseen", "retrieval-unseen-2", "retrieval-heldout",
                                                    "retrieval-refined", "retrieval-longdoc", "retrieval-longdoc2",
                                                    "retrieval-longdoc3", "retrieval-longdoc4", "pieces-transfer",
                                                    "pieces-unseen")]
    assert calls[-1] == "card" and len(calls) == 28  # + topics-teacher, topics-student; `all` never bundles


def test_the_wider_corpus_and_the_unseen_packages_are_stages_of_their_own(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(default_model, "prepare_corpus", lambda out, tok, **kw: seen.append((out, kw)) or {})
    assert default_model.main(["longdoc-data-wide", "--work", str(tmp_path)]) == 0
    assert default_model.main(["longdoc-data-unseen", "--work", str(tmp_path)]) == 0
    assert seen == [(tmp_path / "longdoc-data-wide", {"train_sources": corpus.WIDE_SOURCES}),
                    (tmp_path / "longdoc-data-unseen", {"train_sources": (),
                                                        "transfer_sources": corpus.UNSEEN_SOURCES})]


def test_every_retrieval_eval_of_the_pipeline_pools_the_same_query_draws(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(default_model, "_cli", lambda argv: seen.update({argv[argv.index("--out") + 1]: argv}))
    for name in [e for e in default_model.EVAL_NAMES if e.startswith(("retrieval-", "pieces-"))]:
        assert default_model.main([name, "--work", str(tmp_path)]) == 0
    assert len(seen) == 11
    for argv in seen.values():  # the final model and the earlier stages are judged on the same 3 × 300 queries
        assert argv[argv.index("--query-draws") + 1] == "3" and argv[argv.index("--seed") + 1] == "0"
    data = {Path(out).name: Path(argv[argv.index("--retrieval-data") + 1]) for out, argv in seen.items()}
    assert data["retrieval-unseen"] == tmp_path / "longdoc-data-unseen" / "transfer_docs.jsonl"
    assert data["retrieval-transfer"] == tmp_path / "longdoc-data" / "transfer_docs.jsonl"
    assert data["pieces-unseen"] == data["retrieval-unseen"] and data["pieces-transfer"] == data["retrieval-transfer"]
    # the seven packages' second corpus: the same file, past the first corpus's documents; the rest skip none
    skips = {Path(out).name: argv[argv.index("--retrieval-skip") + 1] for out, argv in seen.items()
             if "--retrieval-skip" in argv}
    assert skips == {"retrieval-unseen-2": "300"} and data["retrieval-unseen-2"] == data["retrieval-unseen"]
    for name, argv in ((Path(out).name, argv) for out, argv in seen.items()):
        # the piece runs index 128-token pieces against the teacher's 128-token windows; the rest its 240 ones
        pieces = argv[argv.index("--window") + 1:argv.index("--window") + 4] if "--window" in argv else None
        assert pieces == (["128", "--segment", "128"] if name.startswith("pieces-") else None)
    final = [argv for out, argv in seen.items() if Path(out).name in ("pieces-transfer", "retrieval-transfer")]
    assert {argv[argv.index("--model") + 1] for argv in final} == {str(tmp_path / "longdoc7" / "model")}


def test_the_piece_stages_replay_the_runs_their_figures_came_from(tmp_path):
    teacher = tmp_path / "teacher"
    argvs = {name: stages.argv(stages.BY_NAME[name], tmp_path, teacher) for name in ("longdoc5", "longdoc6",
                                                                                    "longdoc7")}
    for name, (start, seed, sizes) in {"longdoc5": ("longdoc4", "11", "128"), "longdoc6": ("longdoc5", "12", "64,128"),
                                       "longdoc7": ("longdoc6", "13", "64,128")}.items():
        argv = argvs[name]
        flags = {k: argv[argv.index(k) + 1] for k in ("--model", "--seed", "--segment-tokens", "--w-segment",
                                                      "--neighbourhood", "--w-distill", "--max-steps", "--data")}
        assert flags == {"--model": str(tmp_path / start / "model"), "--seed": seed, "--segment-tokens": sizes,
                         "--w-segment": "1", "--neighbourhood": "12", "--w-distill": "0.5", "--max-steps": "100",
                         "--data": str(tmp_path / "longdoc-data-wide" / "train_docs.jsonl")}
        # otherwise stage six's recipe, flag for flag
        six = stages.argv(stages.BY_NAME["longdoc4"], tmp_path, teacher)
        strip = {"--model", "--seed", "--out", "--segment-tokens", "--w-segment", "--max-steps"}
        keep = [a for i, a in enumerate(argv) if a not in strip and (i == 0 or argv[i - 1] not in strip)]
        assert keep == [a for i, a in enumerate(six) if a not in strip and (i == 0 or six[i - 1] not in strip)]


def test_the_deep_target_is_judged_against_the_teachers_windows_not_the_students_own():
    """With `--own-windows` the eval has a second averaged-windows row, the student's: the target is the
    one pass over the *teacher's* windows, wherever that row stands."""
    own = {"method": "student, 240-token windows averaged", "docs": 300, "queries": 900, "recall_at_1": 0.80,
           "mrr_at_10": 0.85, "docs_per_s": 2.0}
    shorts = [{"method": "student", "pairs": 500, "recall_at_1": 0.6, "mrr_at_10": 0.7},
              {"method": "teacher", "pairs": 500, "recall_at_1": 0.6, "mrr_at_10": 0.7}]
    for rows in (_deep(0.72) + [own], [_deep(0.72)[0], own, *_deep(0.72)[1:]]):  # 0.72 >= 0.66 + 0.05; < 0.80
        assert targets({"deep_retrieval": rows, "short_retrieval": shorts}) == {
            "deep_recall_at_1": True, "short_recall_at_1": True}
    assert targets({"deep_retrieval": _deep(0.70) + [own], "short_retrieval": shorts})["deep_recall_at_1"] is False
