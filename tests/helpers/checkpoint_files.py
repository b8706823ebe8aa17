"""Checkpoint folders laid out as FSDP2 writes them, for tests of how damaged ones are handled."""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from sparsebalance_pl import checkpoints


def write_checkpoint(folder: Path, step: int) -> Path:
    """A complete one-rank checkpoint folder, laid out as ``ModelParallelStrategy`` writes it."""
    dcp.save({"state_dict": {"w": torch.full((256,), float(step))}}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": step}, folder / checkpoints.META)
    return folder


def checkpoint_step(folder: Path) -> int:
    return torch.load(folder / checkpoints.META)["global_step"]
