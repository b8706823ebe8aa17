"""scripts/gpu_check.sh, the check a session lent a GPU runs first, in its CPU smoke mode: the same benchmark
commands at toy sizes, so that the script cannot rot between GPU sessions, and without the packages the GPU
machine's image lacks (tests/helpers/device_image), so that it needs nothing carried there."""

import os
import subprocess

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
        assert f"{tokens}: kernels and host syncs per layer (torch tuned)" in table
        assert f"{tokens}: torch sparse at density 0.25" in table
    assert "model step [512]: sparse cap=0.25" in table
    # The table again from the files alone, as after a call cut short by its limit.
    (tmp_path / "cuda_tests.log").unlink()
    again = subprocess.run(["bash", "scripts/gpu_check.sh", "summary", str(tmp_path)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "| CUDA tests | not run |" in again.stdout and "model step [512]: sparse cap=0.25" in again.stdout


def test_an_unknown_mode_prints_the_usage():
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage: scripts/gpu_check.sh run|smoke" in result.stderr
