"""Context-parallel groups, striping a packed batch across a group, and the slot a group plans with."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparsebalance_pl.context_parallel import context_parallel_groups
from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, LongContextDataModule
from sparsebalance_pl.datamodules.packing import collate_packed, stripe_packed
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.kernels import context_unshard
from sparsebalance_pl.loss import IGNORE_INDEX
from sparsebalance_pl.strategy import FSDP2Strategy


@pytest.mark.parametrize(
    "world, size, per_node, groups",
    [
        (4, 2, 4, [[0, 1], [2, 3]]),
        (8, 4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # spans two whole nodes
        (2, 1, 2, [[0], [1]]),
    ],
)
def test_groups_are_neighbouring_ranks(world, size, per_node, groups):
    assert context_parallel_groups(world, size, per_node) == groups


@pytest.mark.parametrize(
    "world, size, per_node, message",
    [
        (8, 3, 8, "does not divide the world of 8 ranks"),
        (12, 6, 4, "spans nodes unevenly: a group larger than a node"),
        (12, 4, 6, "spans nodes unevenly: it does not divide a node's 6 ranks"),
        (4, 0, 4, "must be a positive int"),
    ],
)
def test_bad_group_sizes_stop_with_one_line(world, size, per_node, message):
    with pytest.raises(ConfigError, match=message) as err:
        context_parallel_groups(world, size, per_node)
    assert "\n" not in str(err.value)


def test_strategy_checks_its_context_parallel_size():
    assert FSDP2Strategy(context_parallel_size=2).context_parallel_size == 2
    assert not FSDP2Strategy().context_parallel.active
    with pytest.raises(ConfigError, match="context_parallel_size=-1"):
        FSDP2Strategy(context_parallel_size=-1)


@pytest.mark.parametrize("lengths, padded", [([5, 20], 32), ([16, 16], 32)])
def test_stripe_packed_pads_with_a_padding_document_and_shards(lengths, padded):
    gen = np.random.default_rng(0)
    batch = collate_packed([{"tokens": gen.integers(1, 100, n)} for n in lengths])
    shards = [stripe_packed(batch, world_size=2, rank=r, block_size=4) for r in range(2)]
    total = sum(lengths)
    cu = [0, *np.cumsum(lengths).tolist()] + ([padded] if padded > total else [])
    for shard in shards:
        assert shard["cu_seqlens"].tolist() == cu  # the whole stream's, on every rank
        assert shard["input_ids"].shape == (1, padded // 2)
    for key in ("input_ids", "position_ids", "targets"):
        whole = context_unshard([s[key][0] for s in shards], block_size=4)
        assert torch.equal(whole[:total], batch[key][0])  # nothing truncated, each target still its own
        tail = whole[total:]
        if key == "targets":
            assert torch.all(tail == IGNORE_INDEX)  # the padding document bears no loss
        elif key == "position_ids":
            assert torch.equal(tail, torch.arange(padded - total))
    # blocks 0, 2, 4, 6 of 4 tokens on rank 0, the odd ones on rank 1
    assert torch.equal(shards[1]["input_ids"][0, :4], batch["input_ids"][0, 4:8])


def _datamodule(max_tokens, max_doc_tokens, context_parallel_size, tokens_per_rank=None):
    dm = LongContextDataModule(
        corpus=CorpusConfig(max_doc_tokens=max_doc_tokens),
        batching=BatchingConfig(max_tokens=max_tokens, tokens_per_rank=tokens_per_rank),
    )
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(context_parallel_size=context_parallel_size))
    return dm


def test_a_group_plans_as_one_slot_of_its_ranks_tokens():
    slot = _datamodule(4096, 8192, 2, tokens_per_rank=4096).slot_batching()
    assert slot.max_tokens == 8192 and slot.rank_budget == 8192
    assert _datamodule(8192, 8192, 1).slot_batching().max_tokens == 8192


def test_a_document_longer_than_a_slot_stops_with_one_line():
    with pytest.raises(ConfigError, match=r"max_tokens=4096 x context_parallel_size=2 is below .*=16384"):
        _datamodule(4096, 16384, 2).slot_batching()
    with pytest.raises(ConfigError, match=r"max_tokens=4096 is below data.corpus.max_doc_tokens=8192"):
        _datamodule(4096, 8192, 1).slot_batching()
    dm = _datamodule(4096, 4096, 1)
    dm.eval_config = replace(dm.eval_config, lengths=(8192,))
    with pytest.raises(ConfigError, match=r"evaluation.lengths=\[8192\] exceed data.batching.max_tokens=4096$"):
        dm.slot_batching()


def _plan_of_groups(micro_batches, lengths):
    from sparsebalance_pl.datamodules.sampler import _step

    lengths = np.asarray(lengths)
    return [_step(micro_batches, lengths, lengths.astype(float))]


def test_a_group_shares_only_micro_batches_with_a_document_longer_than_a_rank():
    from sparsebalance_pl.datamodules.sampler import SharedStream, group_plan

    lengths = np.array([150, 30, 60, 50, 40])
    # one group slot, two micro-batches: docs 0 and 1 (150 > 100 tokens), then docs 2-4 (each fits a rank)
    plan = group_plan(_plan_of_groups([[[0, 1], [2, 3, 4]]], lengths), lengths, lengths.astype(float),
                      group_size=2, rank_tokens=100)
    ranks = plan[0].micro_batches
    assert ranks[0][0] == ranks[1][0] == [SharedStream(2), 0, 1]
    split = [set(ranks[r][1]) for r in range(2)]
    assert split[0] | split[1] == {2, 3, 4} and not split[0] & split[1]
    assert all(lengths[list(s)].sum() <= 100 for s in split)
    shared = 180 / 2  # each rank computes half of the shared stream
    assert sorted(plan[0].tokens.tolist()) == sorted([shared + lengths[list(s)].sum() for s in split])


def test_sampler_with_groups_trains_every_document_once_and_keeps_ranks_in_step():
    from sparsebalance_pl.datamodules.sampler import PaddingItem, SharedStream, SparsityAwareSampler

    lengths = np.random.default_rng(0).integers(20, 400, 300)
    samplers = [SparsityAwareSampler(lengths, BatchingConfig(max_tokens=200, defer_window=0), num_replicas=4,
                                     rank=r, context_parallel_size=2) for r in range(4)]
    per_rank = [list(s) for s in samplers]
    assert len({len(mbs) for mbs in per_rank}) == 1
    seen = []
    for group in ((0, 1), (2, 3)):
        for a, b in zip(per_rank[group[0]], per_rank[group[1]]):
            if a[0] == SharedStream(2):
                assert a == b  # the group's ranks read one stream
                seen += [i for i in a[1:] if not isinstance(i, PaddingItem)]
            else:
                assert all(isinstance(i, (int, np.integer, PaddingItem)) for i in a + b)
                assert max(lengths[[i for i in a + b if not isinstance(i, PaddingItem)]], default=0) <= 200
                seen += [i for i in a + b if not isinstance(i, PaddingItem)]
    assert sorted(seen) == sorted(set(seen))  # no document twice
    assert {i for i in range(300) if lengths[i] > 200} <= set(seen)
    assert any(mbs[0] == SharedStream(2) for mbs in per_rank[0]) and any(mbs[0] != SharedStream(2) for mbs in per_rank[0])


def test_a_shared_document_is_priced_with_the_ring_s_communication():
    from sparsebalance_pl.cost import CostModel
    from sparsebalance_pl.latency import LatencyModel
    from sparsebalance_pl.datamodules.sampler import SparsityAwareSampler
    from sparsebalance_pl.model import PRESETS

    cost = CostModel(LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16))
    cost.ring.observe(4096, 2, 0.25)  # a measured wait: the ring's cost is now 0.25 s for a 4K stream
    lengths = np.array([100, 1000, 4096])
    sampler = SparsityAwareSampler(lengths, BatchingConfig(max_tokens=2048, defer_window=0), cost_model=cost,
                                   num_replicas=2, rank=0, context_parallel_size=2)
    alone = cost.document_costs(lengths)
    assert sampler.document_costs()[:2] == pytest.approx(alone[:2])  # documents one rank holds: no ring
    assert sampler.document_costs()[2] == pytest.approx(alone[2] + 2 * 0.25)  # every member waits on the ring


def test_collate_reads_the_shared_stream_marker():
    from sparsebalance_pl.datamodules import PlanItems
    from sparsebalance_pl.datamodules.sampler import SharedStream

    items = PlanItems([{"tokens": np.arange(1, 6)}, {"tokens": np.arange(1, 4)}], 2)
    shared = collate_packed([items[SharedStream(2)], items[0], items[1]])
    alone = collate_packed([items[0], items[1]])
    assert shared["shared_stream"] == 2 and alone["shared_stream"] == 1
    assert all(torch.equal(shared[k], alone[k]) for k in ("input_ids", "targets", "position_ids", "cu_seqlens"))
