"""SparsityAwareSampler: sparsity-aware batching over any map-style dataset whose document lengths are known."""

import numpy as np
import pytest

from sparsebalance_pl.balance import balance_efficiency
from sparsebalance_pl.cost import CostModel, DensityEstimator
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.datamodules import BatchingConfig, PaddingItem, SparsityAwareSampler
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.model import PRESETS

LENGTHS = np.minimum(np.random.default_rng(0).lognormal(6.5, 1.2, 400).astype(np.int64) + 16, 4096)


def _cost() -> CostModel:
    latency = LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16)
    return CostModel(latency, DensityEstimator(block_size=64))


def _samplers(method: str = "sab", ranks: int = 4, **kwargs) -> list[SparsityAwareSampler]:
    batching = BatchingConfig(method=method, max_tokens=4096, defer_window=kwargs.pop("defer_window", 4))
    return [SparsityAwareSampler(LENGTHS, batching, cost_model=_cost(), seed=3, num_replicas=ranks, rank=r, **kwargs)
            for r in range(ranks)]


def test_ranks_see_every_document_once_within_the_capacity():
    samplers = _samplers()
    per_rank = [list(s) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1  # the same number of micro-batches on every rank
    seen = [i for batches in per_rank for batch in batches for i in batch if not isinstance(i, PaddingItem)]
    assert sorted(seen) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i if isinstance(i, int) else i.index] for i in b) <= 4096 for r in per_rank for b in r)
    assert samplers[0].plan_costs[0] == 0 and samplers[0].planned_efficiency[0] > 0.9


def test_balances_predicted_cost_better_than_first_fit():
    sab, first_fit = _samplers()[0], _samplers("first_fit")[0]
    efficiency = {name: balance_efficiency(step.costs for step in s.plan()) for name, s in
                  (("sab", sab), ("first_fit", first_fit))}
    assert efficiency["sab"] > efficiency["first_fit"] + 0.05, efficiency


def test_resume_continues_the_same_plan_with_the_costs_it_was_planned_with():
    first = _samplers()[1]
    batches = list(first)
    epoch, costs = first.plan_costs
    changed = _cost()
    changed.density.observe([4096], [0.05])  # learned since: planning again from it would change the plan
    changed.step_overhead = 1.0
    resumed = SparsityAwareSampler(LENGTHS, first.batching, cost_model=changed, seed=3, num_replicas=4, rank=1)
    resumed.plan()  # planned from what the cost model learned, until the state arrives
    resumed.load_state_dict({**first.state_dict(), "batches_consumed": 5})
    assert list(resumed) == batches[5:] and resumed.plan_step_overhead == 0.0
    resumed.set_epoch(1)  # the next epoch is planned from the cost model as it is now
    resumed.plan()
    assert resumed.plan_costs[0] == 1 and not np.allclose(resumed.plan_costs[1], costs)


def test_bad_rank_is_named():
    with pytest.raises(ConfigError, match="rank=4 must lie in"):
        SparsityAwareSampler(LENGTHS, BatchingConfig(), num_replicas=4, rank=4)


@pytest.mark.parametrize("seed, epoch", [(1, 1), (3, 2)])
def test_many_documents_at_the_capacity_with_deferral_still_plan(seed, epoch):
    """A corpus split at the capacity holds many documents exactly as long as a micro-batch (24% of real text
    pieces at 8K tokens). With deferral, the segments due at one step could then fit in no packing of its
    slots, and the planner stopped with ``CapacityError``; now the last one waits a step more."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(300) < 0.24, 2048, np.clip(rng.lognormal(6.8, 1.2, 300).astype(int), 16, 2048))
    sampler = SparsityAwareSampler(lengths, BatchingConfig(method="sab", max_tokens=2048, defer_window=8),
                                   cost_model=_cost(), num_replicas=2, rank=0)
    sampler.set_epoch(epoch)
    plan = sampler.plan()
    seen = [i for step in plan for rank in step.micro_batches for mb in rank for i in mb if isinstance(i, int)]
    assert sorted(seen) == list(range(len(lengths)))
    assert all(sum(lengths[i if isinstance(i, int) else i.index] for i in mb) <= 2048
               for step in plan for rank in step.micro_batches for mb in rank)


def test_lightning_trains_each_epoch_on_its_own_plan():
    """Lightning names each epoch to the batch sampler (through its ``sampler``): epoch 1 trains epoch 1's plan,
    not epoch 0's again."""
    import lightning as L
    import torch

    sampler = _samplers(method="first_fit", ranks=1)[0]
    seen: dict[int, list] = {}

    class Record(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            seen.setdefault(self.current_epoch, []).append(batch.tolist())
            return self.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(range(len(LENGTHS)), batch_sampler=sampler)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Record(), loader)
    for epoch in (0, 1):
        want = [mb for step in sampler.plan_fn(epoch) for mb in step.micro_batches[0]]
        assert seen[epoch] == [[int(i) for i in mb] for mb in want]
    assert seen[0] != seen[1]
