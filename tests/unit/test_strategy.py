"""The FSDP2 strategy's per-process settings: CPU ranks share the node's cores, and failed collectives are
told apart from other errors."""

import pytest
import torch
import torch.distributed as dist

from sparsebalance_pl import strategy
from sparsebalance_pl.distributed import is_collective_failure


@pytest.mark.parametrize("cores, ranks, expected", [(8, 2, 4), (2, 2, 1), (2, 4, 1), (16, 1, 16)])
def test_ranks_share_the_cores(monkeypatch, cores, ranks, expected):
    monkeypatch.setattr(strategy.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        strategy._share_cores(ranks)
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_collective_failures_are_recognised():
    assert is_collective_failure(RuntimeError("[gloo] Timed out waiting 0:00:05 for recv"))
    assert is_collective_failure(dist.DistError("NCCL watchdog"))
    assert not is_collective_failure(RuntimeError("shape mismatch"))
    assert not is_collective_failure(ValueError("Timed out waiting"))
