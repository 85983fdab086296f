"""Bad input to the command-line tools: a one-line error naming the option and a non-zero exit, never a
traceback, a destroyed input or a silent wrong result."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from yoso_serve.model.train.cli import main

C = ["--device", "cpu", "--max-steps", "1", "--batch-size", "2", "--max-length", "32"]


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` → its sha256, to show a directory is byte-for-byte unchanged."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


def convert(*argv: str) -> subprocess.CompletedProcess:
    """``yoso-convert`` as a user runs it: its own process, its own exit code."""
    return subprocess.run([sys.executable, "-c", "import sys; from yoso_serve.model.convert import main; "
                           "sys.exit(main())", *argv], capture_output=True, text=True, timeout=120)


@pytest.fixture
def yoso_copy(tiny_yoso, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_yoso, tmp_path / "yoso"))


# 1. an --out that is (inside) the input directory is refused before anything is written

@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_convert_refuses_out_overlapping_the_source(tiny_bert, tmp_path, where):
    src = Path(shutil.copytree(tiny_bert, tmp_path / "src" / "bert"))
    before = digest(tmp_path / "src")
    out = {"same": src, "inside": src / "yoso", "parent": tmp_path / "src"}[where]
    result = convert("--from", str(src), "--out", str(out))
    assert result.returncode == 2
    one_line(result.stderr, "--out", "overlaps")
    assert digest(tmp_path / "src") == before


def test_export_onnx_refuses_out_overlapping_the_model(yoso_copy, capsys):
    before = digest(yoso_copy)
    for out in (yoso_copy, yoso_copy / "onnx", yoso_copy / "." / ".." / "yoso"):
        assert main(["export-onnx", "--model", str(yoso_copy), "--out", str(out)]) == 2
        one_line(capsys.readouterr().err, "--out", "overlaps")
    assert digest(yoso_copy) == before


# 2. OSError: one line, exit 1 (or 2 where it is a configuration error found first)

def test_convert_and_export_refuse_an_out_that_is_a_file(tiny_bert, tiny_yoso, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    result = convert("--from", str(tiny_bert), "--out", str(file))
    assert result.returncode == 2
    one_line(result.stderr, "--out", "not a directory")
    assert main(["export-onnx", "--model", str(tiny_yoso), "--out", str(file)]) == 2
    one_line(capsys.readouterr().err, "--out", "not a directory")
    assert file.read_text() == "x"


def test_convert_missing_source_and_unwritable_out(tiny_bert, tmp_path):
    result = convert("--from", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    one_line(result.stderr, "no config.json")
    result = convert("--from", str(tiny_bert), "--out", "/proc/x")
    assert result.returncode == 1
    one_line(result.stderr, "/proc/x")


def test_training_commands_report_os_errors_in_one_line(tiny_yoso, topic_data, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    cases = [
        (["finetune", "--model", str(tmp_path / "nothing"), "--data", str(topic_data), "--out", str(tmp_path / "a")],
         "nothing"),
        (["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(file / "run")], "file"),
        (["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", "/proc/x"], "/proc/x"),
        (["mlm", "--config", str(tmp_path), "--tokenizer", str(tiny_yoso), "--data", str(topic_data),
          "--out", str(tmp_path / "b")], str(tmp_path)),
    ]
    for argv, needle in cases:
        rc = main([*argv, *C])
        assert rc in (1, 2), argv
        one_line(capsys.readouterr().err, needle)


# 3. numbers that would train silently wrong are refused at parse time

BAD_NUMBERS = {
    "finetune": [("--max-steps", "-1"), ("--lr", "inf"), ("--lr", "-1"), ("--lr", "0"), ("--weight-decay", "nan"),
                 ("--weight-decay", "-0.1"), ("--max-grad-norm", "-1"), ("--max-grad-norm", "0"),
                 ("--max-minutes", "nan"), ("--max-minutes", "-1"), ("--dropout", "1"), ("--dropout", "-0.1"),
                 ("--seed", "-1"), ("--seed", str(2**32)), ("--eval-hashes", "-1"), ("--hashes", "100000"),
                 ("--hashes", "257")],
    "distill": [("--w-cos", "-1"), ("--w-mse", "nan"), ("--w-hidden", "inf"), ("--w-layers", "-0.5"),
                ("--serve-hashes", "-1"), ("--serve-hashes", "257"), ("--window", "-5"), ("--stride", "-1")],
    "longdoc": [("--w-short", "-1"), ("--w-distill", "nan"), ("--w-segment", "-1"), ("--temperature", "0"),
                ("--temperature", "inf")],
    "mlm": [("--hashes", "-1"), ("--mask-prob", "0")],
    "eval": [("--max-texts", "-1"), ("--max-long-docs", "-1"), ("--batch-size", "0"), ("--seed", "-3")],
    "export-onnx": [("--opset", "99"), ("--opset", "15")],
}
REQUIRED = {"finetune": ["--model", "m", "--data", "d"], "distill": ["--teacher", "t", "--data", "d"],
            "longdoc": ["--model", "m", "--teacher", "t", "--data", "d"], "mlm": ["--model", "m", "--data", "d"],
            "eval": ["--model", "m"], "export-onnx": ["--model", "m"]}


@pytest.mark.parametrize("command,option,value",
                         [(c, o, v) for c, cases in BAD_NUMBERS.items() for o, v in cases])
def test_bad_numbers_are_refused_at_parse_time(command, option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, *REQUIRED[command], "--out", "o", f"{option}={value}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {option}: must be" in err.splitlines()[-1], err


def test_good_numbers_still_parse():
    from yoso_serve.model.train.cli import build_parser

    args = build_parser().parse_args(["finetune", "--model", "m", "--data", "d", "--out", "o", "--max-steps", "0",
                                      "--lr", "1e-5", "--dropout", "0", "--seed", str(2**32 - 1), "--hashes", "256",
                                      "--max-minutes", "0", "--weight-decay", "0"])
    assert (args.max_steps, args.lr, args.dropout, args.seed, args.hashes) == (0, 1e-5, 0.0, 2**32 - 1, 256)


@pytest.mark.parametrize("option,value", [("--max-positions", "100000"), ("--max-positions", "0"),
                                          ("--num-hash", "257"), ("--num-hash", "-1")])
def test_convert_numbers_are_refused_at_parse_time(option, value, capsys):
    from yoso_serve.model.convert import main as convert_main

    with pytest.raises(SystemExit) as exit_:
        convert_main(["--from", "a", "--out", "b", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: must be in" in capsys.readouterr().err


def test_export_onnx_hash_count_is_capped(tiny_yoso, tmp_path, capsys):
    assert main(["export-onnx", "--model", str(tiny_yoso), "--out", str(tmp_path / "o"), "--hashes", "100000"]) == 2
    one_line(capsys.readouterr().err, "hashes", "256")
    assert not (tmp_path / "o").exists()
    # the cap is the exporter's own, so Python callers meet it too
    from yoso_serve.model.export import export_onnx

    with pytest.raises(ValueError, match="hashes must be <= 256"):
        export_onnx(tiny_yoso, tmp_path / "p", hashes=257)
    assert not (tmp_path / "p").exists()


def test_comma_separated_hash_counts_are_capped(tiny_bert, tiny_yoso, tmp_path, capsys, write_jsonl):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": "alpha beta"}] * 4)
    assert main(["distill", "--teacher", str(tiny_bert), "--student", str(tiny_yoso), "--data", str(data),
                 "--out", str(tmp_path / "d"), "--train-hashes", "8,100000", *C]) == 2
    one_line(capsys.readouterr().err, "--train-hashes", "256")


# 4. bad rows, configs, devices and checkpoints: a ValueError naming the option (and file:line), exit 2

LONGDOC = ["--device", "cpu", "--max-steps", "1", "--batch-size", "2", "--span-tokens", "16", "--curriculum", "64:1"]
GOOD_DOC = {"doc": "d#0", "source": "s", "blocks": ["alpha beta gamma. delta python module"], "tokens": 10}


@pytest.mark.parametrize("bad", [{"source": "s", "blocks": ["x"]}, {**GOOD_DOC, "doc": 3},
                                 {**GOOD_DOC, "blocks": ["x", 5]}, {**GOOD_DOC, "blocks": "x"}, [1, 2]])
def test_longdoc_refuses_bad_document_rows(tiny_bert, tiny_yoso, tmp_path, capsys, write_jsonl, bad):
    data = write_jsonl(tmp_path / "docs.jsonl", [GOOD_DOC, bad])
    assert main(["longdoc", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--data", str(data),
                 "--out", str(tmp_path / "o"), *LONGDOC]) == 2
    one_line(capsys.readouterr().err, "--data", f"{data}:2")


@pytest.mark.parametrize("bad", [{"source": "s", "blocks": ["x"], "tokens": 3}, {**GOOD_DOC, "tokens": "many"}])
def test_eval_refuses_bad_retrieval_rows(tiny_bert, tiny_yoso, tmp_path, capsys, write_jsonl, bad):
    data = write_jsonl(tmp_path / "docs.jsonl", [bad])
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(data),
                 "--window", "32", "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    one_line(capsys.readouterr().err, "--retrieval-data", f"{data}:1")


def test_mlm_refuses_bad_configs_and_tokenizers(tiny_yoso, tmp_path, capsys, sentences, write_jsonl):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(8)])
    config = json.loads((tiny_yoso / "config.json").read_text())
    as_list = tmp_path / "list.json"
    as_list.write_text("[1, 2]")
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**config, "vocab_size": 10}))
    no_tok = Path(shutil.copytree(tiny_yoso, tmp_path / "no-tok"))
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tok / name).unlink()
    cases = [(["--config", str(as_list), "--tokenizer", str(tiny_yoso)], ("--config", "JSON object")),
             (["--config", str(tmp_path / "none.json"), "--tokenizer", str(tiny_yoso)], ("--config", "not a file")),
             (["--config", str(small), "--tokenizer", str(tiny_yoso)], ("vocab_size 10",)),
             (["--model", str(no_tok)], ("no tokenizer",))]
    for i, (argv, needles) in enumerate(cases):
        rc = main(["mlm", *argv, "--data", str(data), "--out", str(tmp_path / f"o{i}"), *C])
        err = capsys.readouterr().err
        assert rc in (1, 2), err
        one_line(err, *needles)


def test_finetune_refuses_validation_and_test_labels_never_trained(tiny_yoso, topic_data, tmp_path, capsys,
                                                                   write_jsonl):
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "alpha beta", "label": "unseen"}] * 4)
    base = ["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), *C]
    assert main([*base, "--val-data", str(other), "--out", str(tmp_path / "a")]) == 2
    one_line(capsys.readouterr().err, "--val-data", "labels")
    assert main([*base, "--test-data", str(other), "--out", str(tmp_path / "b")]) == 2
    one_line(capsys.readouterr().err, "--test-data")
    assert not (tmp_path / "b" / "checkpoints" / "last.pt").exists()  # refused before training


@pytest.mark.parametrize("device", ["bogus", "cuda:99"])
def test_bad_device_is_one_line(tiny_yoso, topic_data, tmp_path, capsys, device):
    argv = ["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(tmp_path / "o"), *C]
    assert main([*argv, "--device", device]) == 2
    one_line(capsys.readouterr().err, f"--device {device}")


def test_resume_from_a_corrupt_or_foreign_checkpoint_is_one_line(tiny_yoso, topic_data, tmp_path, capsys,
                                                                 sentences, write_jsonl):
    out = tmp_path / "run"
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(out), *C]) == 0
    texts = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(8)])
    assert main(["mlm", "--model", str(tiny_yoso), "--data", str(texts), "--out", str(out), "--resume", *C]) == 2
    one_line(capsys.readouterr().err, "--resume", "cannot be loaded")
    (out / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(out), "--resume",
                 *C]) == 2
    one_line(capsys.readouterr().err, "--resume", "cannot be loaded")


def test_eval_in_bf16_without_a_bf16_gemm_says_so_before_loading(tiny_yoso, tmp_path, capsys, monkeypatch):
    """On a CPU where oneDNN has no bf16 GEMM (AVX2 alone) ``eval --dense-dtype bf16`` is one line naming what is
    missing and the ways on, not oneDNN's error from inside the first forward."""
    from yoso_serve.model import linear

    monkeypatch.setattr(linear, "bf16_gemms", lambda: False)
    assert main(["eval", "--model", str(tiny_yoso), "--device", "cpu", "--dense-dtype", "bf16",
                 "--out", str(tmp_path / "e")]) == 2
    one_line(capsys.readouterr().err, "--dense-dtype bf16", "no bf16 GEMM", "bench/emulated.py")
