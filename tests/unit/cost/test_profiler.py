"""Profiler: a tiny profile with the real kernels, the timing rule, and the start-of-run fallbacks."""

import dataclasses
import logging
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import ModelDims
from sparsebalance_pl.cost.profiler import (
    KernelSettings,
    ProfileGrid,
    analytic_prior,
    latency_model_for_run,
    measure_seconds,
    profile_hardware,
    training_dtype,
)
from sparsebalance_pl.cost.profiler import _KernelBench
from sparsebalance_pl.kernels.selection import selection_options

TINY = ModelDims(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=128)
TINY_CONFIG = TINY.to_hf_config()
TINY_GRID = ProfileGrid(
    lengths=(128, 256), densities=(0.5, 1.0), token_counts=(128, 2048), repeats=2, cell_seconds=0.5,
    model_steps=3, model_tokens=(128, 512), passes=2,
)
KERNELS = KernelSettings(block_size=32, stride=8)
BLOCKS = dict(block_size=32, stride=8)  # the same kernels, for the latency model's lookups and prior


@contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    """Timed in CPU time on one thread, so other jobs on a shared machine cannot distort the tiny timings."""
    path = tmp_path_factory.mktemp("profile") / "table.json"
    with one_thread():
        return path, profile_hardware(TINY_CONFIG, KERNELS, grid=TINY_GRID, progress=False, output=path, clock="cpu")


def test_tiny_profile_measures_every_part_and_describes_itself(tiny_profile):
    path, model = tiny_profile
    table = model.table
    assert table.attention.shape == (2, 2) and table.selection.shape == (2,)
    assert np.all(table.attention > 0) and table.token_layer > 0 and table.token_head >= 0
    assert table.selection_scope in ("stream", "document")
    meta = table.meta
    assert meta.device.endswith("(1 threads)") and meta.notes["clock"] == "cpu"
    assert meta.dims["num_layers"] == 2 and meta.dims["head_dim"] == 32
    assert (meta.block_size, meta.stride, meta.dtype) == (32, 8, "float32")
    assert set(meta.versions) == {"torch", "triton", "transformers"}
    assert meta.notes["timing_spread"] >= 0 and model.prior_error == meta.notes["timing_spread"]  # DST's first trust
    # The parts' terms are scaled to the whole-model steps, and a call's fixed cost moved to the layer.
    scales = np.array(list(meta.notes["model_step_scales"].values()))
    assert scales.shape == (4,) and np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert meta.notes["model_step_error_fitted"] >= 0 and meta.notes["attention_call_seconds"] >= 0
    loaded = LatencyModel.from_file(path, TINY, **BLOCKS)
    assert loaded.predict([100, 200], 0.7) == pytest.approx(model.predict([100, 200], 0.7))
    assert model.predict([256], 1.0) > model.predict([128], 1.0)
    with pytest.raises(ValueError, match="set_num_threads"):
        profile_hardware(TINY_CONFIG, KERNELS, grid=TINY_GRID, progress=False, clock="cpu")  # with 2 threads


def test_measure_seconds_takes_the_fastest_run_after_a_warm_up():
    durations = [0.03, 0.02, 0.01, 0.02]
    calls = []

    def work():
        time.sleep(durations[len(calls)])
        calls.append(1)

    fastest = measure_seconds(work, device=torch.device("cpu"), repeats=3, budget=10.0)
    assert len(calls) == 4 and 0.01 <= fastest < 0.02
    slow = measure_seconds(lambda: time.sleep(0.05), device=torch.device("cpu"), repeats=5, budget=0.01)
    assert slow >= 0.05  # a warm-up longer than the budget is the only sample


def test_run_start_uses_a_fitting_table_without_profiling(tiny_profile, monkeypatch):
    path, model = tiny_profile
    monkeypatch.setattr("sparsebalance_pl.cost.profiler.profile_hardware", pytest.fail)
    with one_thread():  # the device the table names
        loaded = latency_model_for_run(path, TINY_CONFIG, KERNELS, max_length=256)
    assert loaded.predict([200], 0.5) == pytest.approx(model.predict([200], 0.5))


