"""Shared test setup.

Tests mirror the package: ``unit/`` holds one file per module (``unit/kernels``, ``unit/cost``, ...), and
``multiprocess/`` the runs of several ranks or of ``main.py`` in subprocesses. ``helpers/`` holds what tests
share (running ``main.py``, gloo ranks, fault-injection callbacks, a minimal tunable module); it is put on the
import path here.

Triton kernels are tested on the CPU through Triton's interpreter, which must be switched on before
triton is first imported (the choice is made when a kernel is decorated), hence at conftest import.
"""

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
