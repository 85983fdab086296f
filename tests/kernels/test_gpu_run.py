"""bench/gpu_run.sh, the one script a lent GPU runs (issue 18), checked where no GPU is.

The script must parse, plan within the device tool's 600 s per command, refuse a machine
without a GPU in one clear line, and turn each step's outcome into a row of its final table.
The last is run for real with a stand-in interpreter that claims a GPU (and answers torch's
device queries) but runs the real Python for the steps: the model step then runs on the CPU
at 32 tokens (GPU_RUN_DEVICE=cpu), the ONNX step finds no CUDA provider, and a model step
asked for more tokens than the model has positions fails and says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
STEPS = ["build", "tests", "sanitize", "attention", "model", "serve", "onnx"]


def run(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_plans_every_step_within_the_device_limit():
    done = run("--dry-run")
    assert done.returncode == 0, done.stderr
    rows = [line.split()[:2] for line in done.stdout.splitlines()[1:-1]]
    assert [step for step, _ in rows] == STEPS
    total = sum(int(limit.rstrip("s")) for _, limit in rows)
    assert f"total limit: {total} s" in done.stdout and total <= 570  # the tool kills at 600 s
    assert "compute-sanitizer" not in done.stdout and "$SANITIZER --tool=memcheck" in done.stdout
    assert "bench/attention_cuda.py" in done.stdout and "bench/load.py" in done.stdout


def test_steps_run_in_the_fixed_order_and_unknown_ones_are_refused():
    done = run("--steps", "onnx,build,model", "--dry-run")
    assert [line.split()[0] for line in done.stdout.splitlines()[1:-1]] == ["build", "model", "onnx"]
    bad = run("--steps", "build,warp", "--dry-run")
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"gpu_run.sh: unknown step 'warp' (steps: {' '.join(STEPS)})"


def test_fetch_wheels_dry_run_pins_this_venvs_versions_for_the_gpu_image():
    done = run("--fetch-wheels", "--dry-run", env={"PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 12 and all("--python-version 3.12" in line and "--no-deps" in line for line in lines)
    import fastapi
    import typing_extensions  # noqa: F401

    assert any(line.endswith(f"fastapi=={fastapi.__version__}") for line in lines)
    # fastapi needs these and the GPU image lacks them, or holds a version too old for pydantic:
    # without them the second GPU run's serve step could not import fastapi
    for name in ("opentelemetry-api", "typing-extensions", "annotated-doc"):
        assert any(f" {name}==" in line for line in lines), name


def test_without_a_gpu_it_stops_with_one_line():
    done = run(env={"PYTHON": sys.executable})
    assert done.returncode == 3
    assert done.stderr.startswith("gpu_run.sh needs a CUDA GPU") and "Traceback" not in done.stderr


@pytest.fixture
def claims_a_gpu(tmp_path):
    """A python that says yes to torch.cuda.is_available() and runs everything else for real."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$*" in
  *is_available*) exit 0 ;;
  *get_device_capability*) echo 9.0; exit 0 ;;
  *get_device_name*) echo "stand-in GPU"; exit 0 ;;
esac
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    return fake


def table(stdout: str) -> dict[str, list[str]]:
    rows = [line.split("|")[1:] for line in stdout.splitlines() if line.startswith("| ")][1:]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


@pytest.mark.slow  # loads the bundled model three times and compiles the flex kernel: minutes on two shared cores
def test_each_step_becomes_a_row_of_the_final_table(claims_a_gpu, tmp_path):
    env = {"PYTHON": str(claims_a_gpu), "OUT": str(tmp_path / "out"), "GPU_RUN_DEVICE": "cpu",
           "GPU_RUN_TOKENS": "32", "GPU_RUN_BATCH": "2", "GPU_RUN_LIMIT_MODEL": "240"}
    done = run("--steps", "model,onnx", env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-4] == "device: stand-in GPU"
    rows = table(done.stdout)
    assert list(rows) == ["model", "onnx"]
    status, _, figure = rows["model"]
    assert status == "ok"
    assert re.fullmatch(r"yoso-minilm-l6-4096 float32, 2 x 32 tokens: YOSO-32 [0-9.]+ docs/s, YOSO-E op [0-9.]+, "
                        r"YOSO-E flex [0-9.]+, softmax [0-9.]+ docs/s, YOSO-32/softmax [0-9.]+, flex/softmax [0-9.]+",
                        figure), figure
    exact = re.search(r"^EXACT .*max \|flex - op\| of the last hidden states (\S+), (.*)$",
                      (tmp_path / "out" / "model.log").read_text(), flags=re.M)
    assert exact and float(exact[1]) < 1e-4 and exact[2] == "{'exact_kernel': 'flex'}", exact and exact[0]
    assert rows["onnx"][0] == "skipped" and "no CUDAExecutionProvider" in rows["onnx"][2]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.log", "onnx.log"]

    failed = run("--steps", "model", env={**env, "GPU_RUN_TOKENS": "5000"}, timeout=300)
    assert table(failed.stdout)["model"][0] == "FAIL rc=1"
    assert "Traceback" in (tmp_path / "out" / "model.log").read_text()  # the full log keeps the why
