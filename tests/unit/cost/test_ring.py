"""The ring's communication cost: its prior formula and what it learns from measured waits."""

import math

import pytest

from sparsebalance_pl.cost.ring import RingCost


def _ring(**settings) -> RingCost:
    dims = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}
    return RingCost.for_model(dims, "bfloat16", **settings)


def test_prior_counts_three_transfers_per_ring_step_and_the_bytes_of_a_rank_s_rows():
    ring = _ring(latency=1e-5, bandwidth=1e9)
    assert (ring.kv_bytes, ring.grad_bytes) == (2 * 2 * 32 * 2, 2 * 2 * 32 * 4)
    tokens, size = 8192, 4
    expected = 4 * (size - 1) * (3 * 1e-5 + (2 * ring.kv_bytes + ring.grad_bytes) * tokens / size / 1e9)
    assert ring.seconds(tokens, size) == pytest.approx(expected)
    assert ring.seconds(tokens, 1) == 0.0 and ring.seconds(0, size) == 0.0
    assert RingCost.for_model({"num_layers": 4, "num_kv_heads": 2, "head_dim": 32}).kv_bytes == 2 * ring.kv_bytes


def test_measured_waits_replace_the_prior_and_then_follow_recent_steps():
    ring = _ring(smoothing=0.5)
    prior = ring.seconds(4096, 2)
    ring.observe(4096, 2, 3 * prior)
    assert ring.seconds(4096, 2) == pytest.approx(3 * prior)  # the first measurement replaces the prior
    assert ring.seconds(8192, 2) == pytest.approx(3 * ring.prior_seconds(8192, 2))  # and scales to other streams
    for _ in range(30):
        ring.observe(4096, 2, prior / 2)
    assert ring.seconds(4096, 2) == pytest.approx(prior / 2, rel=1e-3)


def test_a_wait_the_compute_hid_entirely_or_a_bad_measurement_does_not_break_the_scale():
    ring = _ring()
    ring.observe(4096, 2, 0.0)
    assert 0 < ring.seconds(4096, 2) < 1e-2 * ring.prior_seconds(4096, 2) and math.isfinite(ring.log_scale)
    before = ring.state_dict()
    for bad in (float("nan"), -1.0):
        ring.observe(4096, 2, bad)
    ring.observe(4096, 1, 1.0)  # no group: nothing to learn
    assert ring.state_dict() == before
    twin = _ring()
    twin.load_state_dict(before)
    assert twin.seconds(4096, 2) == ring.seconds(4096, 2)
