"""Checkpoint folders written as FSDP2 writes them, for tests of how damaged ones are handled."""

from pathlib import Path

import torch

from sparsebalance_pl import checkpoints
from sparsebalance_pl.strategy import FSDP2Strategy


def write_checkpoint(folder: Path, step: int, checksums: bool = True) -> Path:
    """A complete one-rank checkpoint folder saved by ``FSDP2Strategy`` (``checksums=False``: as it was saved
    before their digests were recorded)."""
    FSDP2Strategy().save_checkpoint({"state_dict": {"w": torch.full((256,), float(step))}, "global_step": step}, folder)
    if not checksums:
        (folder / checkpoints.CHECKSUMS).unlink()
    return folder


def checkpoint_step(folder: Path) -> int:
    return torch.load(folder / checkpoints.META)["global_step"]


def flip_bytes(path: Path, count: int = 4096) -> None:
    """Invert ``count`` bytes in the middle of the file in place, its size unchanged: damage that only its
    content shows."""
    with open(path, "r+b") as f:
        start = max(0, (path.stat().st_size - count) // 2)
        f.seek(start)
        data = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
