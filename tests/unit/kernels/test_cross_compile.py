"""Compiling the Triton kernels for a GPU that is not here: the compilation itself needs a process without
Triton's interpreter, and runs in the GPU check's smoke run (tests/unit/test_gpu_check.py); here, its guard."""

import pytest
from triton.backends.compiler import GPUTarget

from sparsebalance_pl.kernels.cross_compile import OfflineDriver, compiling_for


def test_compiling_for_a_gpu_needs_the_compiler_not_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with compiling_for(GPUTarget("cuda", 90, 32)):
            pass


def test_a_target_without_a_shared_memory_figure_is_refused():
    assert OfflineDriver(GPUTarget("cuda", 86, 32)).utils.get_device_properties(0) == {"max_shared_mem": 99 * 1024}
    with pytest.raises(ValueError, match="no shared memory figure for sm_61; known: sm_70, sm_72, sm_75, sm_80"):
        OfflineDriver(GPUTarget("cuda", 61, 32))
