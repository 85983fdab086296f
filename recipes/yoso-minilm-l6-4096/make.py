"""The recipe of the bundled default model ``yoso-minilm-l6-4096`` (``make default-model``).

    python recipes/yoso-minilm-l6-4096/make.py all --work runs/default-model   # every step but the bundle
    python recipes/yoso-minilm-l6-4096/make.py bundle --work runs/default-model

Steps, each resumable and each writing under ``--work``:

    data          the Python docs (python3.11-doc) → passages, long documents, topic labels (python_docs.py)
    longdoc-data, longdoc-data-wide, longdoc-data-unseen
                  Debian documentation packages → long documents (corpus.py); PostgreSQL's kept out, and
                  the unseen corpus's seven packages trained on by no stage
    distill … longdoc7
                  the nine training stages of stages.py, each one ``yoso-train`` command
    serve-settings
                  int8 hashing into the config.json of the model the piece stages start from and of the final
                  one, and the final model's score_center, measured on held-out pages of the training sources
    eval, finetune
                  the evaluations of evals.py
    card          MODEL_CARD.md and training.json into --work, and whether the final model ships
    bundle        the last step, never part of ``all``: the card, and the model into model/bundled/ only if its
                  deep retrieval on the source kept out beats every earlier stage's and its pieces beat the
                  teacher's windows

``compare --model DIR [--baseline DIR]`` scores a candidate against the bundle on the corpora the targets are
judged on, paired query by query (compare.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recipe's modules (not an installed package)

import stages as recipe  # noqa: E402
from corpus import TRAIN_SOURCES, UNSEEN_SOURCES, WIDE_SOURCES, prepare_corpus  # noqa: E402
from evals import evals, final_model, finetunes, transfer_evals  # noqa: E402
from python_docs import DEFAULT_HTML_ROOT, prepare_data  # noqa: E402

NAME = "yoso-minilm-l6-4096"
REPO = Path(__file__).resolve().parents[2]
BUNDLE_DIR = REPO / "model" / "bundled" / NAME

# Long-document corpora: step (and directory under --work) → prepare_corpus's sources. longdoc-data-unseen
# trains nothing: its transfer documents are the seven packages no stage trains on, a second source of transfer.
CORPORA = {"longdoc-data": {"train_sources": TRAIN_SOURCES}, "longdoc-data-wide": {"train_sources": WIDE_SOURCES},
           "longdoc-data-unseen": {"train_sources": (), "transfer_sources": UNSEEN_SOURCES}}

# Settings the final model is evaluated and served with, written into its config.json after training.
# hash_int8: LSH codes from int8 rows and planes, ~3× faster hashing on AVX-512 VNNI CPUs; deep retrieval on
# the source kept out moved within noise with it (LOG.md).
SERVED_SETTINGS = {"hash_int8": True}
# The model the piece stages start from: serve-settings writes into it too, so that they train (and save)
# with the served hashing, as they were first run.
SERVED_FROM = "longdoc4"
# Short pairs of the held-out pages of the training sources (never the sources kept out, which measure
# transfer) from which serve-settings measures the final model's score_center (retrieval.calibrate_center).
CALIBRATION_DATA = ("longdoc-data-wide", "heldout_docs.jsonl")

# The order of ``all``: each corpus before the first stage that reads it; serve-settings before the piece
# stages and again after them (the final model's config.json is written by its own stage).
PIPELINE = ["data", "distill", "refine", "longdoc-data", "longdoc", "longdoc2", "longdoc3", "longdoc-data-wide",
            "longdoc4", "longdoc-data-unseen", "serve-settings", "longdoc5", "longdoc6", "longdoc7",
            "serve-settings", "eval", "finetune", "card"]


def _cli(argv: list[str]) -> None:
    from yoso_serve.model.train.cli import main

    print("+ yoso-train " + " ".join(argv), file=sys.stderr, flush=True)
    code = main(argv)
    if code:
        raise SystemExit(code)


def finished(run: Path) -> bool:
    """Whether the training run in ``run`` last stopped because its schedule was done."""
    from yoso_serve.model.train.runtime import read_events  # torch: only once a stage runs

    stops = read_events(run, "stop")
    return bool(stops) and stops[-1].get("reason") == "done"


def write_score_center(model_dir: Path, data: Path) -> dict:
    """Measure ``score_center`` of the model in ``model_dir`` on the documents of ``data`` (JSONL) and write it
    into its config.json; returns the measurement."""
    from yoso_serve.model import load_pretrained
    from yoso_serve.model.train.retrieval import calibrate_center

    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    found = calibrate_center(load_pretrained(model_dir), rows)
    update_config(model_dir, {"score_center": found["score_center"]})
    return found


def update_config(model_dir: Path, values: dict) -> dict:
    """Write ``values`` into ``model_dir``/config.json (idempotent); returns the config."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(values)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config


