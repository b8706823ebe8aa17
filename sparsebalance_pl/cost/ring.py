"""The ring's communication: what a context-parallel group's ranks wait for beyond their own attention compute.

A rank of a group of W sharing a stream of T tokens sends and receives, per layer, W - 1 K/V messages of its
T / W rows in the forward, W - 1 again in the backward (K/V travel round once more) and W - 1 fp32 dK/dV
partials travelling behind them (``kernels/ring.py``)::

    ring(T, W) = s_ring * L * (W - 1) * (3 * latency + (2 * kv_bytes + grad_bytes) * (T / W) / bandwidth)

with kv_bytes the K and V of one token of one layer in the attention's dtype and grad_bytes their gradients
in fp32 (the two sums of the documents' sink blocks, a few blocks each, are left to the scale). Compute hides
part of it (each transfer overlaps a step's tiles), so what a rank waits for is less; the scale s_ring is
learned from the measured waits (``SparsityReport.ring_seconds``) and starts at 1, so the bandwidth and latency
are only a prior. The waits are the group's least: a rank also waits on a slower member, which is that member's
compute, not communication.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The priors: a transfer's fixed seconds and the link's bytes per second (about what two gloo processes on one
#: host reach; NVLink is ~50x faster). The first measured steps correct them through the scale.
PRIOR_LATENCY_S = 2e-5
PRIOR_BANDWIDTH = 5e9
_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_MIN_LOG_SCALE, _MAX_LOG_SCALE = -7.0, 7.0


@dataclass
class RingCost:
    """Predicted seconds a rank of a context-parallel group waits on the ring over one micro-batch (module
    docstring), all layers, forward and backward; learned online from measured waits.

    Args:
        num_layers: attention layers (each runs one ring in the forward and one in the backward).
        kv_bytes: bytes of one token's K and V in one layer, in the attention's dtype.
        grad_bytes: bytes of one token's dK and dV partials in one layer (fp32).
        latency: prior seconds per transfer; bandwidth: prior bytes per second of a link.
        smoothing: weight of each new measurement in the learned scale once a few are in, in (0, 1].
    """

    num_layers: int
    kv_bytes: float
    grad_bytes: float
    latency: float = PRIOR_LATENCY_S
    bandwidth: float = PRIOR_BANDWIDTH
    smoothing: float = 0.3
    log_scale: float = 0.0
    observed: int = 0

    @classmethod
    def for_model(cls, dims: Mapping[str, int], dtype: str = "float32", **settings: Any) -> RingCost:
        """The ring of a model with these cost dimensions (``LatencyTable.meta.dims``) attending in ``dtype``
        (a dtype of unknown size counts 4 bytes: the prior is corrected by the measurements anyway)."""
        row = 2 * dims["num_kv_heads"] * dims["head_dim"]
        return cls(dims["num_layers"], row * _BYTES.get(dtype, 4), row * 4, **settings)

    def prior_seconds(self, num_tokens: float, group_size: int) -> float:
        """The unscaled formula: every transfer exposed, at the prior latency and bandwidth."""
        if group_size <= 1 or num_tokens <= 0:
            return 0.0
        rows = num_tokens / group_size
        per_step = 3 * self.latency + (2 * self.kv_bytes + self.grad_bytes) * rows / self.bandwidth
        return self.num_layers * (group_size - 1) * per_step

    def seconds(self, num_tokens: float, group_size: int) -> float:
        """Predicted seconds of waiting on the ring for a shared stream of ``num_tokens`` (0 without a group)."""
        return math.exp(self.log_scale) * self.prior_seconds(num_tokens, group_size)

    def observe(self, num_tokens: float, group_size: int, seconds: float) -> None:
        """Learn from one group's measured wait (its least-waiting rank's) on a stream of ``num_tokens``: a
        running mean of log(measured / prior), over all measurements at first and then the recent ones."""
        prior = self.prior_seconds(num_tokens, group_size)
        if prior <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        ratio = math.log(max(seconds, prior * math.exp(_MIN_LOG_SCALE)) / prior)  # fully hidden: the floor
        self.observed += 1
        weight = max(1.0 / self.observed, self.smoothing)
        self.log_scale = min(max(self.log_scale + weight * (ratio - self.log_scale), _MIN_LOG_SCALE), _MAX_LOG_SCALE)

    def state_dict(self) -> dict[str, float]:
        return {"log_scale": self.log_scale, "observed": self.observed}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.log_scale = float(state.get("log_scale", 0.0))
        self.observed = int(state.get("observed", 0))
