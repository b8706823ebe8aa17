"""Context-parallel groups: W neighbouring ranks that share one packed stream, block-striped.

The strategy creates the groups once (``create_context_parallel``) and owns them; the data module plans for
the world's W-rank slots, the module stripes each stream across its group, and the attention plug-in runs
the ring (``sparsebalance_pl.kernels.sparse_ring_attention``) over it. A group of one is plain data
parallelism. Groups are neighbouring ranks, so a group within a node talks over the node's fast links; a
group spanning nodes spans whole nodes and runs the hierarchical ring (inner ring within a node, outer ring
across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sparsebalance_pl.errors import ConfigError


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group: ``size`` ranks, this rank's place ``rank`` in it, the process
    ``group`` (None for a group of one), and ``node_size``, the group's ranks per node when it spans nodes
    (None: one flat ring)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    node_size: int | None = None

    @property
    def active(self) -> bool:
        return self.size > 1


def check_size(size: int) -> None:
    """One line naming the setting unless ``size`` is a positive int."""
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"trainer.strategy.init_args.context_parallel_size={size!r} must be a positive int")


def context_parallel_groups(world_size: int, size: int, ranks_per_node: int) -> list[list[int]]:
    """The context-parallel groups of ``size`` neighbouring ranks; one line naming the problem when the size
    does not divide the world, or spans nodes unevenly (part of a node, or a node split between groups)."""
    check_size(size)
    if world_size % size:
        raise ConfigError(
            f"trainer.strategy.init_args.context_parallel_size={size} does not divide the world of {world_size} ranks"
        )
    if size > ranks_per_node and size % ranks_per_node:
        raise ConfigError(
            f"trainer.strategy.init_args.context_parallel_size={size} spans nodes unevenly: a group larger than a "
            f"node ({ranks_per_node} ranks) must span whole nodes"
        )
    if size < ranks_per_node and ranks_per_node % size:
        raise ConfigError(
            f"trainer.strategy.init_args.context_parallel_size={size} spans nodes unevenly: it does not divide a "
            f"node's {ranks_per_node} ranks, so some group would straddle two nodes"
        )
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def create_context_parallel(size: int, ranks_per_node: int, timeout: timedelta | None = None) -> ContextParallel:
    """Every rank's groups (collective: all ranks call it alike, after the default group exists); returns this
    rank's. Ring transfers wait at most ``timeout``, then name the rank, the layer and the ring step."""
    world, me = dist.get_world_size(), dist.get_rank()
    groups = context_parallel_groups(world, size, ranks_per_node)
    if size == 1:
        return ContextParallel()
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout)  # every rank creates every group, in the same order
        if me in ranks:
            mine = group
    node_size = ranks_per_node if size > ranks_per_node else None
    return ContextParallel(size=size, rank=me % size, group=mine, node_size=node_size)
