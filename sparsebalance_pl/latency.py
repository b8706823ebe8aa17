"""The latency model under its public name (``sparsebalance_pl.latency.LatencyModel``); it lives in
``sparsebalance_pl.cost.latency`` beside the rest of the cost model."""

from sparsebalance_pl.cost.latency import (
    TERMS,
    LatencyModel,
    LatencyTable,
    LatencyTableError,
    OnlineCalibration,
    TableMeta,
    UnreachableTimeError,
    kept_tiles,
)

__all__ = [
    "TERMS",
    "LatencyModel",
    "LatencyTable",
    "LatencyTableError",
    "OnlineCalibration",
    "TableMeta",
    "UnreachableTimeError",
    "kept_tiles",
]
