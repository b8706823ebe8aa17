"""The cost model as one object: predictions, learning from steps of every rank, state."""

import json
from dataclasses import replace

import numpy as np
import pytest

from sparsebalance_pl.cost import CostModel, DensityEstimator, SparsityReport, StepRecord
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS

LONG, SHORT = [4096], [512] * 8


def _cost(sparse: bool = True, warmup_steps: int = 0) -> CostModel:
    latency = LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16)
    return CostModel(latency, DensityEstimator(block_size=64) if sparse else None, warmup_steps=warmup_steps)


def _record(cost: CostModel, lengths: list[int], density: float, slower: float = 1.0) -> StepRecord:
    """A rank's step whose attention took ``slower`` times what ``cost`` predicts at nominal speed."""
    seconds = slower * cost.timed_seconds(lengths, density)
    report = SparsityReport([density] * 4, [0.9] * 4, [density] * len(lengths), seconds)
    return StepRecord(lengths, report)


def test_document_costs_follow_the_density_estimate():
    sparse, dense = _cost(), _cost(sparse=False)
    lengths = np.array([256, 4096])
    assert np.allclose(dense.document_density(lengths), 1.0)
    assert sparse.document_density(lengths)[1] < 1.0
    assert (sparse.document_costs(lengths) <= dense.document_costs(lengths) + 1e-12).all()
    assert sparse.document_costs(lengths)[1] < dense.document_costs(lengths)[1]


def test_a_slow_rank_is_learned_as_slow_and_only_its_timed_terms_scale():
    # Same documents on both ranks: with different ones, "rank 1 is slow" and "a term rank 1 spends more on is
    # costlier" explain the same times, and the filter rightly splits the difference.
    cost, truth = _cost(), _cost()
    for _ in range(20):
        cost.observe([_record(truth, LONG, 0.5), _record(truth, LONG, 0.5, slower=2.0)])
    assert cost.speed(1) / cost.speed(0) == pytest.approx(2.0, rel=0.05)
    base, slow = cost.for_rank(0).breakdown(LONG, 0.5), cost.for_rank(1).breakdown(LONG, 0.5)
    assert slow["attention"] / base["attention"] == pytest.approx(cost.speed(1) / cost.speed(0))
    assert slow["tokens"] == pytest.approx(base["tokens"])
    step = cost.last_step
    assert step.measured_imbalance == pytest.approx(2 / 1.5) and len(step.records) == 2
    assert np.abs(step.predicted / step.measured - 1).max() < 0.1  # predicted with the learned speeds


def test_calibration_corrects_a_wrong_table_and_learns_densities():
    cost = _cost()
    truth = CostModel(LatencyModel(cost.latency.table.scaled(3.0)))
    before = abs(cost.timed_seconds(LONG, 0.3) / truth.timed_seconds(LONG, 0.3) - 1)
    for density in (0.2, 0.4, 0.3, 0.5, 0.25, 0.35):
        cost.observe([_record(truth, LONG, density), _record(truth, SHORT, density)])
    after = abs(cost.timed_seconds(LONG, 0.3) / truth.timed_seconds(LONG, 0.3) - 1)
    assert before > 0.5 and after < 0.1
    assert cost.density.observed


def test_warmup_steps_teach_densities_but_no_times():
    cost, truth = _cost(warmup_steps=1), _cost()
    scales = cost.latency.calibration.scales.copy()
    cost.observe([_record(truth, LONG, 0.3, slower=3.0), _record(truth, SHORT, 0.3)])  # a slow first step
    assert np.allclose(cost.latency.calibration.scales, scales) and cost.log_speeds.tolist() == [0.0, 0.0]
    assert cost.steps_observed == 0 and cost.density.observed
    cost.observe([_record(truth, LONG, 0.3, slower=3.0), _record(truth, SHORT, 0.3)])
    assert cost.steps_observed == 1 and cost.speed(0) > cost.speed(1)


