"""A job killed with SIGKILL mid-run, then run again: every id exactly once, every vector a clean run's, and
no partial part ever visible."""

from __future__ import annotations

import os
import signal

import numpy as np
import pyarrow.parquet as pq
import pytest

from yoso_serve.service.corpus import CorpusError, embed_corpus
from yoso_serve.service.corpus.store import OutputStore

N_DOCS = 1500


def _corpus(k, path):
    rows = [{"id": f"d{i}", "text": t} for i, t in enumerate(k.texts(N_DOCS, seed=5, low=3, high=90))]
    rows.append({"id": "d0", "text": "a duplicate of the first id, last in the input"})
    return k.write_jsonl(path, rows)


def _flags(tiny_model, k):
    flags = ["--model", str(tiny_model), "--part-rows", "20"]
    for name, value in k.TINY_SETTINGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def test_killed_job_rerun_finishes_exactly_once_with_clean_vectors(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    src = _corpus(k, tmp_path / "c.jsonl")
    clean = tmp_path / "clean"
    embed_corpus([src], clean, model=tiny_model, part_rows=20, progress=False, **k.TINY_SETTINGS)
    want = k.read_output(clean)
    assert len(want) == N_DOCS

    out = tmp_path / "out"
    proc = k.start_embed("--input", str(src), "--out", str(out), *_flags(tiny_model, k))
    k.wait_for_parts(out, proc, 3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    parts = list((out / "parts").glob("part-*.parquet"))
    for part in parts:  # whatever the kill interrupted, what is visible is complete
        pq.read_table(part)
    partial = k.read_output(out)
    assert 0 < len(partial) < N_DOCS, "the kill came after the end: raise N_DOCS"
    assert k.manifest(out)["state"] == "running"

    rerun = k.start_embed("--input", str(src), "--out", str(out), *_flags(tiny_model, k))
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    m = k.manifest(out)
    assert m["state"] == "complete" and m["runs"] == 2
    assert m["counts"]["documents"] == N_DOCS and m["counts"]["already_done"] == len(partial)
    assert m["counts"]["embedded"] == N_DOCS - len(partial) and m["counts"]["repeated_ids_in_output"] == 0
    # the duplicate id is reported once, on the rerun too, though its first row was written before the kill
    assert [(b["kind"], b["where"]) for b in m["bad_rows"]] == [("duplicate_id", f"{src}:{N_DOCS + 1}")]
    got = k.read_output(out)  # fails on an id written twice
    assert set(got) == set(want)
    for doc_id, row in want.items():
        assert k.same_bits(got[doc_id]["vector"], row["vector"]) and got[doc_id]["hashes"] == row["hashes"], doc_id
    assert not list((out / "parts").glob(".*"))  # no temporary file left behind


def test_a_run_that_lost_the_folder_to_a_rerun_cannot_add_parts(tmp_path):
    """A worker that outlives its killed run (Ray finishing a task) must not add a part after the rerun has
    counted what is written: the rerun claimed the folder, so the old run's rename is refused."""
    def rows(*ids):
        return [{"id": i, "vector": np.ones(4, np.float32), "tokens": 3, "hashes": "0"} for i in ids]

    old = OutputStore(tmp_path / "out")
    old.prepare({"model_digest": "m"}, overwrite=False)
    old.write_manifest({"format": 1, "settings": {"model_digest": "m"}})
    old.write_part(rows("a"), pieces=False)
    new = OutputStore(tmp_path / "out")
    new.prepare({"model_digest": "m"}, overwrite=False)
    with pytest.raises(CorpusError, match="another run of yoso-embed took over"):
        old.write_part(rows("b"), pieces=False)
    new.write_part(rows("b"), pieces=False)
    assert sorted(pq.read_table(p).column("id")[0].as_py() for p in new.part_files()) == ["a", "b"]
    assert not list(new.parts.glob(".*"))  # the refused part's temporary file is gone
