"""benchmarks/emulated_steps.py: per-step figures read off an emulated run's results.json."""

import json
import math
import sys

import pytest
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import emulated_steps  # noqa: E402


def _report(density, base_density, recall, base_recall=None, probes=None):
    return {"density": [density] * 2, "base_density": [base_density] * 2, "estimated_recall": [recall] * 2,
            "base_estimated_recall": [recall] * 2, "recall": recall, "base_recall": base_recall,
            "probe_moves": probes}


def test_moved_ranks_are_grouped_and_priced_on_the_same_rows(tmp_path, capsys):
    records = [{"lengths": [4096], "report": _report(0.2, 0.4, 0.85, 0.91)},  # cut
               {"lengths": [1024, 1024], "report": _report(0.6, 0.3, 0.98, 0.92)},  # raised
               {"lengths": [4096], "report": _report(0.4, 0.4, 0.92, 0.92, [(-0.1, -0.02), (0.4, 0.08)])}]
    run = {"variants": {"sparsebalance": {"steps": [
        {"step_s": 2.0, "rank_s": [2.0, 1.0, 1.5], "rounds": [{"records": records}]}]}}}
    (tmp_path / "results.json").write_text(json.dumps(run))
    row = emulated_steps.step_rows(run["variants"]["sparsebalance"])[0]
    # prices per unit of log_move, rho0 ln(rho / rho0): halving and doubling are moves of rho0 ln 2
    assert row["cut"]["ranks"] == 1 and row["cut"]["price"] == pytest.approx(0.06 / (0.4 * math.log(2)))
    assert row["raised"]["ranks"] == 1 and row["raised"]["price"] == pytest.approx(0.06 / (0.3 * math.log(2)))
    assert row["recall"] == pytest.approx((4096 * 0.85 + 2048 * 0.98 + 4096 * 0.92) / 10240)
    alone = emulated_steps.longest_alone(run["variants"]["sparsebalance"], 4096)
    assert alone["ranks"] == 1
    assert alone["probe_prices"] == pytest.approx([0.02 / (0.4 * -math.log(0.75)), 0.08 / (0.4 * math.log(2))])
    emulated_steps.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "1: 0.400 -> 0.200, recall 0.8500 (base 0.9100, price 0.216)" in out and "cut 0.174, raise 0.289" in out
    assert "Rank-seconds over the epoch (every rank's forward and backward): 4.5" in out
    assert "at the epoch's start" not in out  # the run kept no calibrated state
    state = tmp_path / "sparsebalance-round0" / "calibrated_state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"cost_model": {"recall_prices": {"12": [[0.95, 0.285], [0.0, 0.0]]}}}))
    emulated_steps.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "(cut, raise; in brackets the units measured, against the pool's 0.05)" in out
    # 0.285 of recall over 0.95 units, and 0.05 units at the pool's (0.285 + 0.05) / 1.0; no raise measured
    assert "by the pack's tile-weighted length: 2^12 0.302 (0.95), 1.000 (0.00)" in out