def test_run_start_profiles_again_for_another_dtype_or_longer_documents(tiny_profile, monkeypatch, caplog):
    path, model = tiny_profile
    profiled = []
    monkeypatch.setattr(
        "sparsebalance_pl.cost.profiler.profile_hardware",
        lambda config, kernels, **kw: profiled.append((kernels, kw)) or LatencyModel.analytic(TINY, **BLOCKS),
    )
    half = dataclasses.replace(KERNELS, dtype=torch.bfloat16)
    with one_thread(), caplog.at_level(logging.WARNING):
        latency_model_for_run(path, TINY_CONFIG, half, max_length=256)
        latency_model_for_run(path, TINY_CONFIG, KERNELS, max_length=1024)
        kept = latency_model_for_run(path, TINY_CONFIG, KERNELS, max_length=1024, profile=False)
    assert [(k.dtype, kw["max_length"]) for k, kw in profiled] == [(torch.bfloat16, 256), (torch.float32, 1024)]
    assert kept.predict([200], 0.5) == pytest.approx(model.predict([200], 0.5))  # shorter, but better than a prior
    said = [record.getMessage() for record in caplog.records]
    assert "in float32, this run is on" in said[0] and "in bfloat16: profiling the latency table" in said[0]
    assert "stops at documents of 256 tokens, this run needs 1024: profiling" in said[1]
    assert said[2].endswith("needs 1024: using it, online calibration will correct it") and len(said) == 3


def test_run_start_profiles_again_for_other_selection_options(tiny_profile, monkeypatch):
    """A table times selection with the options it was profiled for (defaults here): a run selecting otherwise
    (the sampled estimate with probes costs more) profiles its own, and the new table records the options."""
    path, _ = tiny_profile
    assert LatencyModel.from_file(path).table.meta.selection == selection_options()
    profiled = []
    monkeypatch.setattr(
        "sparsebalance_pl.cost.profiler.profile_hardware",
        lambda config, kernels, **kw: profiled.append(kernels.selection) or LatencyModel.analytic(TINY, **BLOCKS),
    )
    quality = {"estimate": "sampled", "recall_probes": 1}
    with one_thread():
        latency_model_for_run(path, TINY_CONFIG, dataclasses.replace(KERNELS, selection=quality), max_length=256)
        latency_model_for_run(path, TINY_CONFIG, dataclasses.replace(KERNELS, selection={"sink_blocks": 1}),
                              max_length=256)
    assert profiled == [selection_options(**quality)]  # the second asks for the defaults, which the table has
    bench = _KernelBench(TINY, dataclasses.replace(KERNELS, selection=quality))
    assert bench.kernels.selection == selection_options(**quality)


@pytest.mark.parametrize("precision, device, dtype", [
    ("bf16-mixed", "cuda", torch.bfloat16), ("bf16-true", "cpu", torch.float32), ("16-mixed", "cuda", torch.float16),
    ("32-true", "cuda", torch.float32), (32, "cpu", torch.float32),
])
def test_training_dtype_follows_the_precision_off_the_cpu(precision, device, dtype):
    assert training_dtype(precision, device) == dtype


