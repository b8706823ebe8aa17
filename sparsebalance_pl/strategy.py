"""Fully sharded data parallelism (FSDP2) for Lightning on GPU and CPU.

Lightning 2.6's ``strategy="fsdp"`` (FSDP1) refuses ``accelerator="cpu"``. ``ModelParallelStrategy`` runs
FSDP2 (``fully_shard``) on CPU with gloo and on GPU with NCCL, but its ``"auto"`` sizes mean one data-parallel
rank per *node* and tensor parallelism inside the node. ``FSDP2Strategy`` makes every process a data-parallel
rank instead, which is what training with packed micro-batches needs. On the CPU each rank uses its share
of the node's cores unless ``OMP_NUM_THREADS`` says otherwise. ``context_parallel_size`` creates, beside FSDP
over all ranks, groups of neighbouring ranks that can share one stream (``sparsebalance_pl.context_parallel``).

Every collective waits at most ``timeout`` (Lightning's setting, ``h:m:s``; the default of 30 minutes also
covers the other ranks waiting while rank 0 builds the dataset in ``prepare_data``). Under gloo a collective
that times out or loses a peer raises on the waiting rank, and the run ends with an error naming that rank and
the global step. Under NCCL the process group's watchdog ends a timed-out process itself, naming the rank and
the collective.

Checkpoints are written in a hidden folder beside their path, their files' digests recorded, and moved there
once every rank has written its part; loading verifies them first (``sparsebalance_pl.checkpoints``), every
rank reading its share of the files. A rank killed while ``last.ckpt`` is written leaves the previous
``last.ckpt`` whole, and a SLURM job killed while ``hpc_ckpt_<n>`` is written is requeued to the one before. A
damaged checkpoint that the user named is refused with one line naming an intact one; one that Lightning picked
for them (``ckpt_path="last"``, SLURM's newest ``hpc_ckpt_<n>``) gives way to the newest intact checkpoint
beside it, with a warning naming both (``fall_back_to_intact``).
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from sparsebalance_pl import checkpoints
from sparsebalance_pl.context_parallel import ContextParallel, check_size, create_context_parallel
from sparsebalance_pl.distributed import gather_objects, is_collective_failure
from sparsebalance_pl.errors import TrainingError

__all__ = ["FSDP2Strategy", "apply_fully_shard", "attached_trainer"]

log = logging.getLogger(__name__)


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with every process one data-parallel rank (no tensor parallelism), FSDP over
    all ranks, and optionally context-parallel groups of ``context_parallel_size`` neighbouring ranks that
    share one packed stream each (``sparsebalance_pl.context_parallel``; 1: none).

    Args beyond ``ModelParallelStrategy``'s:
        context_parallel_size: ranks per context-parallel group; it must divide the world, and a node's ranks
            or span whole nodes.
    """

    fall_back_to_intact: bool = False
    """Whether the checkpoint to load was picked for the user (``ckpt_path="last"``, SLURM's newest
    ``hpc_ckpt_<n>``), so that, damaged, it gives way to the newest intact one beside it; a checkpoint the user
    named is loaded or refused. Set by whoever passes ``ckpt_path`` to the Trainer (``main.py`` does)."""

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        context_parallel_size: int = 1,
    ) -> None:
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint,
                         process_group_backend, timeout)
        check_size(context_parallel_size)
        self.timeout = timeout
        self.context_parallel_size = context_parallel_size
        self.context_parallel = ContextParallel()

    def setup_environment(self) -> None:
        if self._tensor_parallel_size == "auto":
            self._tensor_parallel_size = 1
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()
        self.context_parallel = create_context_parallel(self.context_parallel_size, self.num_processes, self.timeout)
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            _share_cores(self.num_processes)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """Write to ``.partial/<name>`` beside ``path`` and let rank 0 move it to ``path`` only after every rank
        has written its part, so that a kill during the save never leaves a partial checkpoint under the name."""
        path = Path(self.broadcast(filepath))
        checkpoints.check_replaceable(path)
        staging = checkpoints.staging_path(path)
        if self.is_global_zero:
            checkpoints.clear_staging(path)  # of what a save of this name that was cut short left
        self.barrier("checkpoint_staging")
        super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier("checkpoint_written")  # DCP's shards and .metadata, then rank 0's meta.pt
        sharded = self.is_global_zero and staging.is_dir()
        names = self.broadcast(checkpoints.checksummed_files(staging) if sharded else [])
        digests = self._digests(staging, names)
        if self.is_global_zero:
            if sharded:
                checkpoints.write_checksums(staging, digests)
            checkpoints.install(staging, path)
        self.barrier("checkpoint_installed")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint before anything of it is loaded, then load it as Lightning does; damaged, or
        missing after a save cut short, it stops every rank with one message, or gives way to the newest
        intact checkpoint beside it (``fall_back_to_intact``)."""
        path = Path(self.broadcast(checkpoint_path))
        recorded = self.broadcast(self._recorded_files(path) if self.is_global_zero else [])
        digests = self._digests(path, recorded)
        chosen = self.broadcast(self._checkpoint_to_load(path, digests) if self.is_global_zero else None)
        if isinstance(chosen, str):
            raise TrainingError(chosen)
        return super().load_checkpoint(chosen, weights_only)

    def _digests(self, folder: Path, names: list[str]) -> dict[str, str]:
        """The digests of ``folder``'s named files, each rank reading its share of them (every rank calls it)."""
        share = checkpoints.file_digests(folder, names[self.global_rank :: self.world_size])
        return {name: digest for shares in gather_objects(share) for name, digest in shares.items()}

    @staticmethod
    def _recorded_files(path: Path) -> list[str]:
        """The files of ``path`` whose digests were recorded when it was saved (none when it cannot tell)."""
        try:
            return sorted(checkpoints.recorded_checksums(path)) if path.is_dir() else []
        except ValueError:
            return []  # an unreadable record: ``checkpoints.damage`` says so

    def _checkpoint_to_load(self, path: Path, digests: dict[str, str]) -> Path | str:
        """Rank 0's decision: ``path``, the newest intact checkpoint beside it in its place, or the line to stop
        every rank with."""
        problem = checkpoints.problem(path, digests)
        if problem is None:
            self._warn_before_loading(path)
            return path
        intact = checkpoints.newest_intact(path.parent, other_than=path)
        if intact is None or not self.fall_back_to_intact:
            return f"{problem}; {checkpoints.instead(path, intact)}"
        rank_zero_warn(f"{problem}; loading the newest intact checkpoint beside it instead: {intact}")
        self._warn_before_loading(intact)
        return intact

    @staticmethod
    def _warn_before_loading(path: Path) -> None:
        """Say what loading ``path`` leaves aside: a cut-short save's leftovers, and content it cannot verify."""
        left = checkpoints.leftovers(path)
        if left:
            rank_zero_warn(
                f"{', '.join(str(p) for p in left)}: left by a save of {path} that was cut short, ignored (the "
                f"next save of {path.name} deletes it); loading the complete {path}"
            )
        unverified = checkpoints.unverified(path)
        if unverified is not None:
            rank_zero_warn(unverified)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Rename before deleting, so that a removal cut short leaves no damaged checkpoint under the name."""
        if self.is_global_zero:
            checkpoints.remove(Path(filepath))

    def on_exception(self, exception: BaseException) -> None:
        """Say which rank and step a failed collective belongs to, and stop the launched ranks.

        Gloo reports a timeout on the waiting rank only, as a bare RuntimeError; a rank stuck elsewhere (or
        the rank it waited for) would keep its process alive, so the run would hang instead of ending.
        """
        super().on_exception(exception)
        if not is_collective_failure(exception):
            return
        trainer = attached_trainer(self.lightning_module)  # None when it failed before the module was set
        where = f"at global step {trainer.global_step} (epoch {trainer.current_epoch})" if trainer else "at start"
        log.error(
            f"rank {self.global_rank} {where}: a "
            f"collective failed or did not complete within {self.timeout} (trainer.strategy.init_args.timeout, "
            "h:m:s): another rank is stuck, slower than that, or has stopped"
        )
        if self.launcher is not None:
            self.launcher.kill(signal.SIGKILL)


def attached_trainer(module: L.LightningModule | None) -> L.Trainer | None:
    """The Trainer ``module`` is attached to, or None (a module not yet, or no longer, in a run; Lightning's
    ``trainer`` property raises there)."""
    try:
        return None if module is None else module.trainer
    except RuntimeError:
        return None


def _share_cores(local_ranks: int) -> None:
    """Give each rank of this node its share of the cores, as torchrun does through OMP_NUM_THREADS.

    Every process otherwise starts as many threads as the node has cores: with two ranks on two cores the
    four threads contend, steps slow down, and the rank that loses more often looks like a straggler
    (measured on the 2-core demo: 8% longer steps, attention imbalance 1.13 instead of 1.06).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local_ranks)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)


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
