"""Embedding a list of token sequences in length-sorted batches: the shared embedder of ``eval`` and of
``finetune``'s validation."""

from __future__ import annotations

import time
from typing import Callable

import torch
from tqdm.auto import tqdm

from .data import pad_batch

Embed = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def embed_all(embed: Embed, ids: list[torch.Tensor], *, pad_id: int, batch_size: int,
              device: torch.device, desc: str | None = None) -> tuple[torch.Tensor, float]:
    """Embed every sequence (batched by length, returned in input order) → ((n, D) fp32, seconds).

    ``desc`` shows a progress bar (texts/s) under that name."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[torch.Tensor | None] = [None] * len(ids)
    start_t = time.perf_counter()
    bar = tqdm(total=len(ids), desc=desc, unit="text", disable=desc is None, dynamic_ncols=True)
    for s in range(0, len(order), batch_size):
        chunk = order[s:s + batch_size]
        batch = pad_batch([{"input_ids": ids[i]} for i in chunk], pad_id)
        vecs = embed(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu()
        for i, v in zip(chunk, vecs):
            out[i] = v
        bar.update(len(chunk))
    bar.close()
    return torch.stack(out), time.perf_counter() - start_t
