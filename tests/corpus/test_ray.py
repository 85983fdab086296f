"""The Ray engine on a real local Ray (2 workers of 1 CPU): the local engine's vectors and /embed's bit for bit,
a SIGKILLed job rerun exactly once, and a worker SIGKILLed mid-job that Ray replaces."""

from __future__ import annotations

import os
import signal

import pytest

from yoso_serve.service.corpus import embed_corpus

pytest.importorskip("ray", reason="the Ray engine needs the ray extra (installed with dev)")

pytestmark = pytest.mark.slow
N_DOCS = 1200


def _flags(tiny_model, k, *extra):
    flags = ["--model", str(tiny_model), "--part-rows", "20", "--engine", "ray", "--workers", "2",
             "--threads-per-worker", "1", *extra]
    for name, value in k.TINY_SETTINGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def _clean(k, tmp_path, tiny_model):
    """A corpus and the local engine's clean run of it (one thread, as each Ray worker)."""
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": f"d{i}", "text": t}
                                              for i, t in enumerate(k.texts(N_DOCS, seed=9, low=3, high=90))])
    clean = tmp_path / "clean"
    embed_corpus([src], clean, model=tiny_model, part_rows=20, threads_per_worker=1, progress=False,
                 **k.TINY_SETTINGS)
    return src, k.read_output(clean)


def _same_as(k, got, want):
    assert set(got) == set(want)
    for doc_id, row in want.items():
        assert k.same_bits(got[doc_id]["vector"], row["vector"]) and got[doc_id]["hashes"] == row["hashes"], doc_id


def test_ray_vectors_are_the_local_engines_and_embeds(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    docs = k.texts(30, seed=8, low=1, high=200)
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": f"d{i}", "text": t} for i, t in enumerate(docs)]
                        + [b"{broken", {"id": "d3", "text": "a duplicate"}])
    local, ray = tmp_path / "local", tmp_path / "ray"
    embed_corpus([src], local, model=tiny_model, pieces=16, threads_per_worker=1, progress=False, **k.TINY_SETTINGS)
    job = k.start_embed("--input", str(src), "--out", str(ray), "--pieces", "16",
                        *_flags(tiny_model, k, "--part-rows", "4"))  # a process of its own: Ray stays out of pytest's
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr
    m = k.manifest(ray)
    assert m["state"] == "complete" and m["counts"]["documents"] == 30 and m["counts"]["parts"] == 8
    assert {(b["kind"], b["where"]) for b in m["bad_rows"]} == {("invalid_json", f"{src}:31"),
                                                                ("duplicate_id", f"{src}:32")}
    assert not (ray / "_staging").exists()
    want, got = k.read_output(local), k.read_output(ray)
    _same_as(k, got, want)
    for doc_id, row in want.items():
        assert all(k.same_bits(a, b) for a, b in zip(got[doc_id]["piece_vectors"], row["piece_vectors"]))
        assert got[doc_id]["piece_chars"] == row["piece_chars"]
    answers = k.server_answers(tiny_model, k.TINY_SETTINGS, "/embed_pieces",
                               [{"inputs": [t], "piece_tokens": 16} for t in docs])
    for i, answer in enumerate(answers):
        assert k.same_bits(got[f"d{i}"]["vector"], answer.json()[0]["embedding"])


def test_ray_job_killed_then_rerun_exactly_once(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    src, want = _clean(k, tmp_path, tiny_model)
    out = tmp_path / "out"
    proc = k.start_embed("--input", str(src), "--out", str(out), *_flags(tiny_model, k))
    k.wait_for_parts(out, proc, 2)
    k.kill_session(proc.pid)  # the driver and the Ray it started
    proc.wait(30)
    partial = k.read_output(out)
    assert 0 < len(partial) < N_DOCS, "the kill came after the end: raise N_DOCS"
    rerun = k.start_embed("--input", str(src), "--out", str(out), *_flags(tiny_model, k))
    _, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    m = k.manifest(out)
    assert m["state"] == "complete" and m["counts"]["already_done"] == len(partial)
    assert m["counts"]["documents"] == N_DOCS and m["counts"]["repeated_ids_in_output"] == 0
    _same_as(k, k.read_output(out), want)


def test_a_killed_ray_worker_is_replaced_and_the_job_completes_exactly_once(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    src, want = _clean(k, tmp_path, tiny_model)
    out = tmp_path / "out"
    proc = k.start_embed("--input", str(src), "--out", str(out), *_flags(tiny_model, k))
    try:
        k.wait_for_parts(out, proc, 1)
        workers = [p for p in k.descendants(proc.pid) if k.cmdline(p).startswith("ray::MapWorker")]
        assert workers, [k.cmdline(p) for p in k.descendants(proc.pid)]
        os.kill(workers[0], signal.SIGKILL)
        killed_at = len(list((out / "parts").glob("part-*.parquet")))
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            k.kill_session(proc.pid)
    assert proc.returncode == 0, stderr
    m = k.manifest(out)
    assert m["state"] == "complete" and m["counts"]["documents"] == N_DOCS, m["counts"]
    assert killed_at < m["counts"]["parts"]  # the kill came mid-job
    _same_as(k, k.read_output(out), want)  # fails on an id written twice
