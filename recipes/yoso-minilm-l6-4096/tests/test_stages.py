"""stages.py gives the commands the nine stage functions of the old model/train/default_model.py gave, flag
for flag (old_argv.json was written by those functions before they were deleted), and so do the evals."""

from __future__ import annotations

import json
from pathlib import Path

import evals
import make
import stages

OLD = json.loads((Path(__file__).parent / "old_argv.json").read_text())
WORK, TEACHER, MODEL = Path("WORK"), Path("TEACHER"), Path("MODEL")


def test_every_stage_gives_the_old_command_with_and_without_a_time_limit_and_resume():
    seen = set()
    for key, argv in OLD.items():
        name, *rest = key.split("|")
        if name in stages.BY_NAME:
            minutes, resume = float(rest[0]), rest[1] == "True"
            assert stages.argv(stages.BY_NAME[name], WORK, TEACHER, minutes, resume) == argv, key
            seen.add(name)
    assert seen == {s.name for s in stages.STAGES} and len(stages.STAGES) == 9


def test_each_stage_starts_from_the_one_before_it_and_says_why():
    for before, stage in zip(stages.STAGES, stages.STAGES[1:]):
        assert stage.start == before.name
    assert stages.STAGES[0].start is None and all(s.why for s in stages.STAGES)


def test_the_evals_give_the_old_commands():
    for name, argv in evals.transfer_evals(WORK, MODEL, TEACHER).items():
        assert argv == OLD[f"eval|{name}"]
    assert evals.retrieval_argv(WORK, MODEL, TEACHER, "retrieval-heldout", "heldout") == OLD["eval|retrieval-heldout"]
    for corpus in ("longdoc-data", "longdoc-data-unseen"):
        assert evals.pieces_argv(WORK, MODEL, TEACHER, "pieces-x", corpus) == OLD[f"eval|pieces|{corpus}"]
    assert evals.eval_argv(WORK, MODEL, TEACHER, "eval-student") == OLD["eval|eval"]
    assert evals.finetune_argv(WORK, MODEL, "topics-student") == OLD["eval|finetune"]


def test_the_pipeline_runs_every_stage_in_the_lists_order():
    assert [s for s in make.PIPELINE if s in stages.BY_NAME] == [s.name for s in stages.STAGES]
    assert "bundle" not in make.PIPELINE  # writing into model/bundled/ is its own step
