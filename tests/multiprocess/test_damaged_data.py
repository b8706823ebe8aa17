"""A chunk with a damaged header stops a 2-rank run with its name on every rank, instead of a hang."""

import pytest
from data_damage import damage_chunk_header
from main_runner import REPO, build_demo_data, run_main


@pytest.mark.slow
def test_damaged_chunk_stops_a_two_rank_run_with_its_name(tmp_path):
    data = {"corpus.num_documents": 120, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}
    build_demo_data(tmp_path, **data)
    name = damage_chunk_header(tmp_path / "data" / "demo" / "train")
    result = run_main(tmp_path, "fit", "--config", str(REPO / "configs" / "demo.yaml"),
                      *(f"--data.{k}={v}" for k, v in data.items()), "--trainer.max_steps=2", timeout=180)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all(name in line and "truncated or corrupt" in line for line in errors)  # each rank
    assert "Traceback" not in result.stderr
