"""Fully sharded data parallelism (FSDP2) for Lightning on GPU and CPU.

Lightning 2.6's ``strategy="fsdp"`` (FSDP1) refuses ``accelerator="cpu"``. ``ModelParallelStrategy`` runs
FSDP2 (``fully_shard``) on CPU with gloo and on GPU with NCCL, but its ``"auto"`` sizes mean one data-parallel
rank per *node* and tensor parallelism inside the node. ``FSDP2Strategy`` makes every process a data-parallel
rank instead, which is what training with packed micro-batches needs.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with every process one data-parallel rank (no tensor parallelism)."""

    def setup_environment(self) -> None:
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()


def apply_fully_shard(
    root: torch.nn.Module,
    layers: list[torch.nn.Module],
    mesh,
    param_dtype: torch.dtype | None = None,
) -> None:
    """Shard each transformer layer as its own FSDP2 unit, then the root (embeddings, final norm, LM head).

    One unit per layer lets the all-gather of layer i+1 overlap the compute of layer i; the root keeps the
    tied embedding and LM head together in one unit.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)
