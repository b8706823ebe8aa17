"""Compiling the Triton kernels for a GPU that is not here: the compilation itself needs a process without
Triton's interpreter, and runs in the GPU check's smoke run (tests/unit/test_gpu_check.py); here, its guard."""

import pytest
from triton.backends.compiler import GPUTarget

from sparsebalance_pl.kernels.cross_compile import compiling_for


def test_compiling_for_a_gpu_needs_the_compiler_not_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with compiling_for(GPUTarget("cuda", 90, 32)):
            pass
