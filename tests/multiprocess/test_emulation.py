"""Emulated data-parallel ranks against reality: two ranks emulated in one process train on the same
micro-batches as a real 2-process FSDP2 run of the same configuration and plan, with the same losses. Two
micro-batches per step, so gradient accumulation and the global-token normalisation across it are in the
check: each step's loss (the last micro-batch's, as Lightning logs it) follows the previous steps' updates."""

import csv
import hashlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from main_runner import HELPERS, REPO, build_demo_data

STEPS = 4
CORPUS = {"corpus.num_documents": 200, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}
MICRO_BATCHES = 2


def _args(run_dir: Path, init: Path) -> list[str]:
    """The demo configuration, small, from fixed weights; no DST (it decides from measured times, which no two
    runs share) and no density calibration, so the plan is the analytic prior's in both."""
    data = [f"--data.{key}={value}" for key, value in CORPUS.items()]
    return [
        "--config", str(REPO / "configs" / "demo.yaml"), *data, f"--data.corpus.data_dir={run_dir / 'data/demo'}",
        f"--model.model.pretrained_path={init}", f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0",
        f"--data.batching.micro_batches={MICRO_BATCHES}", f"--trainer.accumulate_grad_batches={MICRO_BATCHES}",
        "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={run_dir / 'outputs'}",
        f"--trainer.logger.init_args.save_dir={run_dir / 'outputs'}",
    ]


def _initial_weights(path: Path) -> None:
    from sparsebalance_pl.model import ModelConfig
    from sparsebalance_pl.module import SparseCausalLM

    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides={"num_layers": 2}))
    module.configure_model()
    module.net.hf.save_pretrained(path)


def _digest(batch) -> str:
    return hashlib.sha1(batch["input_ids"].cpu().numpy().tobytes()).hexdigest()


@pytest.mark.slow
def test_two_emulated_ranks_match_a_real_two_rank_run(tmp_path):
    from sparsebalance_pl.emulation import EmulatedRanks, build, step_batches

    init = tmp_path / "init"
    _initial_weights(init)
    build_demo_data(tmp_path, **CORPUS)
    record = tmp_path / "batches"
    callbacks = ('--trainer.callbacks=[{"class_path": "fault_injection.RecordBatches", "init_args": {"path": "'
                 f'{record}"}}}}]')
    real = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "fit", *_args(tmp_path, init), callbacks], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(HELPERS)}, capture_output=True, text=True, timeout=600,
    )
    assert real.returncode == 0, real.stderr[-3000:]
    rows = csv.DictReader(open(tmp_path / "outputs/logs/version_0/metrics.csv"))
    real_losses = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    real_batches = {}
    for rank in (0, 1):
        for line in (tmp_path / f"batches.{rank}").read_text().splitlines():
            step, digest = line.split()
            real_batches.setdefault((rank, int(step)), []).append(digest)

    module, data, trainer = build(_args(tmp_path, init))
    emulated = EmulatedRanks(module, 2, STEPS, gradient_clip=trainer.gradient_clip_val)
    items = data.items("train")
    for step, planned in zip(range(STEPS), data.train_plan(2, rank=0).plan()):
        batches = step_batches(items, planned)
        digests = [[_digest(micro) for micro in rank] for rank in batches]
        assert digests == [real_batches[(rank, step)] for rank in (0, 1)], step
        assert len(digests[0]) == MICRO_BATCHES
        loss = emulated.step(batches).round_losses[-1]
        assert loss == pytest.approx(real_losses[step], abs=1e-5), f"step {step}"


BALANCED = "sparsebalance:anchor=adaptive,recall_tolerance=0.001"


