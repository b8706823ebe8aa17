"""The public API, module by module: a change to it is a visible change to this file. Every public name has one
import path, and a name that moved still resolves at its old one with a warning naming the new."""

import warnings
from importlib import import_module

import pytest

from sparsebalance_pl.lazy_exports import MOVED_NAMES_REMOVED_IN

PUBLIC_API = {
    "sparsebalance_pl.attention": [
        "ATTN_IMPLEMENTATION", "AttentionConfig", "MicroBatch", "SparseAttention", "SparsityTunable", "price_probes",
        "sparsebalance_attention", "varlen_causal_attention",
    ],
    "sparsebalance_pl.balance": ["balance_efficiency", "imbalance"],
    "sparsebalance_pl.callbacks": ["BatchPlanMonitor", "DensityCalibration", "DynamicSparsityTuning"],
    "sparsebalance_pl.cost": [
        "CostModel", "DensityEstimator", "RecallPrices", "SparsityReport", "StepObservation", "StepRecord",
        "TIMED_TERMS", "observe_step",
    ],
    "sparsebalance_pl.cost.profiler": [
        "KernelSettings", "ModelStep", "ProfileGrid", "analytic_prior", "device_name", "latency_model_for_run",
        "measure_seconds", "profile_hardware", "profile_module", "training_dtype",
    ],
    "sparsebalance_pl.datamodules": [
        "BatchingConfig", "CapacityError", "CorpusConfig", "EvaluationConfig", "GlobalBatch", "LongContextDataModule",
        "PaddingItem", "PlanItems", "PlannedBatchSampler", "PlannerConfig", "Segment", "SharedStream",
        "SparsityAwareSampler", "collate_packed", "karmarkar_karp", "partition", "plan_epoch", "stripe_packed",
    ],
    "sparsebalance_pl.dst": [
        "ANCHORS", "Anchor", "DSTController", "Decision", "FIXED_ANCHORS", "Outlook", "RankBudget", "TRUSTED_ERROR",
        "adaptive_anchor", "anchor_time", "check_settings", "confidence", "outlook", "raises_to_dense", "rank_budget",
        "reachable_anchor", "recall_drop", "target_time",
    ],
    "sparsebalance_pl.errors": ["ConfigError", "DataError", "TrainingError"],
    "sparsebalance_pl.kernels": [
        "BACKENDS", "BlockRanking", "BudgetedSelection", "LayerBudget", "PackedDocuments", "SelectionStats",
        "StripedRanking",
        "attention_recall", "block_sparse_attention", "context_shard", "context_unshard", "rank_blocks",
        "rank_blocks_striped", "reference_block_sparse_attention", "select_blocks", "select_blocks_striped",
        "select_with_budget", "select_with_budget_striped", "sparse_ring_attention",
    ],
    "sparsebalance_pl.latency": [
        "LatencyModel", "LatencyTable", "LatencyTableError", "OnlineCalibration", "TERMS", "TableMeta",
        "UnreachableTimeError", "kept_tiles",
    ],
    "sparsebalance_pl.loss": ["IGNORE_INDEX", "chunked_cross_entropy_sum", "globally_normalised_loss"],
    "sparsebalance_pl.model": [
        "CONTEXT_OVERRIDES", "ModelConfig", "ModelDims", "PRESETS", "PackedCausalLM", "Preset", "answer_exact_match",
        "architecture_name", "build_model", "check_architecture", "check_model", "decoder_layers", "greedy_tokens",
    ],
    "sparsebalance_pl.module": ["OptimConfig", "SparseCausalLM"],
    "sparsebalance_pl.progress": ["LoggedProgress", "RunProgressBar"],
    "sparsebalance_pl.slurm": ["SlurmRequeue", "next_hpc_checkpoint"],
    "sparsebalance_pl.strategy": ["FSDP2Strategy", "apply_fully_shard", "attached_trainer"],
    "sparsebalance_pl.timing": ["AttentionTimer"],
}

#: (old module, name, new module) of every name that moved, for one minor version.
_CALLBACKS_MOVED = [
    ("SparsityTunable", "sparsebalance_pl.attention"), ("AttentionTimer", "sparsebalance_pl.timing"),
    ("BudgetedSelection", "sparsebalance_pl.kernels"), ("LayerBudget", "sparsebalance_pl.kernels"),
    ("select_with_budget", "sparsebalance_pl.kernels"), ("TIMED_TERMS", "sparsebalance_pl.cost"),
    ("CostModel", "sparsebalance_pl.cost"), ("SparsityReport", "sparsebalance_pl.cost"),
    ("observe_step", "sparsebalance_pl.cost"),
]
MOVED = (
    [(old, name, new) for old in ("sparsebalance_pl.callbacks", "sparsebalance_pl.callbacks.protocol")
     for name, new in _CALLBACKS_MOVED]
    + [("sparsebalance_pl.callbacks.budget", name, "sparsebalance_pl.dst")
       for name in ("ANCHORS", "FIXED_ANCHORS", "Anchor", "Outlook", "RankBudget", "adaptive_anchor", "anchor_time",
                    "outlook", "raises_to_dense", "rank_budget", "reachable_anchor", "recall_drop", "target_time")]
    + [("sparsebalance_pl.callbacks.controller", name, "sparsebalance_pl.dst")
       for name in ("DSTController", "Decision", "TRUSTED_ERROR", "check_settings", "confidence")]
    + [("sparsebalance_pl.cost", name, "sparsebalance_pl.latency")
       for name in ("LatencyModel", "LatencyTable", "LatencyTableError")]
)


@pytest.mark.parametrize("module", sorted(PUBLIC_API))
def test_the_public_api_is_this_list(module):
    imported = import_module(module)
    assert sorted(imported.__all__) == sorted(PUBLIC_API[module])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a public name resolves without a warning
        for name in imported.__all__:
            assert getattr(imported, name) is not None


def test_every_public_name_has_one_import_path():
    homes = {}
    for module, names in PUBLIC_API.items():
        for name in names:
            homes.setdefault(name, []).append(module)
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}


@pytest.mark.parametrize("old, name, new", MOVED, ids=[f"{old}.{name}" for old, name, _ in MOVED])
def test_a_moved_name_warns_naming_its_new_home(old, name, new):
    message = f"{old}.{name} moved to {new}.{name}; import it from there .*{MOVED_NAMES_REMOVED_IN}"
    with pytest.warns(FutureWarning, match=message):
        moved = getattr(import_module(old), name)
    assert moved is getattr(import_module(new), name)
    assert name not in getattr(import_module(old), "__all__", [])


def test_a_moved_name_warns_in_a_from_import_too():
    with pytest.warns(FutureWarning, match="sparsebalance_pl.callbacks.LayerBudget moved to sparsebalance_pl.kernels"):
        exec("from sparsebalance_pl.callbacks import LayerBudget", {})


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        import_module("sparsebalance_pl.callbacks").Nothing
