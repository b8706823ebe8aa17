"""Checkpoints survive a kill while they are written: a checkpoint is written beside its path and moved there
only once complete, so a rank killed while ``last.ckpt`` is written leaves the previous one whole and
``--ckpt_path last`` resumes from it; a damaged checkpoint stops the run with one line naming it and a complete
one instead of being loaded."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from main_runner import HELPERS, REPO, build_demo_data, run_main

from sparsebalance_pl import checkpoints
from sparsebalance_pl.errors import TrainingError
from sparsebalance_pl.strategy import FSDP2Strategy

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


def _write(folder: Path, step: int) -> Path:
    """A complete one-rank checkpoint folder, laid out as ``ModelParallelStrategy`` writes it."""
    dcp.save({"state_dict": {"w": torch.full((256,), float(step))}}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": step}, folder / checkpoints.META)
    return folder


def _step(folder: Path) -> int:
    return torch.load(folder / checkpoints.META)["global_step"]


def _age(path: Path, seconds_ago: float) -> None:
    stamp = time.time() - seconds_ago
    os.utime(path, (stamp, stamp))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_complete_checkpoint_passes_and_loads(tmp_path):
    folder = _write(tmp_path / "last.ckpt", step=4)
    assert checkpoints.damage(folder) is None and checkpoints.problem(folder) is None
    state = {"state_dict": {"w": torch.zeros(256)}}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    assert torch.equal(state["state_dict"]["w"], torch.full((256,), 4.0))


@pytest.mark.parametrize(
    "cut, reason",
    [
        (lambda f: (f / ".metadata").unlink(), "no .metadata"),
        (lambda f: (f / "meta.pt").unlink(), "meta.pt missing or cut short"),
        (lambda f: _truncate(f / "meta.pt"), "meta.pt missing or cut short"),
        (lambda f: next(f.glob("*.distcp")).unlink(), "shard __0_0.distcp missing or cut short"),
        (lambda f: _truncate(next(f.glob("*.distcp"))), "shard __0_0.distcp missing or cut short"),
    ],
)
def test_a_partial_folder_is_detected(tmp_path, cut, reason):
    folder = _write(tmp_path / "last.ckpt", step=4)
    cut(folder)
    assert checkpoints.damage(folder) == reason


def test_a_damaged_checkpoint_names_the_newest_complete_one(tmp_path):
    older, newer = _write(tmp_path / "epoch=0-step=2.ckpt", 2), _write(tmp_path / "epoch=0-step=4.ckpt", 4)
    damaged = _write(tmp_path / "last.ckpt", 6)
    _write(tmp_path / "other.ckpt.partial", 8)  # never a candidate
    _truncate(damaged / "meta.pt")
    _age(older, 30)
    _age(newer, 20)
    assert checkpoints.problem(damaged) == (
        f"checkpoint {damaged} is incomplete (meta.pt missing or cut short); resume from {newer} instead"
    )
    _truncate(newer / "meta.pt")
    assert checkpoints.newest_complete(tmp_path, other_than=damaged) == older


def test_a_damaged_checkpoint_alone_says_there_is_none(tmp_path):
    damaged = _write(tmp_path / "last.ckpt", 6)
    (damaged / ".metadata").unlink()
    assert checkpoints.problem(damaged) == (
        f"checkpoint {damaged} is incomplete (no .metadata); {tmp_path} holds no complete checkpoint"
    )


def test_a_missing_checkpoint_with_a_leftover_partial_is_reported(tmp_path):
    """SLURM resumes from the highest ``hpc_ckpt_<n>``, counting ``hpc_ckpt_3.ckpt.partial`` as 3."""
    complete = _write(tmp_path / "hpc_ckpt_2.ckpt", 2)
    requested = tmp_path / "hpc_ckpt_3.ckpt"
    assert checkpoints.problem(requested) is None  # nothing left behind: Lightning reports it as before
    _write(checkpoints.staging_path(requested), 3).joinpath(".metadata").unlink()
    assert checkpoints.problem(requested) == (
        f"checkpoint {requested} is missing: a save of it was cut short ({requested}.partial left behind); "
        f"resume from {complete} instead"
    )


def test_install_replaces_the_previous_checkpoint_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "last.ckpt"
    for step in (2, 4):
        checkpoints.install(_write(checkpoints.staging_path(path), step), path)
        assert _step(path) == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_kill_between_the_renames_leaves_the_previous_checkpoint_for_last(tmp_path, monkeypatch):
    path = _write(tmp_path / "last.ckpt", 2)
    staging = _write(checkpoints.staging_path(path), 4)
    renames, rename = [], os.rename

    def rename_then_die(src, dst):
        if renames:
            raise KeyboardInterrupt("killed")
        renames.append(dst)
        rename(src, dst)

    monkeypatch.setattr(checkpoints.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.install(staging, path)
    monkeypatch.undo()
    aside = tmp_path / "last.previous.ckpt"
    assert not path.exists() and _step(aside) == 2
    found = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer=None)
    assert found == {str(aside)}  # what ``--ckpt_path last`` loads
    assert f"resume from {aside} instead" in checkpoints.problem(path)
    checkpoints.remove(staging)  # the resumed run's next save, as FSDP2Strategy makes it
    checkpoints.install(_write(staging, 6), path)
    assert _step(path) == 6 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_remove_leaves_nothing(tmp_path):
    path = _write(tmp_path / "epoch=0-step=2.ckpt", 2)
    checkpoints.remove(path)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_of_other_files_is_not_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="not a checkpoint"):
        checkpoints.check_replaceable(tmp_path)
    checkpoints.check_replaceable(_write(tmp_path / "last.ckpt", 2))


@pytest.mark.parametrize("sharded", [True, False])
def test_the_strategy_saves_over_the_previous_checkpoint_atomically(tmp_path, sharded):
    strategy = FSDP2Strategy(save_distributed_checkpoint=sharded)
    path = tmp_path / "last.ckpt"
    stale = _write(checkpoints.staging_path(path), 99)  # a save cut short earlier
    _truncate(stale / "meta.pt")
    for step in (2, 4):
        strategy.save_checkpoint({"state_dict": {"w": torch.full((8,), float(step))}, "global_step": step}, path)
    saved = torch.load(path / "meta.pt" if sharded else path)
    assert saved["global_step"] == 4 and path.is_dir() == sharded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_strategy_refuses_a_damaged_checkpoint(tmp_path):
    damaged = _write(tmp_path / "last.ckpt", 2)
    _truncate(damaged / "meta.pt")
    with pytest.raises(TrainingError, match=f"checkpoint {damaged} is incomplete"):
        FSDP2Strategy().load_checkpoint(damaged)


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
    assert checkpoints.damage(folder / "last.ckpt.partial") == "meta.pt missing or cut short"
    assert checkpoints.damage(folder / "last.ckpt") is None and _step(folder / "last.ckpt") == 2

    resumed = run_main(tmp_path, *ARGS, _callbacks(), "--ckpt_path=last", timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "last.ckpt.partial: left by a save of" in resumed.stderr
    assert _logged_steps(tmp_path) == [2, 3, 4, 5]
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"] and _step(folder / "last.ckpt") == 6


@pytest.mark.slow
def test_a_damaged_last_checkpoint_stops_the_run_naming_a_complete_one(tmp_path, demo_data):
    (tmp_path / "data").symlink_to(demo_data)
    folder = tmp_path / CHECKPOINTS
    complete = _write(folder / "epoch=0-step=2.ckpt", 2)
    damaged = _write(folder / "last.ckpt", 4)  # as an in-place save killed before its .metadata leaves it
    (damaged / ".metadata").unlink()
    result = run_main(tmp_path, *ARGS, _callbacks(), "--ckpt_path=last", timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}  # each rank prints it
    expected = f"error: checkpoint {damaged} is incomplete (no .metadata); resume from {complete} instead"
    assert errors == {expected} and "Traceback" not in result.stderr
