"""Makes the packages that the GPU machine's image lacks unimportable, as they are there (the device tool's
KINDS.md lists the image's packages): with this folder on PYTHONPATH, ``scripts/gpu_check.sh smoke`` shows that
the GPU check needs nothing carried to that machine."""

import importlib.abc
import sys

ABSENT_ON_THE_GPU_IMAGE = {"litdata", "omegaconf", "jsonargparse"}


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ABSENT_ON_THE_GPU_IMAGE:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU image)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
