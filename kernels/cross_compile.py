"""Compiling this package's Triton kernels for a GPU that is not here, to read what each needs of it.

Triton compiles for a named architecture without the GPU. ``compiling_for`` makes every kernel launch of the work
inside compile through Triton's own ``warmup`` (with the specialisations a real launch makes: aligned pointers,
integers divisible by 16 or equal to 1) against a driver that only names the target; run the work on meta
tensors, whose shapes and dtypes carry it from launch to launch without data. ``resource_usage`` then reads each
binary's registers, spilled bytes and shared memory: a kernel that spills on a GPU nobody has lent shows here.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from contextlib import contextmanager

import torch
import triton
from triton.backends.driver import DriverBase
from triton.runtime import driver

from .launches import compiled_not_run


#: Shared memory one program may use (the opt-in maximum per thread block) in KiB, by CUDA compute capability, from
#: the CUDA C++ Programming Guide's table of compute capabilities: what a launch on such a GPU may take.
SHARED_MEMORY_KIB = {70: 96, 72: 96, 75: 64, 80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 103: 227, 110: 227,
                     120: 99, 121: 99}


class OfflineDriver(DriverBase):
    """Triton's view of a GPU that is not here: its target, a device named after it (Triton keeps compiled
    kernels per device, so that two targets in one process keep theirs apart) with stream 0, and the properties
    a launch reads of it (``utils.get_device_properties``, as Triton's CUDA driver has them)."""

    def __init__(self, target) -> None:
        super().__init__()
        if target.arch not in SHARED_MEMORY_KIB:
            known = ", ".join(f"sm_{arch}" for arch in SHARED_MEMORY_KIB)
            raise ValueError(f"no shared memory figure for sm_{target.arch}; known: {known}")
        self.target = target
        self.utils = _OfflineProperties(SHARED_MEMORY_KIB[target.arch] * 1024)

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("nothing is launched offline")

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def get_benchmarker(self):
        raise NotImplementedError("nothing is timed offline")

    def get_current_device(self) -> str:
        return f"offline {self.target.backend} {self.target.arch}"

    def get_current_stream(self, device: str | None = None) -> int:
        return 0


class _OfflineProperties:
    def __init__(self, shared_memory: int) -> None:
        self.shared_memory = shared_memory

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.shared_memory}


@contextmanager
def compiling_for(target):
    """Inside, every Triton kernel the work launches is compiled for ``target`` (a
    ``triton.backends.compiler.GPUTarget``, e.g. ``GPUTarget("cuda", 90, 32)`` for H100 and H200) instead of run,
    and appended to the yielded list."""
    if triton.knobs.runtime.interpret:
        raise RuntimeError("compiling for a GPU needs Triton's compiler, not its interpreter: unset TRITON_INTERPRET")
    try:
        previous = driver.active
    except RuntimeError:  # no GPU, hence no driver of Triton's own yet; None restores just that
        previous = None
    driver.set_active(OfflineDriver(target))
    try:
        with compiled_not_run() as compiled:
            yield compiled
    finally:
        driver.set_active(previous)


def resource_usage(compiled) -> dict[str, int]:
    """What a kernel from ``compiling_for`` needs of its GPU: registers and stack bytes per thread (a stack is
    registers spilled to local memory, in these kernels, which hold no arrays) and shared memory bytes per
    program, read from its binary with the ``cuobjdump`` that Triton ships; and its pipeline stages."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as binary:
        binary.write(compiled.asm["cubin"])
        binary.flush()
        listing = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", binary.name], check=True,
                                 capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", listing)
    return {"registers": int(found[1]), "stack_bytes": int(found[2]), "shared_bytes": compiled.metadata.shared,
            "stages": compiled.metadata.num_stages}
