"""Compiling the Triton kernels for a GPU that is not here. The compilation itself needs a process without
Triton's interpreter, which the tests run under: the GPU check's smoke run compiles one layer for sm_90 there
(tests/unit/test_gpu_check.py). Here, the guards around it."""

import pytest
import torch
from triton.backends.compiler import GPUTarget

from sparsebalance_pl.kernels.attention_triton import _fwd_kernel
from sparsebalance_pl.kernels.cross_compile import compiling_for
from sparsebalance_pl.kernels.launches import compiled_not_run, launch


def test_compiling_for_a_gpu_needs_the_compiler_not_the_interpreter():
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        with compiling_for(GPUTarget("cuda", 90, 32)):
            pass


def test_a_kernel_given_real_tensors_is_neither_compiled_nor_run_in_their_place():
    out = torch.zeros(4)
    with compiled_not_run() as compiled, pytest.raises(RuntimeError, match="_fwd_kernel: .* pass meta tensors"):
        launch(_fwd_kernel, (1,), out)
    assert compiled == [] and not out.any()
