"""DynamicSparsityTuning on SparseQwen under FSDP2, 2 gloo ranks on the CPU, through ``python main.py fit``."""

import csv
import subprocess
import sys

import pytest
from main_runner import REPO

P = 0.2


@pytest.mark.slow
def test_overloaded_rank_gets_sparser_and_predicted_imbalance_falls(tmp_path):
    args = [
        sys.executable, str(REPO / "main.py"), "fit", "--config", str(REPO / "configs/demo.yaml"),
        "--data.corpus.num_documents=120", "--data.corpus.max_doc_tokens=1024", "--data.batching.max_tokens=1024",
        "--model.model.overrides={num_layers: 2}", "--trainer.log_every_n_steps=1", "--trainer.max_steps=4",
        "--trainer.limit_val_batches=0",
        "--data.batching.method=first_fit",  # token-count packing leaves the cost imbalance that DST must fix
        f'--trainer.callbacks=[{{"class_path": "sparsebalance_pl.callbacks.DynamicSparsityTuning", '
        f'"init_args": {{"p": {P}}}}}]',
    ]
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [r for r in csv.DictReader(open(tmp_path / "outputs/demo/logs/version_0/metrics.csv"))
            if r.get("dst/rank0/tau")]
    assert len(rows) == 4
    separated = 0
    for row in rows:
        base = [float(row[f"dst/rank{r}/predicted_base_s"]) for r in (0, 1)]
        tau = [float(row[f"dst/rank{r}/tau"]) for r in (0, 1)]
        assert all(0.9 - P - 1e-6 <= t <= 0.9 + P + 1e-6 for t in tau)
        assert float(row["dst/predicted_imbalance"]) <= float(row["dst/predicted_imbalance_base"]) + 1e-9
        if abs(base[0] - base[1]) > 0.05 * max(base):
            slow, fast = (0, 1) if base[0] > base[1] else (1, 0)
            assert tau[slow] < tau[fast]
            assert float(row["dst/predicted_imbalance"]) < float(row["dst/predicted_imbalance_base"])
            separated += 1
    assert separated >= 1, "no step had an overloaded and an underloaded rank"
