"""The default-model recipe: passages, the model card's numbers and the bundling rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def _work(tmp_path: Path, model: Path, student_cos: float, converted_cos: float) -> Path:
    work = tmp_path / "work"
    shutil.copytree(model, work / "refine" / "model")  # the final model is stage two's
    common = {"train_hashes": "0,32", "batch_size": 16, "grad_accum": 1, "max_minutes": 30.0, "teacher": "/teacher"}
    (work / "distill").mkdir()
    (work / "distill" / "config.json").write_text(json.dumps({**common, "seed": 0, "lr": 1.5e-4}))
    (work / "refine" / "config.json").write_text(json.dumps(
        {**common, "seed": 1, "lr": 5e-5, "conv_window": 33, "conv_lr_scale": 40.0}))
    # stage one in two sessions: 20 min, stopped by a time limit, then 10.5 min after --resume
    events = [{"event": "start", "time": 1000.0, "step": 0}, {"event": "stop", "time": 2200.0, "step": 25},
              {"event": "resume", "time": 5000.0, "step": 25}, {"event": "start", "time": 5000.0, "step": 25},
              {"event": "stop", "time": 5630.0, "step": 40}]
    (work / "distill" / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    events = [{"event": "start", "time": 6000.0, "step": 0}, {"event": "stop", "time": 6300.0, "step": 12}]
    (work / "refine" / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (work / "data").mkdir()
    (work / "data" / "counts.json").write_text(json.dumps(
        {"pages": {"train": 9, "heldout": 1}, "train_passages": 90, "heldout_passages": 10, "heldout_long": 2,
         "topics": ["a", "b"], "topics_train": 20}))
    for name, cos in (("eval-student", student_cos), ("eval-converted", converted_cos)):
        (work / name).mkdir()
        rows = [{"hashes": h, "texts": 10, "mean_cos": cos - h / 1000, "spearman": 0.9, "texts_per_s": 5.0,
                 "teacher_texts_per_s": 9.0} for h in (0, 32)]
        (work / name / "results.json").write_text(json.dumps({"agreement": rows, "long_agreement": []}))
    return work


def test_bundle_ships_only_a_student_that_beats_the_conversion(tiny_yoso, tmp_path):
    target = tmp_path / "bundled" / "yoso-test"
    losing = _work(tmp_path / "lose", tiny_yoso, student_cos=0.80, converted_cos=0.85)
    assert not bundle(losing, target)
    assert not target.exists()
    card = (losing / "MODEL_CARD.md").read_text()
    assert "| 32 | 0.7680 | 0.8180 |" in card and "Student beats the plain converted model at 32 hashes: no" in card
    assert "Targets met: cos_exact no, cos_32 no, spearman_32 no, spearman_exact no" in card
    assert "1. distill (seed 0): the converted teacher trained 40 optimizer steps (batch 16 × 1, lr 0.00015) " \
           "in 30.5 minutes of wall-clock time over 2 session(s)" in card
    assert "2. refine (seed 1): a YOSO-C depthwise convolution over the values (width 33" in card
    assert "12 optimizer steps (batch 16 × 1, lr 5e-05, the convolution at 40× that) in 5.0 minutes" in card
    assert "--conv-window 33 --conv-lr-scale 40" in card

    winning = _work(tmp_path / "win", tiny_yoso, student_cos=0.95, converted_cos=0.85)
    assert bundle(winning, target)
    assert (target / "MODEL_CARD.md").read_text() == (winning / "MODEL_CARD.md").read_text()
    assert load_pretrained(target).config.hidden_size == 32


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
    monkeypatch.setattr("yoso_serve.model.train.model_card.bundle", lambda *a: calls.append("bundle"))
    assert default_model.main(["all", "--work", str(work)]) == 0
    assert calls[:2] == [str(work / "distill"), str(work / "refine")] and calls[-1] == "bundle"
    assert len(calls) == 7  # + eval-converted, eval-student, topics-teacher, topics-student
