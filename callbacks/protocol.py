"""Moved: what DST needs of a module is now one attribute, ``sparse_attention`` (``sparsebalance_pl.attention.
SparsityTunable``), and the names this module re-exported live in their own homes. They still resolve here, with a
warning naming that home, until the next minor version."""

from sparsebalance_pl.callbacks import _MOVED
from sparsebalance_pl.lazy_exports import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {}, moved=_MOVED)
