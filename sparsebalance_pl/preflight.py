"""Checks of a run's Trainer settings that need neither data nor processes, made in the launching process before
anything is built: a mistake they catch costs a second, not a corpus build and a launch of every rank.

Each raises ``ConfigError`` naming the setting; ``main.py`` calls them for ``fit``, ``validate`` and ``test``
(``SparseBalanceCLI.before_instantiate_classes``). Lightning checks the other Trainer settings when it builds the
Trainer, also before the launch, and ``main.py`` prints what it raises in one line as well.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

from sparsebalance_pl import checkpoints
from sparsebalance_pl.errors import ConfigError

CPU_CONFIG = "configs/demo.yaml"
"""The configuration that trains on the CPU, named to whoever has no GPU."""

_GPU_BACKENDS = {"gpu": (CUDAAccelerator, MPSAccelerator), "cuda": (CUDAAccelerator,), "mps": (MPSAccelerator,)}

_PICKED_BY_LIGHTNING = (None, "last", "hpc")
"""``ckpt_path`` values for which Lightning picks the checkpoint: none (under SLURM, the newest ``hpc_ckpt_<n>``),
``last`` and ``hpc``."""


def check_accelerator(accelerator: object, configs: Sequence[object] = ()) -> None:
    """A configuration that trains on GPUs, on a machine without one: say so, and which one trains on the CPU."""
    backends = _GPU_BACKENDS.get(accelerator) if isinstance(accelerator, str) else None
    if backends is None or any(backend.is_available() for backend in backends):
        return
    named = ", ".join(str(config) for config in configs) or "this configuration"
    raise ConfigError(
        f"{named} trains on GPUs (trainer.accelerator={accelerator}) and this machine has none; "
        f"{CPU_CONFIG} trains on the CPU"
    )


def check_kernel_backend(attention: object, accelerator: object) -> None:
    """FlexAttention has no backward on the CPU: a fit with ``kernel_backend: flex`` needs a GPU to train on."""
    if getattr(attention, "kernel_backend", None) != "flex":
        return
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not CUDAAccelerator.is_available())
    if on_cpu:
        raise ConfigError(
            "model.attention.kernel_backend=flex trains on CUDA only (FlexAttention has no backward on the CPU); "
            "use torch or auto on the CPU"
        )


def check_ckpt_path(ckpt_path: str | None) -> None:
    """A checkpoint path that names nothing: say so before the ranks start, and what a save cut short left."""
    if ckpt_path is None or ckpt_path in _PICKED_BY_LIGHTNING or ckpt_path.startswith("registry") or "://" in ckpt_path:
        return  # Lightning's special values and remote paths are resolved by Lightning
    path = Path(ckpt_path)
    if not os.path.lexists(path):
        raise ConfigError(checkpoints.refusal(path) or f"ckpt_path={ckpt_path}: no such checkpoint")


def picked_by_lightning(ckpt_path: str | None) -> bool:
    """Whether Lightning picks the checkpoint to load for the user (``FSDP2Strategy.fall_back_to_intact``)."""
    return ckpt_path in _PICKED_BY_LIGHTNING