@pytest.mark.slow
def test_an_emulated_comparison_keeps_every_step_and_the_simulation_predicts_it(tmp_path, monkeypatch):
    """Variants over 3 emulated ranks, as ``benchmarks/end_to_end.py --ranks 3`` runs them: one epoch per variant
    over the same documents, every step's per-rank seconds and the regime it ran in kept with the settings;
    SparseBalance with settings of its own, as a run comparing DST's settings names it. The simulation's check
    then predicts the same plans, and a study replays one of DST's decisions from what the run kept."""
    from sparsebalance_pl.comparison import emulate_variants, load_results, regime, save_results
    from sparsebalance_pl.simulation import check_against_emulation
    from sparsebalance_pl.variants import ComparisonSettings, merged_configs

    monkeypatch.chdir(tmp_path)  # the corpus and the latency table go to the configuration's relative folders
    small = tmp_path / "small.yaml"
    small.write_text("model:\n  model:\n    overrides: {num_layers: 1}\ndata:\n  corpus: {build_workers: 1}\n"
                     "  batching: {num_workers: 0}\n")
    out = tmp_path / "e2e"
    settings = ComparisonSettings(configs=[REPO / "configs" / "demo.yaml", small], variants=["static", BALANCED],
                                  out=out, ranks=3, epoch_documents=60, max_tokens=512, warmup=1, calibrate_steps=2,
                                  repeats=3)
    base = merged_configs(settings.configs)
    summaries = emulate_variants(base, settings, 0)
    save_results(settings, summaries, regime(base, summaries, settings))
    kept, variants, run = load_results(out)
    assert kept == settings
    assert run["ranks"] == 3 and 0 < run["baseline_attention_share_of_compute"] < 1 and run["timing_repeats"] == 3
    assert run["spare_cpu_cores"] >= 0 and not run["other_cpu_cores"] < 0
    for name in ("static", BALANCED):
        variant = variants[name]
        assert variant["steps"] and all(len(step["rank_s"]) == 3 for step in variant["steps"])
        assert all(step["step_s"] >= max(step["rank_s"]) for step in variant["steps"])
        assert variant["tokens"] == sum(step["tokens"] for step in variant["steps"]) > 0
        assert variant["total_s"] == pytest.approx(sum(step["step_s"] for step in variant["steps"]))
        assert all(len(draws) == 3 for step in variant["steps"] for draws in step["rank_draws"])
        first_runs = sum(max(draws[0] for draws in step["rank_draws"]) + step["step_s"] - max(step["rank_s"])
                         for step in variant["steps"])
        assert variant["first_run_total_s"] == pytest.approx(first_runs)
        assert math.isfinite(variant["val_loss"]) and 0 < variant["recall"] <= 1
    # the simulator predicts the same plans from the state each variant started its epoch with
    checked = check_against_emulation(out, tmp_path / "check")
    assert set(checked["rows"]) == {"static", BALANCED} and checked["rank_noise"] >= 0
    for name, row in checked["rows"].items():
        measured = sum(max(step["rank_s"]) for step in variants[name]["steps"])
        assert row["measured_s"] == pytest.approx(measured) and row["predicted_s"] >= row["exact_s"] > 0
        # every step's rank-seconds shared evenly, the ranks straying by the calibration's noise: at least the
        # mean rank, at most what 3 such ranks' factors add up to (E[max] <= 3 E[factor] = 3 exp(noise^2 / 2))
        mean_ranks = sum(sum(step["rank_s"]) / 3 for step in variants[name]["steps"])
        assert 0.99 * mean_ranks <= row["balanced_s"] <= 3 * math.exp(checked["rank_noise"] ** 2 / 2) * mean_ranks
        static = sum(max(step["rank_s"]) for step in variants["static"]["steps"])
        assert row["noise_ceiling"] == pytest.approx(static / row["balanced_s"])
        other = "static" if name == BALANCED else BALANCED  # fitted on the other's every round
        assert row["replayed_rounds"] == len(variants[other]["steps"]) and row["held_out_s"] > 0
    # DST's decision of the last step, replayed from the state its epoch started with, beside what it did
    last = len(variants[BALANCED]["steps"]) - 1
    replay = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "emulated_steps.py"), str(out), "--replay", BALANCED, str(last)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    rows = [line for line in replay.stdout.splitlines() if re.match(r"\| \d+ \|", line)]
    records = variants[BALANCED]["steps"][last]["rounds"][0]["records"]
    assert len(rows) == 3
    tokens = [sum(record["lengths"]) for record in records]
    measured = sum(n * (r["report"]["recall"] - r["report"]["base_recall"]) for n, r in zip(tokens, records))
    assert f"measured {measured / sum(tokens):+.4f}" in replay.stdout
