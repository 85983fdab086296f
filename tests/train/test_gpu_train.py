"""bench/gpu_train.sh, issue 16's GPU training call, run end to end on the CPU: the kit is packed, the
script trains the bundled model (GPU_TRAIN_DEVICE=cpu) until its deadline stops it after a step or two,
ends within its global budget, splits the weights into parts that fit what the device tool brings back
(at most 16 MiB each), and --unpack rebuilds the saved checkpoint byte for byte (its sha256), a model
that loads and embeds; parts that do not reassemble to it are refused."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_train.sh"


def doc_rows(n: int) -> list[dict]:
    """Document rows of two sources, each block a first sentence and a rest (longdoc's short pairs)."""
    words = "alpha beta gamma delta kernel socket buffer queue thread index table vector".split()
    return [{"doc": f"t/{d}.html#0", "source": "ab"[d % 2], "page": f"t/{d}.html",
             "blocks": [f"{words[(d + b) % 12].capitalize()} {words[b % 12]} {words[d % 12]} starts right here. Then "
                        + " ".join(words[(d * b + i) % 12] for i in range(20)) + "." for b in range(6)]}
            for d in range(n)]


def run(*args, env, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def test_without_a_gpu_or_a_kit_it_stops_with_one_line(tmp_path):
    done = run(env={"PYTHON": sys.executable, "GPU_TRAIN_KIT": str(tmp_path / "kit")})
    assert done.returncode == 3 and done.stderr.startswith("gpu_train.sh needs a CUDA GPU")
    done = run(env={"PYTHON": sys.executable, "GPU_TRAIN_KIT": str(tmp_path / "kit"), "GPU_TRAIN_DEVICE": "cpu"})
    assert done.returncode == 2 and "run --kit here" in done.stderr
    # --kit without the training corpus names the one recipe step that writes it, not the whole training pipeline
    done = run("--kit", env={"PYTHON": sys.executable, "GPU_TRAIN_KIT": str(tmp_path / "kit"),
                             "GPU_TRAIN_DOCS": str(tmp_path / "none.jsonl")})
    assert done.returncode == 2 and "make.py longdoc-data-wide --work runs/default-model" in done.stderr
    assert not (tmp_path / "kit").exists()


def test_a_budget_too_small_to_train_stops_before_any_work(tmp_path):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "train_docs.jsonl.xz").write_bytes(lzma.compress(b""))
    env = {"PYTHON": sys.executable, "GPU_TRAIN_KIT": str(kit), "GPU_TRAIN_DEVICE": "cpu",
           "OUT": str(tmp_path / "out"), "GPU_TRAIN_BUDGET": "80"}
    done = run(env=env, timeout=60)
    assert done.returncode == 4 and re.search(r"only \d+ s left of GPU_TRAIN_BUDGET", done.stderr), done.stderr


@pytest.mark.slow  # loads the bundled model three times and trains a step or two: 15-60 s on two shared cores
def test_kit_train_and_unpack_give_a_model_that_embeds(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in doc_rows(40)))  # 20 per source: the batch of 16 fits
    env = {"PYTHON": sys.executable, "GPU_TRAIN_KIT": str(tmp_path / "kit"), "GPU_TRAIN_DOCS": str(docs),
           "GPU_TRAIN_DEVICE": "cpu", "OUT": str(tmp_path / "out"), "GPU_TRAIN_BUDGET": "120",
           # a schedule far longer than the deadline: about a second of training, then the checkpoint
           "GPU_TRAIN_STEPS": "1000", "GPU_TRAIN_MINUTES": "0.02",
           "GPU_TRAIN_ARGS": "--curriculum 64:1 --short-pairs 2 --queue 4 --segment-tokens 16 --save-every 1"}
    packed = run("--kit", env=env)
    assert packed.returncode == 0, packed.stderr
    assert (tmp_path / "kit" / "train_docs.jsonl.xz").stat().st_size > 0

    started = time.monotonic()
    done = run(env=env)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed < 120 and re.search(r"done in \d+ s \(GPU_TRAIN_BUDGET 120 s\)", done.stdout)
    out = tmp_path / "out"
    log = (out / "train.log").read_text()
    assert "--teacher init" in log and "RESULT rc=0" in log
    # the call's own batch (16) with a neighbourhood it fits in: stage nine's 12 would refuse it
    assert "--batch-size 16 " in log and "--neighbourhood 48 " in log
    parts = sorted(out.glob("model.safetensors.part-*"))
    assert len(parts) >= 2 and all(p.stat().st_size <= 16 << 20 for p in parts)
    assert len(list(out.iterdir())) <= 8  # the device tool brings back 8 files at most
    whole = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    assert log.splitlines()[-1] == f"weights sha256 {whole}"  # the saved checkpoint's
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e.get("event") == "train"]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 1000
    assert [e["reason"] for e in events if e.get("event") == "stop"] == ["time limit"]

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    with open(broken / parts[-1].name, "r+b") as f:  # one bit flipped in transfer
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    refused = run("--unpack", str(broken), str(tmp_path / "broken-model"), env=env)
    assert refused.returncode == 6 and "do not reassemble" in refused.stderr
    assert not (tmp_path / "broken-model").exists()

    dest = tmp_path / "model"
    unpacked = run("--unpack", str(out), str(dest), env=env)
    assert unpacked.returncode == 0, unpacked.stderr
    from yoso_serve.model import load_pretrained
    from yoso_serve.model.default import bundled_model_dir

    model, bundled = load_pretrained(dest), load_pretrained(bundled_model_dir())
    ids = torch.tensor([model.tokenizer.encode(["alpha beta gamma"])[0]])
    got, was = model.embed(ids, torch.ones_like(ids), hashes=0), bundled.embed(ids, torch.ones_like(ids), hashes=0)
    assert torch.isfinite(got).all() and not torch.equal(got, was)  # the trained weights, not the bundle's
    assert run("--unpack", str(out), str(dest), env=env).returncode == 2  # never over an existing model
