"""Shared test setup.

Tests mirror the package: ``unit/`` holds one file per module (``unit/kernels``, ``unit/cost``, ...), and
``multiprocess/`` the runs of several ranks or of ``main.py`` in subprocesses. ``helpers/`` holds what tests
share (running ``main.py``, gloo ranks, fault-injection callbacks, a minimal tunable module); pytest puts it on the
import path (``pythonpath`` in pyproject.toml).

Triton kernels are tested on the CPU through Triton's interpreter, which must be switched on before
triton is first imported (the choice is made when a kernel is decorated), hence at conftest import.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
