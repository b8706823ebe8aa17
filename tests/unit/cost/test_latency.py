"""LatencyModel: shape of predictions, inversion, online calibration, persistence and table validation."""

import json
import logging

import numpy as np
import pytest

from sparsebalance_pl.cost.latency import (
    LatencyModel,
    LatencyTable,
    LatencyTableError,
    TableMeta,
    UnreachableTimeError,
    cost_dims,
)
from sparsebalance_pl.model import PRESETS
from sparsebalance_pl.cost.profiler import random_micro_batches

DEMO = PRESETS["demo"].dims


def analytic(**kwargs) -> LatencyModel:
    return LatencyModel.analytic(DEMO, block_size=64, stride=16, **kwargs)


def noisy_table(seed: int = 0) -> LatencyModel:
    """A measured-looking table: right shape, multiplicative noise that breaks monotonicity before cleaning."""
    base = analytic().table
    rng = np.random.default_rng(seed)
    return LatencyModel(
        LatencyTable(
            meta=base.meta,
            lengths=base.lengths,
            densities=base.densities,
            attention=base.attention * rng.uniform(0.8, 1.2, base.attention.shape),
            selection=base.selection * rng.uniform(0.8, 1.2, base.selection.shape),
            token_layer=base.token_layer,
            token_head=base.token_head,
            layer_overhead=base.layer_overhead,
            model_overhead=base.model_overhead,
        )
    )


def random_batches(count: int, seed: int) -> list[tuple[list[int], float]]:
    """Micro-batches like the issue's: 1-8 documents, 256-8192 tokens, density 0.05-1."""
    return random_micro_batches(count, np.random.default_rng(seed), 256, 8192)


def median_ape(model: LatencyModel, truth: LatencyModel, batches) -> float:
    errors = [abs(model.predict(n, d) / truth.predict(n, d) - 1) for n, d in batches]
    return float(np.median(errors))


@pytest.mark.parametrize("make", [analytic, noisy_table])
def test_predict_is_monotone_in_density_and_length(make):
    model = make()
    densities = np.linspace(0.01, 1.0, 60)
    for lengths in ([100], [4096], [20000], [300, 1200, 3000]):
        times = [model.predict(lengths, d) for d in densities]
        assert np.all(np.diff(times) >= -1e-15)
    for density in (0.05, 0.4, 1.0):
        times = [model.predict([n], density) for n in np.geomspace(1, 200_000, 80)]
        assert np.all(np.diff(times) >= -1e-15)
        assert times[-1] > 100 * times[0]


def test_doc_costs_add_up_to_predict_and_accept_per_document_density():
    model = analytic()
    lengths = np.array([0, 64, 1000, 5000])
    density = np.array([0.3, 0.3, 0.1, 0.9])
    costs = model.doc_costs(lengths, density)
    assert costs.shape == (4,) and costs[0] == 0
    assert model.predict(lengths, density) == pytest.approx(costs.sum() + model.batch_cost(lengths.sum()))
    assert sum(model.breakdown(lengths, density).values()) == pytest.approx(model.predict(lengths, density))
    with pytest.raises(ValueError):
        model.predict([100, -1], 0.5)


def test_selection_scope_decides_whether_selection_follows_the_stream_or_the_documents():
    stream = analytic()
    document = LatencyModel(LatencyTable(**{**vars(stream.table), "selection_scope": "document"}))
    one, split = [4096], [512] * 8
    assert stream.breakdown(split, 0.2)["selection"] == pytest.approx(stream.breakdown(one, 0.2)["selection"])
    assert document.breakdown(split, 0.2)["selection"] < document.breakdown(one, 0.2)["selection"] / 4
    assert document.doc_costs(split, 0.2).sum() > stream.doc_costs(split, 0.2).sum()


def test_density_for_round_trips_and_reports_unreachable_times():
    model = noisy_table(1)
    for lengths, _ in random_batches(20, seed=2):
        fastest, dense = model.predict(lengths, model.min_density), model.predict(lengths, 1.0)
        for target in np.linspace(fastest, dense, 7):
            assert model.predict(lengths, model.density_for(lengths, target)) == pytest.approx(target, rel=0.02)
        with pytest.raises(UnreachableTimeError) as below:
            model.density_for(lengths, 0.5 * fastest)
        assert below.value.density == model.min_density and "below the fastest" in str(below.value)
        with pytest.raises(UnreachableTimeError) as above:
            model.density_for(lengths, 2 * dense)
        assert above.value.density == 1.0
        assert model.density_for(lengths, 2 * dense, clip=True) == 1.0
        assert model.density_for(lengths, 0.5 * fastest, clip=True) == model.min_density


