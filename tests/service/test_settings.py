"""Settings: flags over env over defaults, start-time validation that says how to fix, secrets kept."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from yoso_serve.service.cli import build_parser, load_settings
from yoso_serve.service.settings import ServeSettings


def test_defaults_env_and_flag_precedence(monkeypatch):
    s = load_settings([])
    assert (s.host, s.port, s.max_hashes, s.runtime, s.log_texts, s.api_key) == ("0.0.0.0", 8080, 256, "auto",
                                                                               False, None)
    monkeypatch.setenv("YOSO_PORT", "9000")
    monkeypatch.setenv("YOSO_MAX_WAIT_MS", "7.5")
    monkeypatch.setenv("YOSO_LOG_TEXTS", "true")
    monkeypatch.setenv("YOSO_RUNTIME", "torch")
    s = load_settings(["--port", "9100"])
    assert s.port == 9100 and s.max_wait_ms == 7.5 and s.log_texts is True and s.runtime == "torch"
    assert load_settings(["--no-log-texts"]).log_texts is False


def test_every_setting_has_a_flag_and_an_env_var(monkeypatch):
    help_text = build_parser().format_help()
    for name in ServeSettings.model_fields:
        assert "--" + name.replace("_", "-") in help_text and "YOSO_" + name.upper() in help_text.replace("\n", "")


@pytest.mark.parametrize("argv,env,fix", [
    ([], {"YOSO_MAX_BATCH_REQUESTS": "0"}, "--max-batch-requests / YOSO_MAX_BATCH_REQUESTS: Input should be greater"),
    (["--runtime", "onnx"], {}, "to serve it, use --runtime torch (what auto picks) or --runtime hybrid"),
    ([], {"YOSO_RUNTIME": "tensorrt"}, "--runtime / YOSO_RUNTIME: Input should be 'auto', 'torch', 'hybrid' or 'onnx'"),
    (["--runtime", "hybrid", "--hashes", "0"], {}, "--runtime hybrid with --hashes 0: the exact (YOSO-E) ONNX graph"),
    (["--model", "{tmp}"], {}, "has no config.json; point --model / YOSO_MODEL"),
    (["--port", "http"], {}, "--port / YOSO_PORT"),
    (["--hashes", "300"], {}, "--hashes 300 is above --max-hashes 256"),
    (["--max-input-length", "9000", "--max-batch-tokens", "4096"], {}, "one input must fit in a batch"),
    (["--device", "cuda"], {}, "no CUDA device is visible"),
])
def test_bad_settings_exit_2_with_how_to_fix(tmp_path, monkeypatch, capsys, argv, env, fix):
    pytest.importorskip("torch")
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        load_settings([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert info.value.code == 2 and fix in capsys.readouterr().err


def test_api_key_is_secret_in_repr_dump_and_logs(caplog):
    s = ServeSettings(api_key="hunter2-key")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())
    assert s.api_key.get_secret_value() == "hunter2-key"
    with caplog.at_level(logging.INFO):
        logging.getLogger("yoso_serve.service").info("settings: %s", s.model_dump(exclude={"api_key"}))
    assert "hunter2" not in caplog.text


def test_readme_configuration_table_lists_every_setting():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name in ServeSettings.model_fields:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `--{name.replace('_', '-')}` |")), "")
        assert f"`YOSO_{name.upper()}`" in row, name


def test_padding_limit_defaults_by_device_and_obeys_the_flag():
    assert ServeSettings().padding_limit("cpu") == 64
    assert ServeSettings().padding_limit("cuda:0") == 2048
    assert ServeSettings(max_padding_tokens=0).padding_limit("cuda") == 0
    with pytest.raises(ValidationError, match="max_padding_tokens"):
        ServeSettings(max_padding_tokens=-1)
