"""Faults during training: a non-finite loss on one rank skips that update on every rank and too many stop
the run with a message; a collective that does not complete ends the run with a message naming the rank and
the step instead of hanging."""

import csv
from pathlib import Path

import pytest
from main_runner import REPO, build_demo_data, run_main

DATA = {"corpus.num_documents": 120, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}
ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"), *(f"--data.{k}={v}" for k, v in DATA.items()),
    "--model.model.overrides={num_layers: 2}", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
]
NAN = "--trainer.callbacks+=fault_injection.InjectNonFiniteLoss"


def _run(cwd: Path, *extra: str, timeout: float = 300):
    return run_main(cwd, *ARGS, *extra, timeout=timeout)


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_on_both_and_training_continues(tmp_path):
    result = _run(tmp_path, NAN, "--trainer.max_steps=5", "--trainer.callbacks.init_args.rank=1",
                  "--trainer.callbacks.init_args.step=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "non-finite loss at step 2" in result.stderr
    rows = list(csv.DictReader(open(tmp_path / "outputs/demo/logs/version_0/metrics.csv")))
    losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    skipped = [float(r["train/nonfinite_steps"]) for r in rows if r.get("train/nonfinite_steps")]
    assert max(skipped) == 1.0  # one skipped update in the run
    # Training went on past the poisoned step with finite, falling losses: no NaN reached either rank's weights.
    assert sorted(losses) == [0, 1, 2, 3, 4]
    assert all(loss == loss for loss in losses.values())
    assert losses[4] < losses[3] < losses[1]


@pytest.mark.slow
def test_persistent_nan_stops_with_a_message(tmp_path):
    result = _run(tmp_path, NAN, "--trainer.max_steps=8", "--trainer.callbacks.init_args.step=1",
                  "--trainer.callbacks.init_args.persist=true", "--model.max_nonfinite_steps=2")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: the loss was not finite at step 3" in result.stderr  # steps 1 and 2 skipped, 3 is one too many
    assert "max_nonfinite_steps=2" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stuck", [1, 0])
def test_stuck_rank_ends_the_run_with_rank_and_step(tmp_path, stuck):
    build_demo_data(tmp_path, **DATA)
    # One rank sleeps far longer than the run may take and the other waits for it in the next collective. The
    # run must end by itself, the sleeping rank included, well before that (a hang fails in run_main): rank 0
    # stops the rank it launched, and Lightning's launcher stops rank 0 when that rank fails.
    result = _run(tmp_path, "--trainer.max_steps=6", "--trainer.strategy.init_args.timeout=0:00:20",
                  "--trainer.callbacks+=fault_injection.StallRank", f"--trainer.callbacks.init_args.rank={stuck}",
                  "--trainer.callbacks.init_args.step=3", "--trainer.callbacks.init_args.seconds=3600",
                  timeout=200)
    assert result.returncode != 0
    assert "rebuilding" not in result.stderr  # the prebuilt corpus was used
    waiting = 1 - stuck
    assert (f"rank {waiting} at global step 3 (epoch 0): a collective failed or did not complete within 0:00:20"
            in result.stderr)
