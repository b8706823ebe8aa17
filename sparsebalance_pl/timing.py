"""Timing a function's forward and backward where no collective runs: what the cost model learns from.

Under FSDP or DDP every rank's whole step lasts as long as the slowest rank's (a fast rank waits inside the
next all-gather or the gradient all-reduce), so step times cannot tell ranks apart. The attention calls
themselves hold no collective: timed around them, forward and backward, each rank's own cost shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["AttentionTimer"]


class AttentionTimer:
    """Seconds spent in the attention calls of one micro-batch, forward and backward, free of collectives.

    Each call is bracketed in the forward directly and in the backward by identity autograd nodes on its
    output (backward starts) and on its inputs (backward done); autograd runs a layer's attention nodes
    before any node created earlier in the forward. On CUDA the brackets are events on the stream, read by
    ``seconds()`` after the step, so timing never synchronises the device inside the layers; on the CPU
    ``perf_counter``.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._open: dict[tuple[str, int], object] = {}
        self._cpu_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _now(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, key: tuple[str, int]) -> None:
        self._open[key] = self._now()

    def stop(self, key: tuple[str, int]) -> None:
        begun = self._open.pop(key, None)
        if begun is None:
            return
        if self.cuda:
            self._events.append((begun, self._now()))
        else:
            self._cpu_seconds += time.perf_counter() - begun

    def seconds(self) -> float:
        """Total so far; on CUDA waits for the last recorded event (call it after the step)."""
        if not self._events:
            return self._cpu_seconds
        self._events[-1][1].synchronize()
        return self._cpu_seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000.0

    def timed(self, layer: int, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(*inputs)`` with its forward and (when inputs need gradients) its backward timed."""
        track_backward = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        if track_backward:
            inputs = _BackwardMark.apply(lambda: self.stop(("backward", layer)), *inputs)
        self.start(("forward", layer))
        out = fn(*inputs)
        self.stop(("forward", layer))
        if track_backward:
            (out,) = _BackwardMark.apply(lambda: self.start(("backward", layer)), out)
        return out


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward calls ``hook`` once all gradients of its outputs have arrived."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        ctx.hook()
        return (None, *grads)
