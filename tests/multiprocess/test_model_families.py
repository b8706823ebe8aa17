"""Every family the module serves trains through ``python main.py fit`` as users run it: 2 FSDP2 ranks on the CPU,
sparse attention with activation checkpointing, sparsity-aware batching and dynamic sparsity tuning; the loss is
finite and falls over 3 steps."""

import csv
import math

import pytest
from main_runner import REPO, build_demo_data, run_main

FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma3_text"]
#: The smallest model that still has grouped KV heads, several layers to shard and recompute, and packed documents.
TINY = ("{num_layers: 2, hidden_size: 64, num_heads: 4, num_kv_heads: 2, head_dim: 16, intermediate_size: 128, "
        "max_position_embeddings: 1024}")
DATA = {"corpus.num_documents": 120, "corpus.max_doc_tokens": 1024, "batching.max_tokens": 1024}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One small corpus every family's run reads (built before the runs, as ``prepare_data`` would)."""
    root = tmp_path_factory.mktemp("families")
    build_demo_data(root, **DATA)
    return root / "data" / "demo"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_with_sab_and_dst_on_two_fsdp2_ranks(tmp_path, corpus, family):
    result = run_main(
        tmp_path, "fit", "--config", str(REPO / "configs" / "demo.yaml"),
        f"--model.model.model_type={family}", f"--model.model.overrides={TINY}",
        "--model.activation_checkpointing=true", "--model.optim.warmup_steps=0",
        *[f"--data.{key}={value}" for key, value in DATA.items()], f"--data.corpus.data_dir={corpus}",
        "--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
        '--trainer.callbacks=[{"class_path": "sparsebalance_pl.callbacks.DynamicSparsityTuning"}, '
        '{"class_path": "sparsebalance_pl.callbacks.BatchPlanMonitor"}]',
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "outputs/demo/logs/version_0/metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"dst/anchor_s", "dst/measured_imbalance", "plan/predicted_imbalance", "train/density"} <= logged
