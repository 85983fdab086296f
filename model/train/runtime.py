"""What every training command shares: processes, devices, precision, seeds and the run directory.

Run directory layout (``--out``)::

    config.json        the command's arguments, the world size, torch version; written once
    metrics.jsonl      one JSON object per event: train logs, epoch metrics, resumes, the end
    data_report.json   rows kept and skipped (with reasons) per data file
    checkpoints/last.pt  full training state for ``--resume`` (weights, optimizer, scheduler,
                       scaler, step, epoch, position in the epoch, RNG states)
    model/             the result, an HF-format directory (``save_pretrained``)
    best/              finetune only: the checkpoint with the best validation metric

Only rank 0 writes; other ranks wait at barriers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if available else cpu; anything else must exist on this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def init_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group when WORLD_SIZE > 1 (NCCL on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world == 1:
        return Distributed(), device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Distributed(rank, world, local), device


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. Mixed precision exists on CUDA only."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    if device.type != "cuda":
        if precision in ("bf16", "fp16"):
            raise ValueError(f"--precision {precision} needs a CUDA device, got {device}")
        return None
    if precision == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def enable_gradient_checkpointing(module: nn.Module, num_layers: int) -> int:
    """Recompute every encoder layer in backward instead of storing its activations.

    Finds the ``nn.ModuleList`` of ``num_layers`` blocks and routes each block's forward
    through ``torch.utils.checkpoint`` (non-reentrant, so keyword arguments pass through).
    Parameter names are unchanged, so checkpoints load either way. The hash codes are
    seeded per layer, so the recomputation draws the same hashes as the first pass.
    Returns the number of layers wrapped.
    """
    for child in module.modules():
        if isinstance(child, nn.ModuleList) and len(child) == num_layers:
            for layer in child:
                layer.forward = _checkpointed(layer.forward)
            return num_layers
    raise ValueError(f"gradient checkpointing: no ModuleList of {num_layers} layers in {type(module).__name__}")


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def read_events(run: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events ``RunDir.log`` wrote to ``run``/metrics.jsonl, in order (only ``kind`` if given;
    none when the run has no metrics yet)."""
    path = Path(run) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    return [r for r in rows if kind is None or r["event"] == kind]


class RunDir:
    """A run directory: config, metrics, data report and training-state checkpoints."""

    def __init__(self, path: str | Path, *, config: dict[str, Any], resume: bool, dist_: Distributed) -> None:
        self.path = Path(path)
        self.dist = dist_
        self.checkpoint_path = self.path / "checkpoints" / "last.pt"
        if resume and not self.checkpoint_path.is_file():
            raise ValueError(f"--resume: no checkpoint at {self.checkpoint_path}")
        if not resume and (self.path / "metrics.jsonl").exists():
            raise ValueError(f"run directory {self.path} already holds a run; pass --resume or pick a new --out")
        if dist_.is_main:
            self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
            if not resume:
                _write_json(self.path / "config.json", config)
        dist_.barrier()

    def log(self, event: str, **fields: Any) -> None:
        """Append one event to metrics.jsonl (rank 0 only)."""
        if not self.dist.is_main:
            return
        record = {"event": event, "time": round(time.time(), 3), **fields}
        with (self.path / "metrics.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")

    def write_json(self, name: str, data: Any) -> None:
        if self.dist.is_main:
            _write_json(self.path / name, data)

    def save_state(self, state: dict[str, Any]) -> None:
        """Write the training state atomically: a crash mid-write leaves the old checkpoint."""
        if self.dist.is_main:
            tmp = self.checkpoint_path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, self.checkpoint_path)
        self.dist.barrier()

    def load_state(self, device: torch.device) -> dict[str, Any]:
        return torch.load(self.checkpoint_path, map_location=device, weights_only=False)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (Path, torch.device, torch.dtype)):
        return str(value)
    if isinstance(value, (np.generic, torch.Tensor)):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
