"""Shared test setup.

Triton kernels are tested on the CPU through Triton's interpreter, which must be switched on before
triton is first imported (the choice is made when a kernel is decorated), hence at conftest import.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
