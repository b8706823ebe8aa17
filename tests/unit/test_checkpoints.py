"""Checkpoints survive a kill while they are written and are verified before they load: a checkpoint is
written beside its path and moved there only once complete, with its files' digests; a damaged one is detected
and the newest intact one named, or loaded in its place when Lightning picked the damaged one (the runs that
kill a rank while saving or resume from a damaged checkpoint are in tests/multiprocess/test_checkpoint_kill.py)."""

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from checkpoint_files import checkpoint_step as _step
from checkpoint_files import flip_bytes
from checkpoint_files import write_checkpoint as _write
from lightning.pytorch.strategies import ModelParallelStrategy

from sparsebalance_pl import checkpoints
from sparsebalance_pl.errors import TrainingError
from sparsebalance_pl.slurm import next_hpc_checkpoint
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
    """What a save cut short leaves has no checksums yet (they are written last), as older checkpoints."""
    folder = _write(tmp_path / "last.ckpt", step=4, checksums=False)
    cut(folder)
    assert checkpoints.damage(folder) == reason


def test_a_damaged_checkpoint_names_the_newest_intact_one(tmp_path):
    older, newer = _write(tmp_path / "epoch=0-step=2.ckpt", 2), _write(tmp_path / "epoch=0-step=4.ckpt", 4)
    damaged = _write(tmp_path / "last.ckpt", 6)
    _write(checkpoints.staging_path(tmp_path / "other.ckpt"), 8)  # never a candidate
    _truncate(damaged / "meta.pt")
    _age(older, 30)
    _age(newer, 20)
    assert checkpoints.refusal(damaged) == (
        f"checkpoint {damaged} is damaged (meta.pt differs from the checksum recorded when it was saved); "
        f"resume from {newer} instead"
    )
    flip_bytes(next(newer.glob("*.distcp")), count=8)
    assert checkpoints.newest_intact(tmp_path, other_than=damaged) == older


def test_a_damaged_checkpoint_alone_says_there_is_none(tmp_path):
    damaged = _write(tmp_path / "last.ckpt", 6)
    (damaged / ".metadata").unlink()
    assert checkpoints.refusal(damaged) == (
        f"checkpoint {damaged} is damaged (.metadata missing); {tmp_path} holds no intact checkpoint"
    )


def test_a_missing_checkpoint_with_a_leftover_partial_is_reported(tmp_path):
    complete = _write(tmp_path / "last.ckpt", 2)
    requested = tmp_path / "epoch=0-step=3.ckpt"
    assert checkpoints.refusal(requested) is None  # nothing left behind: Lightning reports it as before
    staged = _write(checkpoints.staging_path(requested), 3)
    (staged / ".metadata").unlink()
    assert checkpoints.refusal(requested) == (
        f"checkpoint {requested} is missing: a save of it was cut short ({staged} left behind); "
        f"resume from {complete} instead"
    )


def test_slurm_resumes_from_the_newest_complete_hpc_checkpoint_after_a_save_cut_short(tmp_path):
    """Lightning resumes a requeued job from the highest ``hpc_ckpt_<n>`` named in the folder, and the next save
    is numbered one above it: a cut-short save of ``hpc_ckpt_3`` must count for neither."""
    assert next_hpc_checkpoint(tmp_path / "new") == str(tmp_path / "new" / "hpc_ckpt_1.ckpt")
    _write(tmp_path / "hpc_ckpt_2.ckpt", 2)
    cut_short = tmp_path / "hpc_ckpt_3.ckpt"
    _write(checkpoints.staging_path(cut_short), 3).joinpath(".metadata").unlink()
    assert next_hpc_checkpoint(tmp_path) == str(cut_short)  # whose save deletes the leftover
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
    assert f"resume from {aside} instead" in checkpoints.refusal(path)
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
    with pytest.raises(TrainingError, match=f"checkpoint {damaged} is damaged"):
        FSDP2Strategy().load_checkpoint(damaged)