def test_run_start_profiles_again_on_another_device(tiny_profile, monkeypatch, caplog):
    path, _ = tiny_profile
    profiled = []
    monkeypatch.setattr(
        "sparsebalance_pl.cost.profiler.profile_hardware",
        lambda config, kernels, **kw: profiled.append(kw["output"]) or LatencyModel.analytic(TINY, **BLOCKS),
    )
    monkeypatch.setattr("sparsebalance_pl.cost.profiler.device_name", lambda device: "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.WARNING):
        latency_model_for_run(path, TINY_CONFIG, KERNELS, max_length=256)
    assert profiled == [path]
    assert "this run is on 'NVIDIA H100 80GB HBM3' in float32: profiling" in caplog.text


@pytest.mark.parametrize("device, dtype, throughput", [
    ("cpu", torch.float32, 5e10), ("cuda", torch.bfloat16, 2e14), ("cuda", torch.float32, 4e13),
])
def test_the_analytic_prior_assumes_the_throughput_of_the_device(device, dtype, throughput, monkeypatch):
    monkeypatch.setattr("sparsebalance_pl.cost.profiler.device_name", lambda d: f"a {torch.device(d).type}")
    prior = analytic_prior(TINY_CONFIG, dataclasses.replace(KERNELS, device=device, dtype=dtype))
    meta = prior.table.meta
    assert meta.source == "analytic" and meta.notes["flops_per_second"] == throughput
    assert (meta.device, meta.dtype, meta.block_size, meta.stride) == (f"a {device}", str(dtype)[6:], 32, 8)
    on_cpu = analytic_prior(TINY_CONFIG, KERNELS)
    assert prior.table.token_layer == pytest.approx(on_cpu.table.token_layer * 5e10 / throughput)


def test_run_start_falls_back_to_the_prior_or_a_profile_for_bad_tables(tmp_path, caplog, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text("{corrupt")
    with caplog.at_level(logging.WARNING):
        prior = latency_model_for_run(path, TINY_CONFIG, KERNELS, profile=False)
    assert prior.table.meta.source == "analytic"
    assert "not JSON" in caplog.text and "analytic prior" in caplog.text

    profiled = []
    monkeypatch.setattr(
        "sparsebalance_pl.cost.profiler.profile_hardware",
        lambda config, kernels, **kw: profiled.append(kw) or LatencyModel.analytic(TINY, **BLOCKS),
    )
    other = ModelDims(num_layers=3, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=128)
    LatencyModel.analytic(other, **BLOCKS).save(path)
    latency_model_for_run(path, TINY_CONFIG, KERNELS)
    assert profiled and profiled[0]["output"] == path and profiled[0]["quick"]
    assert "num_layers: table 3 != model 2" in caplog.text


def test_whole_model_steps_that_run_out_of_memory_are_left_out_of_the_fit(monkeypatch, caplog):
    from sparsebalance_pl.cost.profiler import ModelStep

    real = ModelStep.workload

    def workload(self, lengths, density):
        if len(lengths) == 1:  # the long single documents of the grid's extremes
            def oom():
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return oom
        return real(self, lengths, density)

    monkeypatch.setattr(ModelStep, "workload", workload)
    grid = ProfileGrid(lengths=(128, 256), densities=(0.5, 1.0), token_counts=(128, 512), repeats=1,
                       cell_seconds=0.2, model_steps=5, model_tokens=(128, 512))
    with caplog.at_level(logging.WARNING):
        model = profile_hardware(TINY_CONFIG, KERNELS, grid=grid, progress=False)
    assert "ran out of memory; left out of the fit" in caplog.text
    assert np.isfinite(model.table.meta.notes["model_step_error_fitted"])


def _module_step(dims: dict):
    """A stand-in module's forward and backward: dense attention of each document with the real kernels, then a
    linear layer per token, in every layer."""
    from sparsebalance_pl.kernels import block_sparse_attention, select_blocks

    hidden = dims["hidden_size"]
    weight = torch.randn(hidden, 4 * hidden, requires_grad=True)

    def step(lengths: list[int]) -> None:
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
        tokens = int(cu[-1])
        q = torch.randn(tokens, dims["num_heads"], dims["head_dim"], requires_grad=True)
        k, v = (torch.randn(tokens, dims["num_kv_heads"], dims["head_dim"], requires_grad=True) for _ in range(2))
        total = 0
        for _ in range(dims["num_layers"]):
            mask = select_blocks(q.detach(), k.detach(), cu, tau=1.0, **BLOCKS)
            out = block_sparse_attention(q, k, v, mask, cu, block_size=KERNELS.block_size)
            total = total + (out.reshape(tokens, -1)[:, :hidden] @ weight).sum()
        total.backward()

    return step


def test_profile_module_measures_a_module_of_its_own():
    from sparsebalance_pl.cost.profiler import profile_module

    dims = {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
            "intermediate_size": 128, "vocab_size": 128}
    step = _module_step(dims)
    lengths = [128] * 12  # a stream the profile did not time
    # Timed on a shared machine: two sweeps keep each cell's faster time (one sweep overpredicted by more than
    # 35% in half of the tries under load, two in none of 20), and a disturbed profile gets a second try.
    grid = dataclasses.replace(TINY_GRID, passes=2)
    # (a disturbed profile can also fit a per-token cost of 0: so it failed in a fresh clone beside the demo)
    tries = []
    for _ in range(2):
        with one_thread():
            model = profile_module(dims, step, KERNELS, grid=grid, progress=False, clock="cpu")
            measured = measure_seconds(lambda: step(lengths), device=torch.device("cpu"), repeats=3, budget=2.0,
                                       clock="cpu")
        meta = model.table.meta
        assert meta.dims["head_dim"] == 32 and meta.block_size == 32 and meta.notes["token_costs"] == "module steps"
        tries.append((model.table.token_layer, abs(model.predict(lengths, 1.0) / measured - 1)))
        if tries[-1][0] > 0 and tries[-1][1] <= 0.35:
            break
    assert any(token_layer > 0 and error <= 0.35 for token_layer, error in tries), tries
