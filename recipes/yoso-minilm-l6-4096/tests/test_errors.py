"""A recipe step's bad input (a missing HTML root, an unwritable work folder) is one line on stderr and exit
1 or 2, never a traceback."""

from __future__ import annotations

import pytest

from make import main as default_main


def one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if "error" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], err


def test_default_model_data_errors_are_one_line(tmp_path, capsys):
    from yoso_serve.model.default import minilm_dir

    try:
        minilm_dir()
    except Exception:  # noqa: BLE001 - the stage needs the bundled teacher
        pytest.skip("no bundled teacher")
    assert default_main(["data", "--work", str(tmp_path), "--html-root", str(tmp_path / "nonexistent")]) == 2
    one_line(capsys.readouterr().err, "nonexistent")
    assert default_main(["data", "--work", "/proc/x", "--html-root", str(tmp_path)]) in (1, 2)
    one_line(capsys.readouterr().err)
