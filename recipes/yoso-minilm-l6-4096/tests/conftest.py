"""The recipe's modules on sys.path (the recipe is not a package), and the training tests' tiny models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RECIPE))

_spec = importlib.util.spec_from_file_location("train_conftest", RECIPE.parents[1] / "tests" / "train" / "conftest.py")
_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_train)
tiny_bert, tiny_yoso, write_jsonl_fixture, one_thread = (_train.tiny_bert, _train.tiny_yoso, _train.write_jsonl_fixture,
                                                         _train.one_thread)
