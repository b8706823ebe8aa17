"""Running ``main.py`` as users do, from a test: in its own process group, bounded in time, and never leaving a
rank behind (a timed-out run is killed with every process it started)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"  # fault-injection callbacks, loaded by class_path


def start_main(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python main.py *args`` in ``cwd``, with ``env`` (default: this process's) and the helpers importable."""
    env = {**(os.environ if env is None else env), "PYTHONPATH": str(HELPERS)}
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"main.py did not end within {timeout} s; the end of its stderr:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_main(
    cwd: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return finish(start_main(cwd, *args, env=env), timeout)


def build_demo_data(run_dir: Path, **overrides) -> None:
    """The corpus a demo run in ``run_dir`` with these ``data`` settings (``{"corpus.num_documents": 120}``, as on
    the command line) builds in ``prepare_data``, built beforehand: while rank 0 builds it the other rank waits
    at a barrier, which a short collective timeout would end, and a test may damage it before the run."""
    from sparsebalance_pl.datamodules import BatchingConfig, CorpusConfig, LongContextDataModule

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["data"]
    for key, value in overrides.items():
        group, name = key.split(".")
        data[group][name] = value
    corpus = CorpusConfig(**{**data["corpus"], "data_dir": str(run_dir / data["corpus"]["data_dir"])})
    LongContextDataModule(corpus=corpus, batching=BatchingConfig(**data["batching"]), seed=data["seed"]).prepare_data()


def error_of(capsys, *args: str, command: tuple[str, ...] = ("fit", "--config", "configs/demo.yaml")) -> str:
    """The error ``main.py fit --config configs/demo.yaml *args`` (or another ``command``) stops with, run in this
    process: exit code 2, one line, no traceback (run it from the repository root)."""
    from sparsebalance_pl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*command, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    return err