def test_the_strategy_records_the_digest_of_every_file_it_saves(tmp_path):
    path = _write(tmp_path / "last.ckpt", 2)
    recorded = checkpoints.recorded_checksums(path)
    assert sorted(recorded) == sorted(p.name for p in path.iterdir() if p.name != checkpoints.CHECKSUMS)
    assert recorded == checkpoints.file_digests(path, recorded)
    assert checkpoints.damage(path) is None


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "meta.pt"])
def test_flipped_bytes_are_named_by_their_file(tmp_path, name):
    path = _write(tmp_path / "last.ckpt", 2)
    size = (path / name).stat().st_size
    flip_bytes(path / name, count=min(4096, size // 4))
    assert (path / name).stat().st_size == size
    assert checkpoints.damage(path) == f"{name} differs from the checksum recorded when it was saved"


def test_an_unreadable_checksum_record_is_damage(tmp_path):
    path = _write(tmp_path / "last.ckpt", 2)
    (path / checkpoints.CHECKSUMS).write_text('{"algorithm": "xxh3_64", "files": ')
    assert checkpoints.damage(path) == f"{checkpoints.CHECKSUMS} unreadable"


def test_a_checkpoint_file_is_verified_by_its_crc32s(tmp_path):
    """A checkpoint saved as one file is a zip archive that records a CRC-32 per entry; torch.load itself
    reads flipped bytes without complaint."""
    path = tmp_path / "last.ckpt"
    FSDP2Strategy(save_distributed_checkpoint=False).save_checkpoint(
        {"state_dict": {"w": torch.arange(4096.0)}, "global_step": 2}, path
    )
    assert path.is_file() and checkpoints.damage(path) is None
    flip_bytes(path, count=64)
    assert torch.load(path)["global_step"] == 2  # what would have been loaded
    assert checkpoints.damage(path) == "archive/data/0 differs from the CRC-32 recorded when it was saved"
    _truncate(path)
    assert checkpoints.damage(path) == "not a complete zip archive"


@pytest.fixture
def loaded_paths(monkeypatch) -> list[Path]:
    """The paths that ``FSDP2Strategy`` hands to Lightning's loader, which needs a sharded model to load into."""
    paths = []
    monkeypatch.setattr(ModelParallelStrategy, "load_checkpoint",
                        lambda self, path, weights_only=None: paths.append(path))
    return paths


def test_a_checkpoint_saved_without_checksums_loads_with_one_warning(tmp_path, loaded_paths):
    path = _write(tmp_path / "last.ckpt", 2, checksums=False)
    with pytest.warns(UserWarning) as warned:
        FSDP2Strategy().load_checkpoint(path)
    assert [str(w.message) for w in warned if "checksums" in str(w.message)] == [
        f"checkpoint {path} was saved without checksums: its files are complete, but their content cannot be "
        "verified"
    ]
    assert loaded_paths == [path]


@pytest.mark.parametrize("picked_by_lightning", [True, False])
def test_a_damaged_newest_hpc_checkpoint(tmp_path, loaded_paths, picked_by_lightning):
    """SLURM's requeued job resumes from the newest ``hpc_ckpt_<n>`` without naming it, so, damaged, it gives
    way to the newest intact one; a checkpoint the user named is refused instead."""
    older, newest = _write(tmp_path / "hpc_ckpt_1.ckpt", 1), _write(tmp_path / "hpc_ckpt_2.ckpt", 2)
    _age(older, 30)
    flip_bytes(newest / "__0_0.distcp")
    problem = f"checkpoint {newest} is damaged (__0_0.distcp differs from the checksum recorded when it was saved)"
    strategy = FSDP2Strategy()
    strategy.fall_back_to_intact = picked_by_lightning
    if picked_by_lightning:
        with pytest.warns(UserWarning, match="loading the newest intact") as warned:
            strategy.load_checkpoint(newest)
        assert str(warned[0].message) == f"{problem}; loading the newest intact checkpoint beside it instead: {older}"
        assert loaded_paths == [older]
    else:
        with pytest.raises(TrainingError) as refused:
            strategy.load_checkpoint(newest)
        assert str(refused.value) == f"{problem}; resume from {older} instead"
        assert loaded_paths == []


def test_a_damaged_checkpoint_with_no_intact_one_beside_it_stops_when_lightning_picked_it(tmp_path, loaded_paths):
    newest = _write(tmp_path / "hpc_ckpt_1.ckpt", 1)
    flip_bytes(newest / "meta.pt", count=16)
    strategy = FSDP2Strategy()
    strategy.fall_back_to_intact = True
    with pytest.raises(TrainingError, match=f"{tmp_path} holds no intact checkpoint"):
        strategy.load_checkpoint(newest)
    assert loaded_paths == []
