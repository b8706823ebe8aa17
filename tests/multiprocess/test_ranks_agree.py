"""Ranks that would plan from different data are stopped, each with a message naming the groups of ranks."""

import numpy as np
import pytest
from rank_runner import run_ranks

from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, LongContextDataModule


def _agree_or_not(rank, data_dir, disagree):
    dm = LongContextDataModule(CorpusConfig(data_dir=data_dir, num_documents=20, max_doc_tokens=256, val_fraction=0.0),
                               BatchingConfig(max_tokens=512), seed=0)
    dm._check_ranks_agree(np.arange(10) + (rank if disagree else 0))


@pytest.mark.slow
def test_ranks_that_disagree_on_the_data_are_stopped(tmp_path):
    assert run_ranks(_agree_or_not, str(tmp_path), False) == {}
    failed = run_ranks(_agree_or_not, str(tmp_path), True)
    assert set(failed) == {0, 1}
    assert all("ranks disagree" in message and "ranks [0]" in message for message in failed.values())


def _gathered_floats(rank):
    from sparsebalance_pl.distributed import all_ranks, gather_floats

    gathered = gather_floats([float(rank), 10.0 + rank])
    if gathered.tolist() != [[0.0, 10.0], [1.0, 11.0]]:
        raise AssertionError(f"gathered {gathered.tolist()}")
    if all_ranks(rank == 0) or not all_ranks(True):
        raise AssertionError("all_ranks")


def test_every_ranks_floats_are_gathered_in_rank_order_under_gloo():
    assert run_ranks(_gathered_floats) == {}
