"""The training loop all commands share: DDP, accumulation, mixed precision, checkpoints, resume.

A command supplies an ``nn.Module`` whose ``forward(batch) -> (loss, logs)`` holds exactly
the trainable parameters, a ``prepare(batch)`` that moves a batch to the device and adds
targets computed without grad (a teacher's outputs, masked tokens), and optional hooks for
the end of an epoch. Resuming restores everything, including the position inside the
epoch: the sampler's order is a function of (seed, epoch), so the already-seen batches
are skipped without being read twice.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from tqdm.auto import tqdm

from .runtime import Distributed, RunDir, autocast, autocast_dtype, rng_state, set_rng_state

Batch = dict[str, torch.Tensor]
SCHEDULES = ("linear", "constant")


@dataclass
class TrainOptions:
    """Optimisation settings; steps count optimizer updates, not micro-batches."""

    epochs: int = 1
    max_steps: int = 0  # 0 = epochs decide
    batch_size: int = 16  # per process and micro-batch
    grad_accum: int = 1
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup: float = 0.06  # fraction of all steps
    schedule: str = "linear"  # after warm-up: "linear" decay to 0, or "constant"
    max_grad_norm: float = 1.0
    precision: str = "auto"
    seed: int = 0
    log_every: int = 10
    save_every: int = 200
    max_minutes: float = 0.0  # 0 = no time limit; else stop (and save) after this long
    # (name suffix, factor): parameters whose name ends with the suffix train at lr × factor
    lr_scales: tuple[tuple[str, float], ...] = ()
    no_decay: tuple[str, ...] = ()  # name suffixes of parameters kept out of weight decay (besides BERT's)

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "grad_accum", "log_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"--warmup must be in [0, 1), got {self.warmup}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")


class _Skip(Sampler):
    """The first ``skip`` indices of ``inner`` dropped: the part of an epoch already trained."""

    def __init__(self, inner: Sampler, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self):
        return iter(list(self.inner)[self.skip:])

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


class Trainer:
    """Runs ``module`` over ``dataset`` for the configured steps, logging into ``run``."""

    def __init__(self, module: nn.Module, dataset: Dataset, collate: Callable[[list], Batch],
                 prepare: Callable[[Batch], Batch], *, options: TrainOptions, run: RunDir,
                 dist_: Distributed, device: torch.device) -> None:
        options.validate()
        self.opts, self.run, self.dist, self.device = options, run, dist_, device
        self.module = module.to(device)
        self.dataset, self.collate, self.prepare = dataset, collate, prepare
        self.amp = autocast_dtype(options.precision, device)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp == torch.float16)
        self.sampler = DistributedSampler(dataset, num_replicas=dist_.world_size, rank=dist_.rank,
                                          shuffle=True, seed=options.seed)
        batches = math.ceil(len(self.sampler) / options.batch_size)
        if batches == 0:
            raise ValueError("no training examples left after reading the data")
        self.steps_per_epoch = math.ceil(batches / options.grad_accum)
        self.total_steps = options.max_steps or options.epochs * self.steps_per_epoch
        self.optimizer = _adamw(module, options)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.wrapped = (DistributedDataParallel(self.module, device_ids=[device.index] if device.type == "cuda" else None)
                        if dist_.enabled else self.module)
        self.step = self.epoch = self.batch_in_epoch = 0
        self._saved_step = -1
        self.extra: dict[str, Any] = {}  # task state that must survive a resume (e.g. the best metric)
        self.on_epoch_end: Callable[[int], dict[str, float]] | None = None
        self.on_save: Callable[[], None] | None = None

    def _lr_factor(self, step: int) -> float:
        warm = max(1, int(self.opts.warmup * self.total_steps))
        if step < warm:
            return (step + 1) / warm
        if self.opts.schedule == "constant":
            return 1.0
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - warm))

    # -- state -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "world_size": self.dist.world_size, "extra": self.extra, "rng": rng_state()}

    def save(self) -> None:
        self.run.save_state(self.state())
        self._saved_step = self.step
        if self.on_save is not None:
            self.on_save()

    def resume(self) -> None:
        try:  # a corrupt file, or one of another command or model shape, is a bad --resume, not a crash
            state = self.run.load_state(self.device)
            world_size = state["world_size"]
            if world_size == self.dist.world_size:
                self.module.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.scheduler.load_state_dict(state["scheduler"])
                self.scaler.load_state_dict(state["scaler"])
        except (pickle.UnpicklingError, EOFError, RuntimeError, KeyError, TypeError, IndexError) as exc:
            reason = " ".join(str(exc).split())[:300]
            raise ValueError(f"--resume: {self.run.checkpoint_path} cannot be loaded: {reason}") from None
        if world_size != self.dist.world_size:
            raise ValueError(f"--resume: checkpoint was written by {world_size} processes, "
                             f"this run has {self.dist.world_size}; the data order would differ")
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.extra = state["extra"]
        self._saved_step = self.step
        set_rng_state(state["rng"])
        self.run.log("resume", step=self.step, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch)

    # -- loop --------------------------------------------------------------------------
    def fit(self) -> str:
        """Train until the step budget, the epochs or the time limit run out; returns why it stopped."""
        o = self.opts
        started = time.monotonic()
        self.run.log("start", step=self.step, epoch=self.epoch, total_steps=self.total_steps,
                     world_size=self.dist.world_size)
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not self.dist.is_main,
                   desc="train", unit="step", dynamic_ncols=True)
        window = {"loss": 0.0, "n": 0, "tokens": 0, "examples": 0, "t": time.monotonic()}
        logs_sum: dict[str, float] = {}
        stop = "done"
        while self.step < self.total_steps and (o.max_steps or self.epoch < o.epochs):
            self.sampler.set_epoch(self.epoch)
            # an own generator: a DataLoader otherwise draws its base seed from the global RNG,
            # and a resumed run (one more loader) would then see different dropout masks
            loader = DataLoader(self.dataset, batch_size=o.batch_size, collate_fn=self.collate,
                                sampler=_Skip(self.sampler, self.batch_in_epoch * o.batch_size),
                                generator=torch.Generator().manual_seed(o.seed + self.epoch))
            n_batches = self.batch_in_epoch + len(loader)
            self.module.train()
            for batch in loader:
                self.batch_in_epoch += 1
                last_micro = self.batch_in_epoch % o.grad_accum == 0 or self.batch_in_epoch == n_batches
                loss, logs = self._micro_step(batch, sync=last_micro)
                window["loss"] += loss
                window["n"] += 1
                window["tokens"] += int(batch["attention_mask"].sum())
                window["examples"] += len(batch["attention_mask"])
                for k, v in logs.items():
                    logs_sum[k] = logs_sum.get(k, 0.0) + v
                if not last_micro:
                    continue
                self._optimizer_step()
                bar.update(1)
                if self.step % o.log_every == 0 or self.step == self.total_steps:
                    self._log(bar, window, logs_sum)
                    logs_sum = {}
                if self.step % o.save_every == 0:
                    self.save()
                if self.step >= self.total_steps:
                    break
                if o.max_minutes and self._elapsed_over(started):
                    stop = "time limit"
                    break
            if stop != "done":
                break
            if self.batch_in_epoch >= n_batches:
                self._end_epoch()
        if self._saved_step != self.step:
            self.save()
        bar.close()
        self.run.log("stop", step=self.step, epoch=self.epoch, reason=stop,
                     minutes=round((time.monotonic() - started) / 60, 2))
        return stop

    def _micro_step(self, batch: Batch, *, sync: bool) -> tuple[float, dict[str, float]]:
        batch = self.prepare(batch)
        no_sync = self.wrapped.no_sync() if self.dist.enabled and not sync else contextlib.nullcontext()
        with no_sync:
            with autocast(self.amp):
                loss, logs = self.wrapped(batch)
            self.scaler.scale(loss / self.opts.grad_accum).backward()
        return float(loss.detach()), logs

    def _optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.opts.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def _end_epoch(self) -> None:
        epoch = self.epoch
        self.epoch += 1
        self.batch_in_epoch = 0
        metrics = self.on_epoch_end(epoch) if self.on_epoch_end is not None else {}
        self.run.log("epoch", epoch=epoch, step=self.step, **metrics)
        self.save()

    def _elapsed_over(self, started: float) -> bool:
        over = torch.tensor(float(time.monotonic() - started > self.opts.max_minutes * 60))
        if self.dist.enabled:  # every rank must stop at the same step, or DDP would hang
            torch.distributed.all_reduce(over, op=torch.distributed.ReduceOp.MAX)
        return bool(over)

    def _log(self, bar: tqdm, window: dict, logs_sum: dict[str, float]) -> None:
        dt = max(1e-9, time.monotonic() - window["t"])
        n = max(1, window["n"])
        record = {"loss": window["loss"] / n, "lr": self.scheduler.get_last_lr()[0],
                  "tokens_per_s": window["tokens"] * self.dist.world_size / dt,
                  "examples_per_s": window["examples"] * self.dist.world_size / dt,
                  **{k: v / n for k, v in logs_sum.items()}}
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.run.log("train", step=self.step, epoch=self.epoch, **record)
        window.update(loss=0.0, n=0, tokens=0, examples=0, t=time.monotonic())


def _adamw(module: nn.Module, o: TrainOptions) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and LayerNorm weights (BERT's recipe) and on parameters matched
    by ``o.no_decay``; parameters matched by ``o.lr_scales`` get their own group at the scaled learning rate."""
    groups: dict[tuple[bool, float], list] = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            plain = (p.ndim < 2 or "LayerNorm" in name or "norm" in name.lower()
                     or any(name.endswith(suffix) for suffix in o.no_decay))
            scale = next((f for suffix, f in o.lr_scales if name.endswith(suffix)), 1.0)
            groups.setdefault((not plain, scale), []).append(p)
    if not groups:
        raise ValueError("the module has no trainable parameters")
    # the two BERT groups always exist (in this order) so that optimizer checkpoints keep their shape
    for key in ((True, 1.0), (False, 1.0)):
        groups.setdefault(key, [])
    order = sorted(groups, key=lambda k: (k[1] != 1.0, not k[0], k[1]))
    return torch.optim.AdamW([{"params": groups[k], "weight_decay": o.weight_decay if k[0] else 0.0,
                               "lr": o.lr * k[1]} for k in order], lr=o.lr)
