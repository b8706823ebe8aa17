"""DynamicSparsityTuning with a second, minimal LightningModule implementing the protocol, on one rank (the
two-rank runs are in tests/multiprocess/test_dst_two_ranks.py)."""

import json

import lightning as L
import pytest
from minimal_tunable import EQUAL, TAU0, MinimalTunable, trainer_for

from sparsebalance_pl.attention import SparsityTunable
from sparsebalance_pl.callbacks import DynamicSparsityTuning


def test_protocol_is_checked(tmp_path):
    assert isinstance(MinimalTunable(EQUAL), SparsityTunable)

    class Plain(L.LightningModule):
        pass

    assert not isinstance(Plain(), SparsityTunable)
    with pytest.raises(TypeError, match="a SparseAttention held as its sparse_attention.*Plain has none"):
        DynamicSparsityTuning().on_fit_start(None, Plain())


def test_single_rank_keeps_base_budget_and_logs(tmp_path):
    module = MinimalTunable(EQUAL)
    dst = DynamicSparsityTuning(anchor="adaptive")
    trainer_for(tmp_path, 3, [dst]).fit(module)
    assert [(tau, cap) for _, tau, cap, _ in module.history] == [(TAU0, None)] * 3
    assert "dst/rank0/tau" in module.trainer.logged_metrics
    state = dst.state_dict()
    assert set(state) == {"shifts", "budgets"}
    json.dumps(state)  # plain data
    restored = DynamicSparsityTuning(anchor="adaptive")
    restored.load_state_dict(json.loads(json.dumps(state)))
    restored.on_fit_start(module.trainer, module)
    assert restored.state_dict() == state


def test_connect_warns_that_the_cost_model_now_comes_from_the_module():
    with pytest.warns(FutureWarning, match="connect is no longer needed: it predicts with the cost model of the"):
        DynamicSparsityTuning().connect(object())