def test_one_step_moves_no_ranks_timed_prediction_more_than_twice():
    cost, truth = _cost(), _cost()
    before = [cost.for_rank(r).breakdown(LONG, 0.3)["attention"] for r in (0, 1)]
    for _ in range(6):
        cost.observe([_record(truth, LONG, 0.3, slower=30.0), _record(truth, SHORT, 0.3, slower=0.2)])
        after = [cost.for_rank(r).breakdown(LONG, 0.3)["attention"] for r in (0, 1)]
        moves = np.array(after) / np.array(before)
        assert (moves <= 2.0 + 1e-9).all() and (moves >= 0.5 - 1e-9).all()
        before = after
    assert cost.speed(0) > 2 * cost.speed(1)  # the speeds still separate the ranks, over steps


def test_unmeasured_step_leaves_speeds_and_table_alone():
    cost = _cost()
    record = _record(cost, LONG, 0.5)
    zero = StepRecord(SHORT, SparsityReport([0.5] * 4, [0.9] * 4, [0.5] * 8, 0.0))
    scales = cost.latency.calibration.scales.copy()
    cost.observe([record, zero])
    assert cost.log_speeds.tolist() == [0.0, 0.0]
    assert np.allclose(cost.latency.calibration.scales, scales)  # the measured rank agreed with the table


def test_state_round_trips_through_json():
    cost = _cost()
    cost.observe([_record(_cost(), LONG, 0.4), _record(_cost(), SHORT, 0.4, slower=1.5)])
    state = json.loads(json.dumps(cost.state_dict()))
    twin = _cost()
    twin.load_state_dict(state)
    assert twin.state_dict() == cost.state_dict()
    assert twin.document_costs(SHORT + LONG) == pytest.approx(cost.document_costs(SHORT + LONG))
    assert twin.for_rank(1).predict(LONG, 0.3) == pytest.approx(cost.for_rank(1).predict(LONG, 0.3))


def test_rank_count_change_restarts_speeds(caplog):
    cost = _cost()
    cost.observe([_record(_cost(), LONG, 0.4), _record(_cost(), SHORT, 0.4, slower=1.5)])
    cost.observe([_record(_cost(), LONG, 0.4)] * 3)
    assert cost.log_speeds.size == 3 and "restart" in caplog.text


def test_step_overhead_follows_the_measured_optimiser_time_after_the_first_step():
    cost = CostModel(LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16), speed_smoothing=0.5)
    cost.observe_step_overhead(5.0)  # the first step allocates the optimiser's state
    assert cost.step_overhead == 0.0
    for seconds in (0.2, 0.2, 0.2, float("nan"), 0.2):
        cost.observe_step_overhead(seconds)
    assert cost.step_overhead == pytest.approx(0.2)
    restored = CostModel(LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16))
    restored.load_state_dict(cost.state_dict())
    assert restored.step_overhead == pytest.approx(0.2)


def test_a_rank_sharing_a_stream_is_predicted_and_learned_at_its_share():
    cost, truth = _cost(), _cost()
    halved = cost.for_rank(0, share=0.5).breakdown(LONG, 0.5)
    whole = cost.for_rank(0).breakdown(LONG, 0.5)
    assert all(halved[name] == pytest.approx(whole[name] / 2) for name in whole if name != "ring")
    assert whole["ring"] == 0.0 and cost.ring.seconds(LONG[0], 2) > 0
    assert halved["ring"] == pytest.approx(cost.ring.seconds(LONG[0], 2))
    # Rank 0 does half of a stream shared by two ranks, rank 1 a whole micro-batch of its own: both as predicted,
    # so neither looks fast or slow, and the table stays calibrated.
    half = _record(truth, LONG, 0.5, slower=0.5)
    for _ in range(10):
        cost.observe([StepRecord(half.lengths, half.report, share=0.5), _record(truth, SHORT, 0.5)])
    assert cost.speed(0) == pytest.approx(cost.speed(1), rel=1e-6)
    assert cost.timed_seconds(LONG, 0.5) == pytest.approx(truth.timed_seconds(LONG, 0.5), rel=1e-6)


