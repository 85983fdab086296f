"""Inputs: JSONL, Parquet and folders of text files; every kind of bad row counted, located and skipped."""

from __future__ import annotations

import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yoso_serve.service.corpus import CorpusError, embed_corpus


def _run(k, tiny_model, inputs, out, **kw):
    return embed_corpus(inputs, out, model=tiny_model, progress=False, **{**k.TINY_SETTINGS, **kw})


def test_bad_rows_of_every_kind_are_counted_located_and_skipped(tmp_path, tiny_model, corpus_kit, capsys):
    k = corpus_kit
    jsonl = k.write_jsonl(tmp_path / "c.jsonl", [
        {"id": "a", "text": "a good one"},                      # line 1
        b'{"id": "b", "text": oops}',                           # 2 invalid JSON
        b'{"id": "c", "text": "caf\xe9"}',                      # 3 latin-1, not UTF-8
        b'["not", "an", "object"]',                             # 4
        {"text": "no id"},                                      # 5
        {"id": 1.5, "text": "a float id"},                      # 6
        {"id": "g"},                                            # 7 no text
        {"id": "h", "text": "   \n"},                           # 8 whitespace only
        {"id": "a", "text": "the same id again"},               # 9 duplicate
        b'{"id": "j", "text": "\\ud800 lone surrogate"}',       # 10
        b"",                                                    # blank: not a row
        {"id": 7, "text": "an integer id"},                     # 12
    ])
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "ok.txt").write_text("a text file")
    (folder / "latin.txt").write_bytes(b"caf\xe9")
    (folder / "gone.txt").symlink_to(tmp_path / "nowhere")     # unreadable
    (folder / "empty.txt").write_text("")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    m = _run(k, tiny_model, [jsonl, folder, broken], tmp_path / "out")
    where = {(b["kind"], b["where"]) for b in m["bad_rows"]}
    assert where == {
        ("invalid_json", f"{jsonl}:2"), ("invalid_utf8", f"{jsonl}:3"), ("not_an_object", f"{jsonl}:4"),
        ("missing_id", f"{jsonl}:5"), ("invalid_id", f"{jsonl}:6"), ("missing_text", f"{jsonl}:7"),
        ("empty_text", f"{jsonl}:8"), ("duplicate_id", f"{jsonl}:9"), ("invalid_utf8", f"{jsonl}:10"),
        ("invalid_utf8", str(folder / "latin.txt")), ("unreadable_file", str(folder / "gone.txt")),
        ("empty_text", str(folder / "empty.txt")), ("unreadable_file", str(broken))}
    assert m["counts"]["bad"] == 13 and m["counts"]["bad_by_kind"]["invalid_utf8"] == 3
    assert m["state"] == "complete"  # bad input is never fatal
    assert set(k.read_output(tmp_path / "out")) == {"a", "7", "sub/ok.txt"}
    assert k.read_output(tmp_path / "out")["a"]["vector"] is not None
    err = capsys.readouterr().err
    for kind, loc in where:  # each one on stderr too, with its location
        assert f"skipped {loc}" in err and kind in err


