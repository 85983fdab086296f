"""Data reading: formats, streaming, bad rows counted and skipped, splits, collation."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.model.train.data import (
    Example,
    RowReport,
    detect_format,
    iter_examples,
    label_targets,
    pad_batch,
    split_train_val,
)


def test_jsonl_bad_rows_are_counted_and_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"text": "good one", "label": "a"}\n'
        b'{"text": "broken json", \n'
        b'["not", "an", "object"]\n'
        b'{"label": "b"}\n'
        b'{"text": "   ", "label": "b"}\n'
        b'{"text": "bad bytes \xff\xfe", "label": "a"}\n'
        b'\n'
        b'{"text": "multi", "labels": ["a", "b"]}\n'
        b'{"text": "no label"}\n'
        b'{"text": "int label", "label": 3}\n'
    )
    report = RowReport()
    rows = list(iter_examples(path, report, need_labels=True))
    assert rows == [Example("good one", ("a",)), Example("multi", ("a", "b")), Example("int label", ("3",))]
    assert report.kept == 3
    assert dict(report.skipped) == {"invalid JSON": 1, "not a JSON object": 1, "missing or empty text": 2,
                                    "not UTF-8": 1, "missing or invalid label": 1}
    assert report.samples[0].endswith(":2: invalid JSON")
    assert "6 skipped" in report.summary()


def test_unlabelled_jsonl_keeps_rows_without_label(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n{"text": "y", "label": "z"}\n')
    report = RowReport()
    assert [e.text for e in iter_examples(path, report)] == ["x", "y"]
    assert report.total_skipped == 0


def test_csv_with_quoted_newlines_bad_columns_and_multilabel(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(
        b'text,labels\n'
        b'"first, with comma",a\n'
        b'"spans\ntwo lines",a|b\n'
        b'too,many,columns\n'
        b',a\n'
        b'"bad \xff byte",a\n'
        b'last,b\n'
    )
    report = RowReport()
    rows = list(iter_examples(path, report, need_labels=True))
    assert [r.text for r in rows] == ["first, with comma", "spans\ntwo lines", "last"]
    assert rows[1].labels == ("a", "b")
    assert dict(report.skipped) == {"wrong number of columns": 1, "missing or empty text": 1, "not UTF-8": 1}


def test_csv_without_text_column_is_a_clear_error(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("body,label\nx,y\n")
    with pytest.raises(ValueError, match="'text' column"):
        list(iter_examples(path, RowReport()))


def test_text_files_one_example_per_line_and_no_labels(tmp_path):
    path = tmp_path / "d.txt"
    path.write_bytes(b"one\n\n  two  \nthree \xff\n")
    report = RowReport()
    assert [e.text for e in iter_examples(path, report)] == ["one", "two"]
    assert report.skipped["not UTF-8"] == 1
    with pytest.raises(ValueError, match="no labels"):
        list(iter_examples(path, RowReport(), need_labels=True))


def test_reading_is_lazy(tmp_path):
    # a streaming reader yields the first row before it has seen the malformed tail
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n' * 3 + "garbage\n")
    report = RowReport()
    it = iter_examples(path, report)
    assert next(it).text == "a"
    assert report.total_skipped == 0
    list(it)
    assert report.total_skipped == 1


def test_formats_and_missing_file(tmp_path):
    assert [detect_format(n) for n in ("a.jsonl", "a.JSON", "a.csv", "a.txt", "a")] == \
        ["jsonl", "jsonl", "csv", "text", "text"]
    with pytest.raises(ValueError, match="not found"):
        list(iter_examples(tmp_path / "nope.jsonl", RowReport()))


def test_split_is_seeded_disjoint_and_complete():
    a = split_train_val(100, 0.2, seed=3)
    assert a == split_train_val(100, 0.2, seed=3)
    assert a != split_train_val(100, 0.2, seed=4)
    train, val = a
    assert len(val) == 20 and not set(train) & set(val) and sorted(train + val) == list(range(100))
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(10, 1.5, seed=0)


def test_label_targets_single_and_multi():
    ex = [Example("x", ("b",)), Example("y", ("a", "c"))]
    l2i = {"a": 0, "b": 1, "c": 2}
    assert label_targets(ex[:1], l2i, multi_label=False).tolist() == [1]
    assert label_targets(ex, l2i, multi_label=True).tolist() == [[0, 1, 0], [1, 0, 1]]


def test_pad_batch_right_pads_with_mask():
    items = [{"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32), "labels": torch.tensor(1)},
             {"input_ids": torch.tensor([8], dtype=torch.int32), "labels": torch.tensor(0)}]
    b = pad_batch(items, pad_id=9)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["input_ids"].dtype == torch.long and b["labels"].tolist() == [1, 0]