def _shared(cost: CostModel, lengths: list[int], density: float, wait: float) -> StepRecord:
    """A rank's half of a stream shared by two: its compute as ``cost`` predicts, plus ``wait`` seconds on the ring."""
    compute = cost.timed_seconds(lengths, density) / 2
    report = SparsityReport([density] * 4, [0.9] * 4, [density] * len(lengths), compute + wait, ring_seconds=wait)
    return StepRecord(lengths, report, share=0.5)


def test_ring_waits_teach_the_ring_cost_and_not_the_ranks_speeds():
    cost, truth = _cost(), _cost()
    # Rank 1 waits longer: on the transfers, and then on rank 0 (a slower member's compute is not communication).
    for _ in range(6):
        cost.observe([_shared(truth, LONG, 0.5, wait=0.3), _shared(truth, LONG, 0.5, wait=0.45)])
    assert cost.speed(0) == pytest.approx(cost.speed(1), rel=1e-6)
    assert cost.timed_seconds(LONG, 0.5) == pytest.approx(truth.timed_seconds(LONG, 0.5), rel=1e-6)
    assert cost.ring.seconds(LONG[0], 2) == pytest.approx(0.3, rel=1e-6)  # the group's least wait
    rank = cost.for_rank(0, share=0.5)
    assert rank.predict(LONG, 0.5) - truth.for_rank(0, share=0.5).predict(LONG, 0.5) == pytest.approx(0.3 - truth.ring.seconds(LONG[0], 2))
    assert cost.last_step.predicted[0] == pytest.approx(cost.last_step.measured[0], rel=1e-6)
    # The planner's price of a shared document: the group's summed work plus every member's wait.
    assert cost.group_document_costs(LONG, 2)[0] == pytest.approx(cost.document_costs(LONG)[0] + 2 * 0.3)
    twin = _cost()
    twin.load_state_dict(json.loads(json.dumps(cost.state_dict())))
    assert twin.ring.seconds(LONG[0], 2) == pytest.approx(0.3)


def test_whole_rank_times_teach_the_terms_attention_timing_leaves_out():
    """Emulated ranks time each rank's whole forward and backward alone: with those, a table whose per-token
    terms are off by 2x is corrected; from attention times alone it cannot be (they do not cover those terms)."""
    truth = CostModel(LatencyModel(_cost().latency.table.scaled([2.0, 1.0, 1.0, 2.0])))
    batches = [(LONG, 0.3), (SHORT, 0.5), ([2048, 1024], 0.4), (LONG, 0.6)] * 3
    taught, timed_only = _cost(), _cost()
    for lengths, density in batches:
        records = [_record(truth, lengths, density), _record(truth, SHORT, density)]
        whole = [truth.latency.predict(r.lengths, density) for r in records]
        taught.observe(records, whole_seconds=whole)
        timed_only.observe(records)

    def error(cost):
        return max(abs(cost.latency.predict(ls, d) / truth.latency.predict(ls, d) - 1) for ls, d in batches)

    assert error(taught) < 0.05 < 0.3 < error(timed_only)
    assert taught.timed_seconds(LONG, 0.3) == pytest.approx(truth.timed_seconds(LONG, 0.3), rel=0.05)


def test_the_calibration_forgets_per_step_whatever_the_rank_count():
    """After the hardware slows down, 1 rank and 16 ranks per step track it alike, step for step: the filter
    forgets once per step, not once per rank's measurement."""
    batches = [(LONG, 0.3), (SHORT, 0.5), ([2048, 1024], 0.4), ([1024] * 3, 0.6)]
    before = CostModel(LatencyModel(_cost().latency.table.scaled([2.0, 1.5, 1.0, 2.0])))
    after = CostModel(LatencyModel(_cost().latency.table.scaled([2.6, 1.95, 1.0, 2.0])))

    def error_after_drift(ranks: int) -> float:
        cost = _cost()
        for step in range(40):
            truth = before if step < 30 else after
            chosen = [batches[(step + r) % len(batches)] for r in range(ranks)]
            records = [_record(truth, lengths, density) for lengths, density in chosen]
            cost.observe(records, whole_seconds=[truth.latency.predict(r.lengths, r.report.mean_density)
                                                 for r in records])
        return max(abs(np.log(cost.latency.predict(ls, d) / after.latency.predict(ls, d))) for ls, d in batches)

    one, many = error_after_drift(1), error_after_drift(16)
    assert 0.01 < one < 0.2 and 0.8 < many / one < 1.25


