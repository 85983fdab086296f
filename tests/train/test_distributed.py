"""torchrun with two CPU processes (gloo): DistributedDataParallel keeps the ranks' weights identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from yoso_serve.model import load_pretrained
from yoso_serve.model.train.runtime import enable_gradient_checkpointing, read_events

WORKER = Path(__file__).with_name("ddp_worker.py")


def test_two_process_gloo_run_ends_with_identical_weights(tiny_bert, tiny_yoso, tmp_path, sentences, write_jsonl):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(20, seed=6)])
    out = tmp_path / "runs" / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           "distill", "--teacher", str(tiny_bert), "--student", str(tiny_yoso), "--data", str(data),
           "--train-hashes", "0,8", "--batch-size", "2", "--grad-accum", "2", "--max-steps", "3", "--lr", "1e-3",
           "--device", "cpu", "--log-every", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = torch.load(out.parent / "rank0.pt")
    r1 = torch.load(out.parent / "rank1.pt")
    start = load_pretrained(tiny_yoso).encoder.state_dict()
    moved = 0
    for key, value in r0.items():
        torch.testing.assert_close(r1[key], value, rtol=0, atol=0, msg=key)
        moved += not torch.equal(value, start[key.removeprefix("student.")])
    assert moved > 10  # the ranks agree on weights that really trained
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2
    assert [r["step"] for r in read_events(out, "train")] == [1, 2, 3]  # rank 0 alone writes


def test_gradient_checkpointing_gives_the_same_gradients(tiny_yoso):
    def grads(checkpointed: bool) -> dict[str, torch.Tensor]:
        model = load_pretrained(tiny_yoso)
        model.train()
        if checkpointed:
            assert enable_gradient_checkpointing(model.encoder, model.config.num_hidden_layers) == 2
        ids = torch.arange(5, 45).view(2, 20)
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        torch.manual_seed(0)  # dropout: checkpointing replays the RNG state, so masks match
        model.last_hidden(ids, mask, hashes=8).square().mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys() and len(plain) > 20
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
