"""Settings: flags over env over defaults, start-time validation that says how to fix, secrets kept."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from yoso_serve.service.cli import load_settings
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


# A non-default value per setting, written by hand (not derived from ServeSettings): a setting added
# without a flag, an env var or a README row fails the test below until it is listed here too.
NON_DEFAULT = {
    "YOSO_MODEL": "{tmp}", "YOSO_HOST": "127.0.0.1", "YOSO_PORT": "9001", "YOSO_METRICS_PORT": "9002",
    "YOSO_API_KEY": "k3y", "YOSO_HASHES": "16", "YOSO_AUTO_EXACT_BELOW": "100", "YOSO_MAX_HASHES": "64",
    "YOSO_MAX_BATCH_TOKENS": "8192", "YOSO_MAX_BATCH_REQUESTS": "8", "YOSO_MAX_PADDING_TOKENS": "16",
    "YOSO_MAX_WAIT_MS": "1.5",
    "YOSO_MAX_QUEUE_TOKENS": "1000", "YOSO_MAX_CLIENT_BATCH_SIZE": "8", "YOSO_MAX_INPUT_LENGTH": "128",
    "YOSO_PAYLOAD_LIMIT": "1000", "YOSO_REQUEST_TIMEOUT": "5", "YOSO_THREADS": "1", "YOSO_FORWARD_NICE": "0", "YOSO_DEVICE": "cpu",
    "YOSO_RUNTIME": "torch", "YOSO_DENSE_DTYPE": "fp32", "YOSO_EXACT_KERNEL": "op", "YOSO_DTYPE": "float32", "YOSO_LOG_LEVEL": "debug", "YOSO_LOG_TEXTS": "true", "YOSO_CHUNK_OVERLAP": "8",
    "YOSO_DRAIN_TIMEOUT": "5",
}


def readme_settings() -> dict[str, str]:
    """The README's configuration table: flag → env var, as an operator reads them."""
    doc = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)` \| `(YOSO_[A-Z_]+)` \|", doc, flags=re.M)
    return dict(rows)


def test_every_setting_has_a_flag_and_an_env_var(monkeypatch, tmp_path):
    """Each README row, set once by its flag and once by its env var, gives the same non-default settings."""
    (tmp_path / "config.json").write_text("{}")
    table = readme_settings()
    assert sorted(table.values()) == sorted(NON_DEFAULT)
    defaults = load_settings([]).model_dump()
    for flag, env in table.items():
        value = NON_DEFAULT[env].replace("{tmp}", str(tmp_path))
        by_flag = load_settings([flag] if value == "true" else [flag, value]).model_dump()
        with monkeypatch.context() as m:
            m.setenv(env, value)
            by_env = load_settings([]).model_dump()
        assert by_flag == by_env != defaults, (flag, env)
        assert sum(by_flag[k] != defaults[k] for k in defaults) == 1, (flag, env)


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
    # values that crashed the process late (a segfault, an abort, an overflow at SIGTERM): refused at start
    (["--threads", "100000"], {}, "--threads / YOSO_THREADS: Input should be less than or equal to 1024"),
    (["--host", "999.1.1.1"], {}, "--host / YOSO_HOST: '999.1.1.1' is not an address or host name"),
    ([], {"YOSO_DRAIN_TIMEOUT": "inf"}, "--drain-timeout / YOSO_DRAIN_TIMEOUT: Input should be less than or equal"),
    (["--drain-timeout", "1e30"], {}, "--drain-timeout / YOSO_DRAIN_TIMEOUT: Input should be less than or equal"),
    (["--metrics-port", "8080"], {}, "--metrics-port 8080 is --port too"),
    (["--dtype", "float16", "--device", "cpu"], {}, "--dtype float16 is for CUDA; on a CPU --dense-dtype bf16"),
    (["--dtype", "bfloat16", "--runtime", "hybrid"], {}, "--dtype bfloat16 is for the torch runtime; --runtime hybrid"),
    (["--exact-kernel", "flex", "--device", "cpu"], {}, "--exact-kernel flex runs on CUDA only (on a CPU the C++ exact kernel is 4-5x"),
    (["--exact-kernel", "flex", "--runtime", "onnx"], {}, "--exact-kernel flex is a torch kernel; --runtime onnx never"),
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


def test_api_key_is_secret_in_repr_and_dump():
    s = ServeSettings(api_key="hunter2-key")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())
    assert s.api_key.get_secret_value() == "hunter2-key"


def test_api_key_never_reaches_the_server_log(tiny_dir, yoso_server):
    """A real server at debug level, asked with the right key and a wrong one: its whole log output
    (start-up settings line included) never shows either."""
    proc, url = yoso_server.start("--model", str(tiny_dir), "--chunk-overlap", "16", "--api-key", "hunter2-key",
                                  "--log-level", "debug", "--log-texts")
    try:
        good = httpx.post(f"{url}/embed", json={"inputs": "hello"}, headers={"Authorization": "Bearer hunter2-key"})
        bad = httpx.post(f"{url}/embed", json={"inputs": "hello"}, headers={"Authorization": "Bearer hunter3-key"})
    finally:
        yoso_server.stop(proc)
    log = proc.stdout.read()
    assert good.status_code == 200 and bad.status_code == 401
    assert "api_key set" in log and "inputs: ['hello']" in log  # the settings line and the request were logged
    assert "hunter" not in log


def test_readme_configuration_table_lists_every_setting():
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


@pytest.mark.parametrize("flags,words", [
    (["--max-input-length", "100"], "--max-input-length 100 is above the model's max_position_embeddings 64"),
    (["--chunk-overlap", "100"], "--chunk-overlap 100 must be below the window of 62 tokens"),
])
def test_prepare_refuses_what_a_start_would_refuse(tiny_dir, capsys, flags, words):
    """--prepare loads the model and checks the limits that need it, as a start does: exit 1, one line."""
    from yoso_serve.service.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--prepare", "--model", str(tiny_dir), "--runtime", "torch", "--log-level", "warning", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and words in err and "Traceback" not in err, err
