"""Checkpoints survive a kill while they are written: a checkpoint is written beside its path and moved there
only once complete; a damaged one is detected and the newest complete one named (the runs that kill a rank
while saving are in tests/multiprocess/test_checkpoint_kill.py)."""

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from checkpoint_files import checkpoint_step as _step
from checkpoint_files import write_checkpoint as _write

from sparsebalance_pl import checkpoints
from sparsebalance_pl.errors import TrainingError
from sparsebalance_pl.strategy import FSDP2Strategy

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
    _write(checkpoints.staging_path(tmp_path / "other.ckpt"), 8)  # never a candidate
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
    complete = _write(tmp_path / "last.ckpt", 2)
    requested = tmp_path / "epoch=0-step=3.ckpt"
    assert checkpoints.problem(requested) is None  # nothing left behind: Lightning reports it as before
    staged = _write(checkpoints.staging_path(requested), 3)
    (staged / ".metadata").unlink()
    assert checkpoints.problem(requested) == (
        f"checkpoint {requested} is missing: a save of it was cut short ({staged} left behind); "
        f"resume from {complete} instead"
    )


def test_slurm_resumes_from_the_newest_complete_hpc_checkpoint_after_a_save_cut_short(tmp_path):
    """Lightning resumes a requeued job from the highest ``hpc_ckpt_<n>`` named in the folder, and numbers the
    next save one above it: a cut-short save of ``hpc_ckpt_3`` must count for neither."""
    complete = _write(tmp_path / "hpc_ckpt_2.ckpt", 2)
    cut_short = tmp_path / "hpc_ckpt_3.ckpt"
    _write(checkpoints.staging_path(cut_short), 3).joinpath(".metadata").unlink()
    connector = _CheckpointConnector(SimpleNamespace(default_root_dir=str(tmp_path)))
    assert connector._hpc_resume_path == str(complete)
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(cut_short)  # whose save deletes the leftover
    FSDP2Strategy().save_checkpoint({"state_dict": {"w": torch.full((8,), 4.0)}, "global_step": 4}, cut_short)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hpc_ckpt_2.ckpt", "hpc_ckpt_3.ckpt"]


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
    staging = checkpoints.clear_staging(path)  # the resumed run's next save, as FSDP2Strategy makes it
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


@pytest.mark.parametrize("sharded", [True, False])
def test_the_strategy_saves_into_a_folder_that_does_not_exist_yet(tmp_path, sharded):
    path = tmp_path / "checkpoints" / "last.ckpt"  # ModelCheckpoint's folder, before the first save
    FSDP2Strategy(save_distributed_checkpoint=sharded).save_checkpoint({"state_dict": {}, "global_step": 2}, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_the_strategy_refuses_a_damaged_checkpoint(tmp_path):
    damaged = _write(tmp_path / "last.ckpt", 2)
    _truncate(damaged / "meta.pt")
    with pytest.raises(TrainingError, match=f"checkpoint {damaged} is incomplete"):
        FSDP2Strategy().load_checkpoint(damaged)


