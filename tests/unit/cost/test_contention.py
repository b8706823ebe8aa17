"""CPU contention while profiling: measured from the kernel's counters, recorded in the table, warned about."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsebalance_pl.cost.contention import TOLERATED_CORES, CpuContention, measure_contention
from sparsebalance_pl.cost.profiler import KernelSettings, device_name, latency_model_for_run
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import ModelDims

needs_proc_stat = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="Linux's /proc/stat")
SPIN = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"


@needs_proc_stat
def test_another_process_spinning_on_our_cpus_counts_as_other_work():
    with measure_contention(cores_used=1) as contention:
        subprocess.run([sys.executable, "-c", SPIN], check=True)  # a child's CPU time is not this process's
    assert contention.other_cores >= 0.6, contention
    with measure_contention(cores_used=1) as own:
        end = time.process_time() + 1.0
        while time.process_time() < end:  # this process's own work is not contention
            pass
    assert own.other_cores < contention.other_cores - 0.3, (own, contention)
    with measure_contention(cores_used=1, own_children=True) as benchmark:
        subprocess.run([sys.executable, "-c", SPIN], check=True)  # a benchmark's own run is not contention
    assert benchmark.other_cores < contention.other_cores - 0.3, (benchmark, contention)


def test_busy_means_more_other_work_than_the_spare_cores_hold():
    assert not CpuContention(spare_cores=1, other_cores=1.0 + TOLERATED_CORES).busy
    assert CpuContention(spare_cores=1, other_cores=1.1 + TOLERATED_CORES).busy
    assert not CpuContention(spare_cores=0, other_cores=None).busy  # not measured
    assert CpuContention.from_notes({}) is None  # a table from before contention was recorded
    assert CpuContention.from_notes(CpuContention(0, 0.7).as_notes()) == CpuContention(0, 0.7)


def test_a_table_profiled_on_a_busy_machine_is_used_with_a_warning(tmp_path, caplog, monkeypatch):
    dims = ModelDims(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     vocab_size=128)
    model = LatencyModel.analytic(dims, block_size=32, stride=8, device=device_name("cpu"), dtype="float32")
    notes = model.table.meta.notes
    monkeypatch.setattr("sparsebalance_pl.cost.profiler.profile_hardware", pytest.fail)
    for clock, other_cores, warned in (("wall", 0.9, True), ("wall", 0.1, False), ("cpu", 0.9, False)):
        notes.update(clock=clock, **CpuContention(spare_cores=0, other_cores=other_cores).as_notes())
        path = model.save(tmp_path / f"{clock}_{other_cores}.json")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            loaded = latency_model_for_run(path, dims.to_hf_config(), KernelSettings(block_size=32, stride=8),
                                           max_length=8192)
        assert loaded.predict([512], 0.5) == pytest.approx(model.predict([512], 0.5))
        assert ("other work took 0.9 cores of its CPUs (0 left spare)" in caplog.text) == warned, caplog.text