def apply_served_settings(model_dir: Path) -> dict:
    """Write SERVED_SETTINGS into ``model_dir``/config.json (idempotent); returns the config."""
    return update_config(model_dir, SERVED_SETTINGS)


def serve_settings(work: Path) -> None:
    for model in dict.fromkeys((recipe.model_dir(work, SERVED_FROM), final_model(work))):
        if (model / "config.json").is_file():
            apply_served_settings(model)
            print(f"{model}: served with {SERVED_SETTINGS}")
    final = final_model(work)
    # once per trained final model: retraining writes a config.json without it (the stages start from
    # models that never had one)
    config = final / "config.json"
    if config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("score_center") is None:
        print(f"{final}: {json.dumps(write_score_center(final, work.joinpath(*CALIBRATION_DATA)))}")


EVAL_NAMES = tuple(evals(Path(), Path()))
STEPS = ("data", *CORPORA, *recipe.BY_NAME, "serve-settings", "eval", *EVAL_NAMES, "finetune", "topics-teacher",
         "topics-student", "card", "bundle", "all", "compare")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make.py", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=STEPS)
    p.add_argument("--work", type=Path, default=Path("runs/default-model"))
    p.add_argument("--html-root", type=Path, default=DEFAULT_HTML_ROOT)
    p.add_argument("--minutes", type=float, default=0.0, help="time limit of each training stage (0 = full schedule)")
    p.add_argument("--model", type=Path, help="compare: the candidate model directory")
    p.add_argument("--baseline", type=Path, help="compare: the model it is compared with (default: the bundled model)")
    args = p.parse_args(argv)
    if (args.stage == "compare") != (args.model is not None) or args.baseline and args.stage != "compare":
        p.error("--model (with --baseline optional) goes with the compare stage, and compare needs --model")
    try:
        return _run(args)
    except ValueError as exc:  # a bad path or data: one line, as yoso-train says it
        print(f"make.py {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"make.py {args.stage}: error: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from yoso_serve.model import TextTokenizer
    from yoso_serve.model.default import minilm_dir

    teacher, work = minilm_dir(), args.work
    if args.stage == "compare":
        from yoso_serve.model.default import bundled_model_dir

        from compare import run_compare

        baseline = args.baseline or bundled_model_dir()
        if baseline is None:
            raise ValueError("no bundled model to compare with: pass --baseline")
        run_compare(work, args.model, baseline, transfer_evals(work, args.model, teacher), _cli)
        return 0
    runs = {**evals(work, teacher), **finetunes(work, teacher)}
    groups = {"eval": list(evals(work, teacher)), "finetune": list(finetunes(work, teacher))}
    for step in (s for group in (PIPELINE if args.stage == "all" else [args.stage]) for s in groups.get(group, [group])):
        if step == "data":
            print(json.dumps(prepare_data(work / "data", args.html_root, TextTokenizer.from_dir(teacher))))
        elif step in CORPORA:
            print(json.dumps(prepare_corpus(work / step, TextTokenizer.from_dir(teacher), **CORPORA[step])))
        elif step in recipe.BY_NAME:
            resume = (work / step / "checkpoints" / "last.pt").is_file()
            _cli(recipe.argv(recipe.BY_NAME[step], work, teacher, args.minutes, resume))
            if not finished(work / step):
                print(f"{step} stopped before the end of its schedule; run the same command again to resume it",
                      file=sys.stderr)
                return 0
        elif step == "serve-settings":
            serve_settings(work)
        elif step in ("card", "bundle"):
            import card

            ships = card.write_card(work, NAME) if step == "card" else card.bundle(work, BUNDLE_DIR)
            print(f"{work / 'MODEL_CARD.md'}: the final model {'ships' if ships else 'does not ship'}")
        else:
            shutil.rmtree(work / step, ignore_errors=True)
            _cli(runs[step])
    return 0


if __name__ == "__main__":
    sys.exit(main())