def test_folder_of_text_files_ids_are_paths(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    folder = tmp_path / "notes"
    (folder / "2024" / "may").mkdir(parents=True)
    (folder / ".git").mkdir()
    docs = {"a.txt": "first note", "2024/may/b.md": "second note, longer " * 30, "2024/c": "third"}
    for name, text in docs.items():
        (folder / name).write_text(text)
    (folder / ".hidden").write_text("left out")
    (folder / ".git" / "HEAD").write_text("left out")
    m = _run(k, tiny_model, [folder], tmp_path / "out")
    rows = k.read_output(tmp_path / "out")
    assert set(rows) == set(docs) and m["counts"]["bad"] == 0
    answers = k.server_answers(tiny_model, k.TINY_SETTINGS, "/embed",
                               [{"inputs": [docs[i]], "long_input": "chunk"} for i in sorted(docs)])
    for name, answer in zip(sorted(docs), answers):
        assert k.same_bits(rows[name]["vector"], answer.json()[0])


def test_parquet_input_with_its_own_columns(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    src = tmp_path / "c.parquet"
    pq.write_table(pa.table({"doc": pa.array([10, 11, 12, 13, 14], pa.int64()),
                             "body": ["one", None, "three", "", "five " * 40],
                             "other": [1, 2, 3, 4, 5]}), src, row_group_size=2)
    m = _run(k, tiny_model, [src], tmp_path / "out", id_field="doc", text_field="body")
    assert {(b["kind"], b["where"], b["id"]) for b in m["bad_rows"]} == {
        ("missing_text", f"{src}#row=1", "11"), ("empty_text", f"{src}#row=3", "13")}
    rows = k.read_output(tmp_path / "out")
    assert set(rows) == {"10", "12", "14"}
    (answer,) = k.server_answers(tiny_model, k.TINY_SETTINGS, "/embed",
                                 [{"inputs": ["one", "three", "five " * 40], "long_input": "chunk"}])
    for i, vector in zip(("10", "12", "14"), answer.json()):
        assert k.same_bits(rows[i]["vector"], vector)
    no_column = _run(k, tiny_model, [src], tmp_path / "out2")  # default fields: no column 'id'
    assert no_column["counts"]["documents"] == 0
    assert no_column["bad_rows"][0]["kind"] == "unreadable_file" and "'id'" in no_column["bad_rows"][0]["message"]


def test_a_rerun_with_other_settings_is_refused_and_says_what_differs(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    src = k.write_jsonl(tmp_path / "c.jsonl", [{"id": str(i), "text": t} for i, t in enumerate(k.texts(4))])
    out = tmp_path / "out"
    _run(k, tiny_model, [src], out)
    again = _run(k, tiny_model, [src], out)  # the same settings: nothing left to do
    assert again["counts"]["already_done"] == 4 and again["counts"]["embedded"] == 0 and again["runs"] == 2
    with pytest.raises(CorpusError, match=r"hashes: 'auto' there, 4 now.*--overwrite"):
        _run(k, tiny_model, [src], out, hashes=4)
    with pytest.raises(CorpusError, match=r"pieces: None there, 8 now"):
        _run(k, tiny_model, [src], out, pieces=8)
    cli = subprocess.run([*k.EMBED, "--input", str(src), "--out", str(out), "--model", str(tiny_model),
                          "--runtime", "torch", "--dense-dtype", "fp32", "--auto-exact-below", "40",
                          "--chunk-overlap", "8", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "chunk_overlap: 16 there, 8 now" in cli.stderr and "Traceback" not in cli.stderr
    replaced = _run(k, tiny_model, [src], out, hashes=4, overwrite=True)
    assert replaced["counts"]["embedded"] == 4 and replaced["settings"]["hashes"] == 4
    assert {r["hashes"] for r in k.read_output(out).values()} <= {"0", "4", "4+0"}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CorpusError, match="not empty and has no manifest.json"):
        _run(k, tiny_model, [src], foreign)


def test_cli_errors_exit_2_with_a_message(tmp_path, tiny_model, corpus_kit):
    k = corpus_kit
    cases = [(["--input", str(tmp_path / "missing.jsonl")], "no such file or folder"),
             (["--input", str(tiny_model / "config.json"), "--engine", "local", "--workers", "2"],
              "--workers is for --engine ray"),
             (["--input", str(tmp_path), "--hashes", "-3"], "--hashes / YOSO_HASHES"),
             (["--input", str(tmp_path), "--pieces", "0"], "--pieces must be")]
    for args, message in cases:
        cli = subprocess.run([*k.EMBED, *args, "--out", str(tmp_path / "o"), "--model", str(tiny_model)],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and message in cli.stderr and "Traceback" not in cli.stderr, (args, cli.stderr)


def test_gpu_workers_settings_are_resolved_on_a_driver_without_a_gpu():
    """A CPU-only driver plans CUDA workers: their device and dtype are what the workers will run (the
    fingerprint a rerun must match), not the driver's."""
    from yoso_serve.service.corpus.job import _ray_settings
    from yoso_serve.service.corpus.work import resolved_settings

    gpu = resolved_settings(_ray_settings({"threads": 1}, 1))
    assert gpu["device"] == "cuda" and gpu["dtype"] == "float16"
    assert resolved_settings(_ray_settings({"threads": 1}, 0))["device"] == "cpu"
    with pytest.raises(CorpusError, match="follows --gpus-per-worker"):
        _ray_settings({"device": "cpu"}, 1)
