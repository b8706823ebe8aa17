"""How a package's public names resolve beyond its own imports: names that load on first use (PEP 562), for
packages whose import must stay light, and names that moved to another module, which keep working with a
warning naming their new home until the next minor version."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

#: The release from which a moved name resolves only at its new home.
MOVED_NAMES_REMOVED_IN = "0.3"


def lazy_exports(
    package: str, exports: Mapping[str, str], moved: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``, where ``exports`` maps each public name to
    the submodule defining it (relative, ``".attention"``), imported on first access and kept, and ``moved`` maps
    each name that left ``package`` to the module that exports it now (absolute): it resolves there, with a
    ``FutureWarning`` at every access."""
    namespace = sys.modules[package].__dict__
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(
                f"{package}.{name} moved to {moved[name]}.{name}; import it from there (the old path stops "
                f"working in sparsebalance-pl {MOVED_NAMES_REMOVED_IN})",
                FutureWarning,
                stacklevel=2,
            )
            return getattr(import_module(moved[name]), name)
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(exports[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
