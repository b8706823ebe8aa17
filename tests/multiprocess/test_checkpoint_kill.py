"""A rank killed while ``last.ckpt`` is written leaves the previous checkpoint whole and ``--ckpt_path last``
resumes from it; a damaged checkpoint stops a run that names it with one line naming an intact one, and gives
way to that one under ``--ckpt_path last``."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoint_files import checkpoint_step as _step
from checkpoint_files import flip_bytes
from main_runner import HELPERS, REPO, build_demo_data, run_main

from sparsebalance_pl import checkpoints

CHECKPOINTS = "outputs/demo/checkpoints"
DATA = {"corpus.num_documents": 200, "corpus.max_doc_tokens": 512, "batching.max_tokens": 1024}
ARGS = [
    "fit", "--config", str(REPO / "configs" / "demo.yaml"), *(f"--data.{k}={v}" for k, v in DATA.items()),
    "--model.model.overrides={num_layers: 2}", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
    "--trainer.max_steps=6",
]
EVERY_TWO_STEPS = {
    "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
    "init_args": {"dirpath": CHECKPOINTS, "save_last": True, "save_top_k": 0, "every_n_train_steps": 2},
}


def _callbacks(*extra: dict) -> str:
    return "--trainer.callbacks=" + json.dumps([EVERY_TWO_STEPS, *extra])


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """The runs' corpus, built once for the module (half a minute on two cores)."""
    built = tmp_path_factory.mktemp("demo_data")
    build_demo_data(built, **DATA)
    return built / "data"


def _start_detached(cwd: Path, log: Path, *args: str) -> subprocess.Popen:
    """``main.py`` with stderr to a file: rank 1 keeps a pipe open after rank 0 dies."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=log.open("w"),
        start_new_session=True, env={**os.environ, "PYTHONPATH": str(HELPERS)},
    )


def _kill_group(pgid: int, timeout: float = 30) -> None:
    """SIGKILL what is left of a run's process group and wait until it is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"process group {pgid} still alive")


def _logged_steps(run_dir: Path) -> list[int]:
    logs = max((run_dir / "outputs/demo/logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    with open(logs / "metrics.csv") as f:
        return sorted(int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss"))


@pytest.mark.slow
def test_rank_killed_while_writing_last_resumes_from_the_previous_one(tmp_path, demo_data):
    (tmp_path / "data").symlink_to(demo_data)
    log = tmp_path / "killed.log"
    killed = _start_detached(tmp_path, log, *ARGS,
                             _callbacks({"class_path": "fault_injection.KillWhileSaving", "init_args": {"step": 4}}))
    try:
        returncode = killed.wait(timeout=240)  # rank 0 kills itself half-way through the save of step 4
    finally:
        _kill_group(killed.pid)  # rank 1, left waiting for it
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]
    folder = tmp_path / CHECKPOINTS
    assert checkpoints.damage(checkpoints.staging_path(folder / "last.ckpt")) == "meta.pt missing or cut short"
    assert checkpoints.damage(folder / "last.ckpt") is None and _step(folder / "last.ckpt") == 2

    resumed = run_main(tmp_path, *ARGS, _callbacks(), "--ckpt_path=last", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{checkpoints.STAGING}/last.ckpt: left by a save of" in resumed.stderr
    assert _logged_steps(tmp_path) == [2, 3, 4, 5]
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and _step(folder / "last.ckpt") == 6


@pytest.mark.slow
def test_a_damaged_checkpoint_stops_a_named_resume_and_gives_way_under_last(tmp_path, demo_data):
    """4 KiB flipped in the middle of a shard of ``last.ckpt``, its size unchanged: resuming from it by name
    stops every rank with one line naming the shard and the newest intact checkpoint; ``--ckpt_path last``, which
    lets Lightning pick, resumes from that one instead and says so."""
    (tmp_path / "data").symlink_to(demo_data)
    keep_all = "--trainer.callbacks=" + json.dumps(
        [{**EVERY_TWO_STEPS, "init_args": {**EVERY_TWO_STEPS["init_args"], "save_top_k": -1}}]
    )
    trained = run_main(tmp_path, *ARGS, keep_all, "--trainer.max_steps=4", timeout=240)
    assert trained.returncode == 0, trained.stderr[-3000:]
    folder = tmp_path / CHECKPOINTS
    last, intact = folder / "last.ckpt", folder / "epoch=0-step=4.ckpt"
    shard = sorted(last.glob("*.distcp"))[-1]  # rank 1's
    flip_bytes(shard)
    problem = f"checkpoint {last} is damaged ({shard.name} differs from the checksum recorded when it was saved)"

    named = run_main(tmp_path, *ARGS, keep_all, f"--ckpt_path={last}", timeout=240)
    assert named.returncode == 2, named.stderr[-3000:]
    errors = {line for line in named.stderr.splitlines() if line.startswith("error:")}  # each rank prints it
    assert errors == {f"error: {problem}; resume from {intact} instead"} and "Traceback" not in named.stderr

    picked = run_main(tmp_path, *ARGS, keep_all, "--ckpt_path=last", timeout=240)
    assert picked.returncode == 0, picked.stderr[-3000:]
    assert f"{problem}; loading the newest intact checkpoint beside it instead: {intact}" in picked.stderr
    assert _logged_steps(tmp_path) == [4, 5]
