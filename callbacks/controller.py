"""Moved: DST's controller lives in ``sparsebalance_pl.dst`` beside the other algorithms. Its names still resolve
here, with a warning naming their new home, until the next minor version."""

from sparsebalance_pl.lazy_exports import lazy_exports

_MOVED = ("DSTController", "Decision", "TRUSTED_ERROR", "check_settings", "confidence")
__getattr__, __dir__ = lazy_exports(__name__, {}, moved=dict.fromkeys(_MOVED, "sparsebalance_pl.dst"))
