"""The recipe's evaluations as ``yoso-train eval`` / ``finetune`` commands, and the pooling of their results.

Every retrieval eval reads the same query draws (seed 0, QUERY_DRAWS per document) of RETRIEVAL_DOCS
documents, so the final model and the earlier stages are judged on the same queries.
"""

from __future__ import annotations

from pathlib import Path

from yoso_serve.model.train.retrieval import pooled_margin

import stages as recipe

# Deep-retrieval queries per document, pooled: one draw of 300 queries has a standard error of about 0.027
# in recall@1, half the target margin, and single draws of the same model differed by up to 0.06.
QUERY_DRAWS = 3
# Documents per deep-retrieval corpus. The seven packages kept out have about twice that: retrieval-unseen-2
# takes the next RETRIEVAL_DOCS of them, a second corpus of other documents.
RETRIEVAL_DOCS = 300
PIECE_TOKENS = 128  # the piece size the piece evaluations index (the teacher's windows the same size)
EVAL_TEXTS = 128  # held-out passages scored per hash count (every pair enters the Spearman)
EVAL_LONG_DOCS = 8


def final_model(work: Path) -> Path:
    return recipe.model_dir(work, recipe.FINAL)


def retrieval_argv(work: Path, model: Path, teacher: Path, name: str, docs: str,
                   corpus: str = "longdoc-data") -> list[str]:
    """Deep and short retrieval of ``model`` against the teacher on ``{corpus}/{docs}_docs.jsonl``,
    QUERY_DRAWS queries per document."""
    return ["eval", "--model", str(model), "--teacher", str(teacher), "--retrieval-data",
            str(work / corpus / f"{docs}_docs.jsonl"), "--out", str(work / name), "--seed", "0",
            "--query-draws", str(QUERY_DRAWS), "--retrieval-docs", str(RETRIEVAL_DOCS), "--own-windows"]


def transfer_evals(work: Path, model: Path, teacher: Path) -> dict[str, list[str]]:
    """The deep-retrieval evals the targets are judged on, name → argv: the PostgreSQL documents and the two
    corpora of the seven packages no stage trains on (the second past the first's documents), each written
    to ``work``/name."""
    return {"retrieval-transfer": retrieval_argv(work, model, teacher, "retrieval-transfer", "transfer"),
            "retrieval-unseen": retrieval_argv(work, model, teacher, "retrieval-unseen", "transfer",
                                               corpus="longdoc-data-unseen"),
            "retrieval-unseen-2": retrieval_argv(work, model, teacher, "retrieval-unseen-2", "transfer",
                                                 corpus="longdoc-data-unseen") + ["--retrieval-skip",
                                                                                  str(RETRIEVAL_DOCS)]}


def pieces_argv(work: Path, model: Path, teacher: Path, name: str, corpus: str) -> list[str]:
    """Deep retrieval as :func:`retrieval_argv` (the same queries), each document also indexed as its
    PIECE_TOKENS-token pieces: the one pass's pieces against the teacher's windows of that size."""
    return retrieval_argv(work, model, teacher, name, "transfer", corpus) + [
        "--window", str(PIECE_TOKENS), "--segment", str(PIECE_TOKENS)]


def eval_argv(work: Path, model: Path, teacher: Path, name: str) -> list[str]:
    data = work / "data"
    return ["eval", "--model", str(model), "--teacher", str(teacher), "--data", str(data / "heldout_passages.jsonl"),
            "--long-data", str(data / "heldout_long.jsonl"), "--out", str(work / name), "--hashes", "0,8,16,32,64",
            "--long-hashes", "32", "--max-texts", str(EVAL_TEXTS), "--max-long-docs", str(EVAL_LONG_DOCS),
            "--seed", "0"]


def finetune_argv(work: Path, model: Path, name: str) -> list[str]:
    """Topic fine-tuning, the same recipe for the teacher and the student. The student trains in exact
    mode (the true gradient; LSH training follows the paper's lower bound, which fine-tunes far
    worse here) and is scored at the 32 hashes it is served with."""
    data = work / "data"
    return ["finetune", "--model", str(model), "--data", str(data / "topics_train.jsonl"),
            "--test-data", str(data / "topics_heldout.jsonl"), "--out", str(work / name), "--epochs", "4",
            "--max-length", "128", "--batch-size", "16", "--lr", "3e-4", "--seed", "0",
            "--hashes", "0", "--eval-hashes", "32"]


def evals(work: Path, teacher: Path) -> dict[str, list[str]]:
    """Every eval of the ``eval`` step, run directory → argv, in the order they run: the plain conversion and
    the final model against the teacher, the final model's deep retrieval, each earlier stage's on the source
    kept out (stages.py names them), the pieces."""
    final = final_model(work)
    return {"eval-converted": eval_argv(work, work / "distill" / "init", teacher, "eval-converted"),
            "eval-student": eval_argv(work, final, teacher, "eval-student"),
            **transfer_evals(work, final, teacher),
            "retrieval-heldout": retrieval_argv(work, final, teacher, "retrieval-heldout", "heldout"),
            **{s.kept_out_eval: retrieval_argv(work, recipe.model_dir(work, s.name), teacher, s.kept_out_eval,
                                               "transfer") for s in recipe.STAGES if s.kept_out_eval},
            "pieces-transfer": pieces_argv(work, final, teacher, "pieces-transfer", "longdoc-data"),
            "pieces-unseen": pieces_argv(work, final, teacher, "pieces-unseen", "longdoc-data-unseen")}


def finetunes(work: Path, teacher: Path) -> dict[str, list[str]]:
    return {"topics-teacher": finetune_argv(work, teacher, "topics-teacher"),
            "topics-student": finetune_argv(work, final_model(work), "topics-student")}


def pooled(*results: dict | None) -> dict | None:
    """The one vector's margin over the averaged windows pooled over several corpora (each an eval's results,
    with the eval's per-query ``deep_hits``), by ``retrieval.pooled_margin``: None unless every corpus has them
    (results from before the eval wrote them)."""
    corpora = []
    for res in results:
        hits, rows = (res or {}).get("deep_hits"), (res or {}).get("deep_margin")
        if not hits or not rows:
            return None
        corpora.append((hits[rows[0]["student"]], hits[rows[0]["teacher"]], hits["docs"]))
    return {**pooled_margin(corpora), "docs": sum(c[2] for c in corpora), "queries": sum(len(c[0]) for c in corpora)}