def test_scaled_multiplies_one_term_or_all():
    table = noisy_table(1).table
    lengths = [300, 2000, 5000]
    base = LatencyModel(table).breakdown(lengths, 0.3)
    per_term = LatencyModel(table.scaled([0.5, 2.0, 3.0, 4.0])).breakdown(lengths, 0.3)
    assert [per_term[k] / base[k] for k in ("tokens", "attention", "selection")] == pytest.approx([0.5, 2.0, 3.0])
    common = LatencyModel(table.scaled(2.0))
    assert common.predict(lengths, 0.3) == pytest.approx(2 * LatencyModel(table).predict(lengths, 0.3))


def test_fit_scales_recovers_how_the_parts_compose_from_a_few_whole_steps():
    """The profiler's last step: the table's terms are each off by their own factor in the whole model."""
    truth = noisy_table(2)
    truth.calibration.log_scales = np.log([1.5, 1.8, 1.2, 1.0])
    parts = noisy_table(2)
    rng = np.random.default_rng(3)
    steps = [(n, d, truth.predict(n, d) * rng.lognormal(0, 0.02)) for n, d in random_batches(8, seed=4)]
    scales = parts.fit_scales(steps)
    assert scales[:2] == pytest.approx([1.5, 1.8], rel=0.1)
    held_out = random_batches(40, seed=5)
    assert median_ape(parts, truth, held_out) > 0.2
    assert median_ape(LatencyModel(parts.table.scaled(scales)), truth, held_out) < 0.05


def test_observe_recovers_from_a_doubled_table():
    truth = noisy_table(3)
    doubled = LatencyModel(truth.table.scaled(2.0))
    held_out = random_batches(40, seed=4)
    assert median_ape(doubled, truth, held_out) > 0.9
    rng = np.random.default_rng(5)
    for lengths, density in random_batches(20, seed=6):
        doubled.observe(lengths, density, truth.predict(lengths, density) * rng.lognormal(0, 0.05))
    assert median_ape(doubled, truth, held_out) < 0.15


def test_observe_turns_the_analytic_prior_into_a_different_true_model():
    """Truth has its own term balance (slow attention, heavy overhead) that no single factor fixes."""
    truth = analytic(flops_per_second=2e10, attention_efficiency=0.08, layer_overhead=5e-3)
    truth.calibration.log_scales = np.log([0.7, 1.0, 3.0, 1.0])
    prior = analytic()
    held_out = random_batches(40, seed=7)
    assert median_ape(prior, truth, held_out) > 0.5
    rng = np.random.default_rng(8)
    outlier_step = 5
    for step, (lengths, density) in enumerate(random_batches(20, seed=9)):
        noise = 3.0 if step == outlier_step else rng.lognormal(0, 0.05)  # one disturbed measurement
        prior.observe(lengths, density, truth.predict(lengths, density) * noise)
    assert median_ape(prior, truth, held_out) < 0.15


def test_observe_can_calibrate_from_attention_timings_alone():
    model = analytic()
    lengths = [2000, 3000]

    def attention_time() -> float:
        parts = model.breakdown(lengths, 0.3)
        return parts["attention"] + parts["selection"]

    measured = 2 * attention_time()
    assert model.observe(lengths, 0.3, measured, terms=("attention", "selection")) == pytest.approx(measured / 2)
    assert attention_time() == pytest.approx(measured, rel=0.05)
    with pytest.raises(ValueError, match="unknown terms"):
        model.observe(lengths, 0.3, 1.0, terms=("mlp",))


def test_save_load_and_state_dict_round_trip(tmp_path):
    model = noisy_table(10)
    for lengths, density in random_batches(5, seed=11):
        model.observe(lengths, density, 1.3 * model.predict(lengths, density))
    path = model.save(tmp_path / "sub" / "table.json")
    loaded = LatencyModel.from_file(path, DEMO, block_size=64, stride=16)
    fresh = analytic()
    fresh.load_state_dict(json.loads(json.dumps(model.state_dict())))
    for lengths, density in random_batches(10, seed=12):
        expected = model.predict(lengths, density)
        assert loaded.predict(lengths, density) == pytest.approx(expected, rel=1e-12)
        assert fresh.predict(lengths, density) == pytest.approx(expected, rel=1e-12)
    assert loaded.calibration.count == 5


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "does not exist"),
        ("{not json", "not JSON"),
        ('{"table": {"format": "other"}}', "not a latency table"),
        ('{"table": {"format": "sparsebalance-latency/1", "meta": {}}}', "incomplete or malformed"),
    ],
)
def test_missing_or_corrupt_tables_give_a_clear_reason_and_a_fallback(tmp_path, caplog, content, reason):
    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LatencyTableError, match=reason):
        LatencyModel.from_file(path)
    with caplog.at_level(logging.WARNING, logger="sparsebalance_pl.latency"):
        assert LatencyModel.load_or_none(path, DEMO, block_size=64, stride=16) is None
    assert reason in caplog.text and str(path) in caplog.text


