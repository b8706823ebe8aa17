"""The timing-noise benchmark's pure parts: which micro-batches it times and how it sums up their times."""

import sys

import numpy as np
import pytest
from main_runner import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import timing_noise  # noqa: E402


def test_it_times_the_longest_document_and_a_full_pack_of_middle_ones():
    lengths = np.array([100, 4000, 300, 900, 1000, 950, 50, 2000])
    batches = timing_noise.micro_batches(lengths, max_tokens=2000)
    assert batches["longest document"] == [1]
    packed = batches["middle documents packed"]
    assert lengths[packed].sum() <= 2000 and 1 not in packed and 7 not in packed  # the longest quarter left out
    assert lengths[packed].sum() >= 1950


def test_spread_tells_independent_draws_from_slow_spells():
    rng = np.random.default_rng(0)
    independent = np.exp(0.05 * rng.standard_normal(400)).tolist()
    spells = np.exp(0.05 * np.repeat(rng.standard_normal(40), 10)).tolist()
    a, b = timing_noise.spread(independent), timing_noise.spread(spells)
    assert a["spread"] == pytest.approx(0.05, rel=0.15) and abs(a["lag1_correlation"]) < 0.15
    assert b["lag1_correlation"] > 0.7
    slowest = a["expected_slowest_over_median"]
    assert 1.0 < slowest[8] < slowest[16] < slowest[32] < 1.2


def test_constant_times_have_no_spread():
    result = timing_noise.spread([2.0] * 5)
    assert result["spread"] == 0.0 and result["expected_slowest_over_median"][32] == 1.0


def test_too_few_repeats_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        timing_noise.parse_args(["--config", "c.yaml", "--repeats", "2"])
    assert "--repeats 2 must be at least 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        timing_noise.parse_args(["--config", "c.yaml", "--median-of", "0"])
    assert "--median-of 0 must be at least 1" in capsys.readouterr().err
