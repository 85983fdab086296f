"""serve-settings of the recipe: the final model's score_center measured on held-out documents and written into
its config.json (retrieval.calibrate_center), once."""

from __future__ import annotations

import json
import shutil

import pytest

import make as default_model
from yoso_serve.model import load_pretrained
from yoso_serve.model.train import retrieval


def _doc(i: int) -> dict:
    topic = ["hashing attention", "bucket sorting", "token windows", "retrieval metrics"][i % 4]
    block = (f"Document {i} explains {topic} in some detail here. "
             f"It goes on about {topic} and the reasons behind {topic} for many more words than the first.")
    return {"doc": f"d{i}", "source": "test", "blocks": [block, block.replace("explains", "covers")]}


def test_write_score_center_measures_the_model_and_writes_its_config(tiny_yoso, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_yoso, model_dir)
    rows = [_doc(i) for i in range(12)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = default_model.write_score_center(model_dir, data)
    assert found["pairs"] == 12 and -1 <= found["score_center"] <= 1
    assert json.loads((model_dir / "config.json").read_text())["score_center"] == found["score_center"]
    assert load_pretrained(model_dir).config.score_center == found["score_center"]
    # the same measurement again gives the same centre (seeded pairs, seeded hashing)
    assert retrieval.calibrate_center(load_pretrained(model_dir), rows)["score_center"] == found["score_center"]
    with pytest.raises(ValueError, match="at least 2 documents"):
        retrieval.calibrate_center(load_pretrained(model_dir), rows[:1])


def test_the_pipelines_serve_settings_stage_writes_the_final_models_center(tiny_yoso, tmp_path, write_jsonl):
    work = tmp_path / "work"
    final = default_model.final_model(work)
    shutil.copytree(tiny_yoso, final)
    data = work.joinpath(*default_model.CALIBRATION_DATA)
    data.parent.mkdir(parents=True)
    write_jsonl(data, [_doc(i) for i in range(8)])
    assert default_model.main(["serve-settings", "--work", str(work)]) == 0
    config = json.loads((final / "config.json").read_text())
    assert config["hash_int8"] is True and -1 <= config["score_center"] <= 1
