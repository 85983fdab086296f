"""The GPU plan in docs/cuda.md (issue 75) fits the 15 minutes a lent GPU gets: machine start (120 s),
call (a), the gap between calls (30 s), call (b) and the hand-back (10 s) within 13 minutes, and each
call's script, in its dry run, clamps every step (worst case: each runs to its limit and 10 s kill
grace) inside its own budget, itself below the call's timeout_s. What a call carries (the tree and its
carry list, bench/travel.py) stays under the device tool's 64 MiB: the kit and the wheels never travel
together, the tree leaves room for the kit, and ``gpu_train.sh --kit`` refuses a kit that does not fit."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START, GAP, HAND_BACK = 120, 30, 10
# The kit of the real corpus (62 MB of JSONL, xz-compressed): docs/cuda.md, "What travels".
KIT_MIB = 13


def _bench_script(name: str):
    """bench/NAME.py as a module, by its path: bench/ is scripts, not a package, and on sys.path its onnx.py
    would shadow the onnx package for every test collected after this one."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


travel = _bench_script("travel")


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


def test_no_call_carries_the_kit_and_the_wheels_together():
    carried = [json.loads(carry) for _, carry, _ in plan_calls()]
    assert all(not {".kit", ".whl"} <= set(c) for c in carried), carried
    assert carried == [[], [".kit"]]  # (a) needs no wheels: serve is not among its steps


def test_each_call_carries_under_64_mib_with_room_for_the_kit():
    """The tree as the tool copies it plus each call's carried paths as they are here; a kit not built
    here counts at its size in docs/cuda.md, so the tree must leave that much room."""
    assert f"{KIT_MIB} MiB" in (ROOT / "docs" / "cuda.md").read_text()
    for _, carry, _ in plan_calls():
        names = json.loads(carry)
        sizes = travel.travel(ROOT, names)
        kit = KIT_MIB * 2**20 if ".kit" in names and not (ROOT / ".kit").exists() else 0
        assert sizes["total"] + kit <= travel.LIMIT, (names, sizes)


def test_the_kit_build_measures_what_travels_and_refuses_a_kit_that_does_not_fit(tmp_path):
    docs, kit = tmp_path / "docs.jsonl", tmp_path / "kit"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(200)))
    env = {**os.environ, "GPU_TRAIN_DOCS": str(docs), "GPU_TRAIN_KIT": str(kit), "PYTHON": sys.executable}
    build = ["bash", str(ROOT / "bench" / "gpu_train.sh"), "--kit"]
    done = subprocess.run(build, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert re.search(r"total: +\d+\.\d MiB", done.stdout) and "MiB to spare" in done.stdout
    with (kit / "train_docs.jsonl.xz").open("rb") as f, __import__("lzma").open(f) as unpacked:
        assert unpacked.read() == docs.read_bytes()
    # a kit that leaves the tree no room: what the training call would carry is over the limit
    (kit / "filler.bin").write_bytes(b"\0" * (travel.LIMIT - travel.tree_bytes(ROOT) + 1))
    over = subprocess.run(build, capture_output=True, text=True, timeout=60, env=env)
    assert over.returncode == 5 and "over the device tool's 64 MiB" in over.stderr, over.stderr
