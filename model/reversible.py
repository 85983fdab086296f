"""Reformer's reversible residual layers (RevNet; Kitaev et al., 2020, §3) for the encoder stack.

With ``config.reversible`` the hidden state is duplicated into (x1, x2) and every layer computes

    y1 = x1 + F(x2)        F = attention branch: dropout(dense(attention(LayerNorm(x))))
    y2 = x2 + G(y1)        G = feed-forward branch: dropout(dense(act(dense(LayerNorm(x)))))

and the stack returns (y1 + y2) / 2. The inputs of a layer are recomputed from its outputs in
the backward pass (x2 = y2 − G(y1), x1 = y1 − F(x2)), so activations are stored for one layer,
not for all L. The post-LN BERT block is not invertible, so a reversible model runs each
sub-block's LayerNorm before its branch (pre-LN) with the same parameters (same state-dict
keys): it is a different function than the ordinary stack and is meant to be trained as such.

Dropout is made repeatable by recording the RNG state before each branch and replaying it in
the recomputation (YOSO and Reformer hashing are seeded, so they repeat by themselves).
Parameter gradients are accumulated into ``.grad`` during the recomputation: use
``loss.backward()`` (``torch.autograd.grad`` on parameters would not see them).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import get_device_states, set_device_states


class Deterministic:
    """Call ``fn`` recording the RNG state (CPU, and CUDA when in use), or replaying the recorded one."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        self.fn = fn
        self.cpu_state = None
        self.gpu_devices, self.gpu_states = [], []

    def __call__(self, x: torch.Tensor, *, record: bool = False, replay: bool = False) -> torch.Tensor:
        if record:
            self.cpu_state = torch.get_rng_state()
            if x.is_cuda:
                self.gpu_devices, self.gpu_states = get_device_states(x)
        if not replay:
            return self.fn(x)
        with torch.random.fork_rng(devices=self.gpu_devices):
            torch.set_rng_state(self.cpu_state)
            if self.gpu_devices:
                set_device_states(self.gpu_devices, self.gpu_states)
            return self.fn(x)


class ReversibleBlock:
    """One layer as (F, G); forward without a graph, and the backward that rebuilds its inputs."""

    def __init__(self, f: Callable, g: Callable):
        self.f, self.g = Deterministic(f), Deterministic(g)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, *, record: bool) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.f(x2, record=record)
        return y1, x2 + self.g(y1, record=record)

    def backward_pass(self, y1, y2, dy1, dy2):
        """(outputs, their grads) → (inputs, their grads); parameter grads accumulate into ``.grad``."""
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            g_y1 = self.g(y1, replay=True)
            torch.autograd.backward(g_y1, dy2)
        with torch.no_grad():
            x2 = y2 - g_y1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_(True)
            f_x2 = self.f(x2, replay=True)
            torch.autograd.backward(f_x2, dx1)
        with torch.no_grad():
            x1 = y1 - f_x2
            dx2 = dy2 + x2.grad
        return x1.detach(), x2.detach(), dx1, dx2


class ReversibleFunction(torch.autograd.Function):
    """x (B, N, 2·hidden) = [x1; x2] → [y1; y2], storing only the stack's output for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, blocks: list[ReversibleBlock]) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        for block in blocks:
            x1, x2 = block.forward(x1, x2, record=True)
        ctx.blocks = blocks
        out = torch.cat([x1, x2], dim=-1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        y1, y2 = out.chunk(2, dim=-1)
        dy1, dy2 = grad.chunk(2, dim=-1)
        for block in reversed(ctx.blocks):
            y1, y2, dy1, dy2 = block.backward_pass(y1, y2, dy1, dy2)
        return torch.cat([dy1, dy2], dim=-1), None


def reversible_stack(blocks: list[ReversibleBlock], hidden: torch.Tensor, *,
                     memory_saving: bool = True) -> torch.Tensor:
    """hidden (B, N, h) through the reversible blocks → (B, N, h) = (y1 + y2) / 2.

    ``memory_saving`` runs :class:`ReversibleFunction` whenever a graph is being built; False
    (or no grad) runs the same math with ordinary autograd, which stores every activation.
    """
    if memory_saving and torch.is_grad_enabled():
        x = torch.cat([hidden, hidden], dim=-1)
        if not x.requires_grad:  # frozen embeddings: the layers' parameters still need the backward to run
            x.requires_grad_(True)
        y1, y2 = ReversibleFunction.apply(x, blocks).chunk(2, dim=-1)
    else:
        y1, y2 = hidden, hidden
        for block in blocks:
            y1, y2 = block.forward(y1, y2, record=False)
    return (y1 + y2) / 2
