"""The GPU plan in docs/cuda.md (issue 75) fits the 15 minutes a lent GPU gets: machine start (120 s),
call (a), the gap between calls (30 s), call (b) and the hand-back (10 s) within 13 minutes, and each
call's script, in its dry run, clamps every step (worst case: each runs to its limit and 10 s kill
grace) inside its own budget, itself below the call's timeout_s."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START, GAP, HAND_BACK = 120, 30, 10


def plan_calls():
    text = (ROOT / "docs" / "cuda.md").read_text()
    block = text.split("<!-- plan -->", 1)[1].split("```")[1]
    return re.findall(r'run\(command="([^"]+)", carry=(\[[^]]*\]), timeout_s=(\d+)\)', block)


def dry_run(command: str) -> str:
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
    args = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S+", w)]
    assert args[0] == "bash"
    return subprocess.run(args + ["--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={**os.environ, **env}).stdout


def test_the_plan_fits_thirteen_minutes():
    calls = plan_calls()
    assert len(calls) == 2
    assert START + sum(int(t) for *_, t in calls) + GAP + HAND_BACK <= 13 * 60


def test_call_a_clamps_its_steps_within_its_budget_and_runs_every_step():
    command, carry, timeout_s = plan_calls()[0]
    budget = int(re.search(r"GPU_RUN_BUDGET=(\d+)", command)[1])
    assert budget + 10 <= int(timeout_s)
    out = dry_run(command)
    rows = [line.split()[:2] for line in out.splitlines()[1:-1]]
    assert [s for s, _ in rows] == ["build", "tests", "sanitize", "attention"]
    limits = [int(lim.rstrip("s")) for _, lim in rows]
    assert all(lim > 0 for lim in limits), out  # no step is squeezed out in the worst case
    assert sum(lim + 10 for lim in limits) + 10 <= budget
    # a smaller budget clamps instead of overrunning
    tight = dry_run(command.replace(f"GPU_RUN_BUDGET={budget}", "GPU_RUN_BUDGET=150"))
    limits = [int(line.split()[1].rstrip("s")) for line in tight.splitlines()[1:-1]]
    assert limits[-1] == 0 and sum(lim + 10 for lim in limits if lim) + 10 <= 150


def test_call_b_keeps_its_budget_below_its_timeout():
    command, carry, timeout_s = plan_calls()[1]
    assert carry == '[".kit"]'
    budget = int(re.search(r"GPU_TRAIN_BUDGET=(\d+)", command)[1])
    assert budget + 10 <= int(timeout_s)
    script = (ROOT / "bench" / "gpu_train.sh").read_text()
    assert 'timeout --kill-after=10 "$((left - 10))"' in script and "GPU_TRAIN_BUDGET" in script
