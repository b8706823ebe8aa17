"""scripts/gpu_check.sh, the check a session lent a GPU runs first, in its CPU smoke mode: the same benchmark
commands at toy sizes, so that the script cannot rot between GPU sessions, and without the packages the GPU
machine's image lacks (tests/helpers/device_image), so that it needs nothing carried there."""

import importlib.util
import json
import os
import re
import subprocess

import pytest
from main_runner import REPO


def test_the_smoke_run_prints_the_whole_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO / "tests" / "helpers" / "device_image")}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "smoke"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "summary.md").read_text()
    assert "tests collected" in table  # the CUDA tests import there
    for tokens in (256, 512, 1024):
        assert f"{tokens}: selection / dense forward" in table
        assert f"{tokens}: torch sparse at density 0.25" in table
    for tokens in (256, 512):  # not counted again at the longest length
        assert f"{tokens}: kernels and host syncs per layer (torch tuned)" in table
    assert "model step [512]: sparse cap=0.25" in table
    assert "model step [512]: dense, attention ms (share of the step)" in table  # what sparsity can shorten
    # A variant that cannot run costs its own row only.
    flex = "| model step [512]: flex cap=0.25 | failed: ValueError: the flex backend has no backward on the CPU"
    assert flex in table
    # The GPU compiler, run here, on the kernels in the run's shapes for Hopper and with heads of 128 for sm_86: none
    # may spill registers or need more shared memory than the GPU gives a program, which on sm_86 takes the
    # backward kernels down to two pipeline stages.
    stages = {}
    for arch, head_dim in (90, 64), (86, 128):
        compiled = {line.split(": ")[1].split(" |")[0]: line for line in table.splitlines()
                    if f"sm_{arch}, bf16, head dim {head_dim}, compiled without the GPU" in line}
        assert {"_block_mass_kernel", "_rank_kernel", "_fwd_kernel", "_dq_kernel", "_dkdv_kernel"} <= set(compiled)
        for name, line in compiled.items():
            figures, target = line.split(" | ")[1:3]
            shared, limit = (float(re.search(r"([\d.]+) KiB", text)[1]) for text in (figures, target))
            assert " 0 B spilled," in figures and shared <= limit, line
            stages[arch, name] = int(re.search(r"(\d+) stages", figures)[1])
    assert stages[86, "_dq_kernel"] == stages[86, "_dkdv_kernel"] == 2 and stages[86, "_fwd_kernel"] == 3
    # The table again from the files alone, as after a call cut short by its limit.
    (tmp_path / "cuda_tests.log").unlink()
    again = subprocess.run(["bash", "scripts/gpu_check.sh", "summary", str(tmp_path)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "| CUDA tests | not run |" in again.stdout and "model step [512]: sparse cap=0.25" in again.stdout


def test_the_summary_counts_the_densities_each_backend_is_fastest_at_and_names_the_failures(tmp_path):
    sparse = [{"backend": "triton", "mask": "selected", "density": 0.25, "ms": 3.0},
              {"backend": "flex", "mask": "selected", "density": 0.25, "ms": 2.0},
              {"backend": "triton", "mask": "selected", "density": 1.0, "ms": 9.0},
              {"backend": "flex", "mask": "selected", "density": 1.0, "ms": 11.0},
              {"backend": "flex", "mask": "selected", "density": 0.5, "ms": 5.0}]  # timed alone: no contest
    figures = {"dense_ms": {"dense": 10.0, "cudnn": 8.0}, "selection_ms": 0.5, "dense_forward_ms": 4.0,
               "sparse": sparse}
    figures["failed"] = {"triton selected 0.1": "OutOfMemoryError: CUDA out of memory."}
    busiest = [{"name": "_dkdv_kernel", "ms": 1.5, "calls": 1}, {"name": "_rank_kernel", "ms": 0.25, "calls": 2},
               {"name": "at::native::elementwise_kernel", "ms": 0.125, "calls": 9}, {"name": "_dq_kernel", "ms": 0.1,
                                                                                    "calls": 1}]
    figures["launches"] = {"triton base": {"kernels": 25, "host_syncs": 0, "host_ms": 0.42, "kernel_ms": 2.5,
                                           "busiest": busiest},
                           "flex base": {"kernels": 30, "host_syncs": 0}}  # a file from before host times
    figures["launches_per_micro_batch"] = 6
    (tmp_path / "attention_32768.json").write_text(json.dumps(figures))
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "summary", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    row = "| 32768: fastest sparse backend, masks and densities won | flex 1/2, triton 1/2 | decides the GPU default |"
    assert row in result.stdout
    assert "| 32768: best sparse backend at density 1 / cuDNN | 1.125 | <= 1.25 |" in result.stdout
    assert "| 32768: triton selected 0.1 | failed: OutOfMemoryError: CUDA out of memory. |" in result.stdout
    assert "| 32768: host time per layer (triton base), ms | 0.420 |  |" in result.stdout
    assert "| 32768: kernels once per micro-batch (documents the layers share) | 6 |  |" in result.stdout
    assert "| 32768: kernels and host syncs per layer (flex base) | 30, 0 | <= 40, 0 |" in result.stdout
    assert "host time per layer (flex base)" not in result.stdout
    assert ("| 32768: kernel time per layer (triton base), ms, and its busiest kernels | 2.500: _dkdv_kernel 1.500 "
            "(1x), _rank_kernel 0.250 (2x), at::native::elementwise_kernel 0.125 (9x) |" in result.stdout)
    assert "kernel time per layer (flex base)" not in result.stdout


def _attention_benchmark():
    spec = importlib.util.spec_from_file_location("attention_benchmark", REPO / "benchmarks" / "attention.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_busiest_kernels_group_a_kernels_instances_under_its_name():
    benchmark = _attention_benchmark()
    kernels = [("void at::native::elementwise_kernel<128, 2, Add>(int, Add)", 0.5), ("_fwd_kernel", 2.0),
               ("void at::native::elementwise_kernel<128, 4, Mul>(int, Mul)", 0.25), ("_rank_kernel", 0.5),
               ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>(float*)", 0.125)]
    assert benchmark.busiest(kernels, top=2) == [{"name": "_fwd_kernel", "ms": 2.0, "calls": 1},
                                                 {"name": "at::native::elementwise_kernel", "ms": 0.75, "calls": 2}]
    assert benchmark.busiest(kernels)[-1] == {"name": "at::native::CatArrayBatchedCopy", "ms": 0.125, "calls": 1}


def test_the_cpu_profile_prints_the_products_rate_against_dense_sdpa(capsys):
    _attention_benchmark().main(["--tokens", "512", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16",
                                 "--block-size", "16", "--densities", "0.25", "--masks", "scattered", "--reps", "1",
                                 "--device", "cpu", "--backends", "torch", "--profile"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("matrix products:"))
    sparse, dense = (float(x) for x in re.findall(r"([\d.e-]+) GFLOP(?!/)", line))
    causal_tiles = 32 * 33 // 2 * 2  # 32 blocks, 2 query heads
    assert dense == pytest.approx(causal_tiles * 7 * 2 * 16 ** 2 * 16 / 1e9, rel=1e-3) and 0 < sparse < dense / 2


def test_an_unknown_mode_prints_the_usage():
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage: scripts/gpu_check.sh run|smoke" in result.stderr