def test_tables_for_other_dimensions_or_kernels_are_rejected(tmp_path, caplog):
    path = analytic(device="cpu-a").save(tmp_path / "table.json")
    with pytest.raises(LatencyTableError, match="num_layers: table 4 != model 24"):
        LatencyModel.from_file(path, PRESETS["qwen2.5-0.5b"].dims)
    with caplog.at_level(logging.WARNING, logger="sparsebalance_pl.latency"):
        assert LatencyModel.load_or_none(path, DEMO, block_size=128, stride=16) is None
        assert "block_size: table 64 != run 128" in caplog.text
        assert LatencyModel.load_or_none(path, DEMO, block_size=64, stride=16) is not None  # any device's


def test_a_table_is_matched_on_its_selection_options(tmp_path):
    path = analytic().save(tmp_path / "defaults.json")
    old = json.loads(path.read_text())
    del old["table"]["meta"]["selection"]  # a table from before the options: the defaults
    (tmp_path / "old.json").write_text(json.dumps(old))
    for table in (path, tmp_path / "old.json"):
        assert LatencyModel.from_file(table, DEMO, selection={"local_blocks": 1}) is not None
        with pytest.raises(LatencyTableError, match="selection estimate: table 'antidiagonal' != run 'sampled'"):
            LatencyModel.from_file(table, DEMO, selection={"estimate": "sampled"})
    newer = json.loads(path.read_text())
    newer["table"]["meta"]["selection"]["rank"] = "peak"  # an option this version does not know: re-profile
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    with pytest.raises(LatencyTableError, match="selection options of the table: unknown selection options"):
        LatencyModel.from_file(tmp_path / "newer.json", DEMO, selection={})
    probed = LatencyModel.analytic(DEMO, block_size=64, stride=16, selection={"recall_probes": 2})
    assert probed.table.meta.selection["recall_probes"] == 2
    assert np.all(probed.table.selection > analytic().table.selection)  # probe rows cost scoring time


def test_invalid_table_contents_are_rejected():
    meta = TableMeta(dims=cost_dims(DEMO), block_size=64, stride=16)
    good = dict(meta=meta, lengths=[256, 512], densities=[0.1, 1.0], attention=[[1, 2], [3, 4]], selection=[1, 2],
                token_layer=1e-6, token_head=1e-6)
    LatencyTable(**good)
    for change, message in [
        ({"densities": [0.1, 0.9]}, "end at 1.0"),
        ({"attention": [[1, 2]]}, "shape"),
        ({"selection": [1, float("nan")]}, "finite"),
        ({"lengths": [512, 256]}, "increasing"),
    ]:
        with pytest.raises(LatencyTableError, match=message):
            LatencyTable(**{**good, **change})


def test_public_name_is_the_cost_packages_model():
    import sparsebalance_pl.latency as public

    assert public.LatencyModel is LatencyModel


def test_a_kernel_with_a_fixed_cost_per_row_is_inverted_on_its_own_curve():
    """Attention time that is not linear in kept tiles (here a fixed cost per document, a fifth of the dense
    time, as the CPU table measures at short lengths): the profiled table holds the curve and ``density_for``
    inverts it, where a model linear in tiles with the same dense time would pick a density far off."""
    from dataclasses import replace

    base = analytic().table
    dense = base.attention[:, -1:]
    curved = LatencyModel(replace(base, attention=0.2 * dense + dense * base.densities[None, :]))
    linear = LatencyModel(replace(base, attention=1.2 * dense * base.densities[None, :]))
    lengths = [4096]
    target = curved.predict(lengths, 0.3)
    assert curved.density_for(lengths, target) == pytest.approx(0.3, abs=1e-6)
    assert linear.predict(lengths, 1.0) == pytest.approx(curved.predict(lengths, 1.0))
    assert linear.density_for(lengths, target) > 0.35  # the fixed cost read as kept tiles
