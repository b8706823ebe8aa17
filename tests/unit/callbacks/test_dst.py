"""DynamicSparsityTuning with a second, minimal LightningModule implementing the protocol, on one rank (the
two-rank runs are in tests/multiprocess/test_dst_two_ranks.py)."""

import json

import lightning as L
import pytest
from minimal_tunable import EQUAL, TAU0, MinimalTunable, trainer_for, tuned

from sparsebalance_pl.callbacks import DynamicSparsityTuning, SparsityTunable


def test_protocol_is_checked(tmp_path):
    assert isinstance(MinimalTunable(EQUAL), SparsityTunable)

    class Plain(L.LightningModule):
        pass

    assert not isinstance(Plain(), SparsityTunable)
    with pytest.raises(TypeError, match="Plain lacks layer_budgets, base_budgets, document_lengths"):
        DynamicSparsityTuning().on_fit_start(None, Plain())
    with pytest.raises(RuntimeError, match="no cost model"):
        DynamicSparsityTuning().on_fit_start(None, MinimalTunable(EQUAL))


def test_single_rank_keeps_base_budget_and_logs(tmp_path):
    module = MinimalTunable(EQUAL)
    dst = tuned(module, anchor="adaptive")
    trainer_for(tmp_path, 3, [dst]).fit(module)
    assert [(tau, cap) for _, tau, cap, _ in module.history] == [(TAU0, None)] * 3
    assert "dst/rank0/tau" in module.trainer.logged_metrics
    state = dst.state_dict()
    assert set(state) == {"shifts", "budgets"}
    json.dumps(state)  # plain data
    restored = tuned(module, anchor="adaptive")
    restored.load_state_dict(json.loads(json.dumps(state)))
    restored.on_fit_start(module.trainer, module)
    assert restored.state_dict() == state