def test_a_direction_no_batch_excites_stays_within_its_prior():
    """Every micro-batch with the same tokens cannot tell per-token from per-micro-batch cost; forgetting must
    not widen that direction past its prior, where one batch of another size would swing the two terms."""
    calibration = _cost().latency.calibration
    raw = np.array([1.0, 0.5, 0.1, 0.2])
    for _ in range(300):
        calibration.update(raw * np.exp(0.05), float(raw.sum()))
    excess = np.linalg.eigvalsh(calibration.cov - calibration.prior_cov())
    assert excess.max() < 1e-9
    assert raw @ calibration.cov @ raw < 0.01 * raw @ calibration.prior_cov() @ raw  # the excited one is learned


def test_a_saved_step_replays_into_the_same_state():
    """``StepObservation.replay_dict`` through JSON and ``CostModel.replay`` teach what ``observe`` taught."""
    truth = CostModel(LatencyModel(_cost().latency.table.scaled([2.0, 1.5, 1.0, 2.0])))
    live, replayed = _cost(), _cost()
    for lengths, density in [(LONG, 0.3), (SHORT, 0.5), ([2048, 1024], 0.4)]:
        records = [_record(truth, lengths, density), _record(truth, SHORT, density, slower=1.2)]
        whole = [2 * r.report.attention_seconds for r in records]
        saved = json.loads(json.dumps(live.observe(records, whole_seconds=whole).replay_dict()))
        replayed.replay(saved)
    assert json.dumps(replayed.state_dict(), sort_keys=True) == json.dumps(live.state_dict(), sort_keys=True)


def test_a_move_is_priced_by_exact_recall_where_it_was_measured_else_by_the_estimate():
    moved = dict(density=[0.3] * 2, estimated_recall=[0.80] * 2, base_document_density=[0.4], attention_seconds=1.0,
                 base_density=[0.4] * 2, base_estimated_recall=[0.90] * 2)
    estimated = SparsityReport(**moved)
    assert estimated.moved() == pytest.approx((-0.1, -0.1))
    assert SparsityReport(**moved, recall=0.85, base_recall=0.88).moved() == pytest.approx((-0.1, -0.03))
    assert SparsityReport(**moved, recall=0.85).moved() == pytest.approx((-0.1, -0.1))  # no base recall measured
    assert SparsityReport(**dict(moved, base_density=None)).moved() is None


def test_the_error_starts_from_what_the_latency_model_expects_of_itself():
    """A table profiled on this machine for this model starts DST's trust at the spread of its own timings; the
    analytic prior starts uncalibrated; measured steps take over either way."""
    cost = _cost()
    assert cost.error == 1.0  # the analytic prior
    table = cost.latency.table
    meta = replace(table.meta, source="profile", notes={"timing_spread": 0.04})
    cost.latency = LatencyModel(replace(table, meta=meta))
    assert cost.latency.prior_error == 0.04 and cost.error == 0.04
    cost.observe([_record(cost, LONG, 0.5, slower=1.5)])
    assert cost.error == pytest.approx((0.04 + np.log(1.5)) / 2)  # the start counts as one step
    cost.latency = LatencyModel.analytic(PRESETS["demo"].dims, block_size=64, stride=16)
    assert cost.error == pytest.approx((0.04 + np.log(1.5)) / 2)  # learned: a new table does not reset it
