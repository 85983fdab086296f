"""Run by test_distributed.py under torchrun: ``yoso-train distill`` as is, plus each rank's final weights.

The trainer saves on rank 0 only, so the test wraps ``Trainer.fit`` to write every rank's
weights next to the run directory and compares them there.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from yoso_serve.model.train import trainer as trainer_module
from yoso_serve.model.train.cli import main

original_fit = trainer_module.Trainer.fit


def fit_and_dump(self):
    stop = original_fit(self)
    out = Path(sys.argv[-1]).parent
    torch.save({k: v.detach().cpu() for k, v in self.module.state_dict().items()},
               out / f"rank{dist.get_rank()}.pt")
    return stop


trainer_module.Trainer.fit = fit_and_dump
sys.exit(main(sys.argv[1:]))
