"""SparseBalance for PyTorch Lightning: load-balanced long-context training with dynamic sparse attention.

The top-level folders ``kernels/``, ``callbacks/`` and ``datamodules/`` are installed as subpackages of
``sparsebalance_pl`` (see pyproject.toml). When the code runs from a source checkout instead of an
install, the repository root is appended to this package's search path so that the same folders resolve
as ``sparsebalance_pl.kernels`` and friends without ever becoming top-level import names.
"""

from pathlib import Path as _Path

_repo_root = _Path(__file__).resolve().parent.parent
if (_repo_root / "pyproject.toml").is_file() and (_repo_root / "kernels").is_dir():
    __path__.append(str(_repo_root))  # noqa: F821 - __path__ is defined for packages

__version__ = "0.2.0"
