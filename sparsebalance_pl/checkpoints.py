"""Checkpoints that a kill during the save cannot leave half-written under their name.

Under FSDP2 a checkpoint is a folder that every rank writes into: torch distributed checkpoint (DCP) writes
each rank's shard files, then rank 0 writes the index ``.metadata`` once all shards are written, then
Lightning's rank 0 writes ``meta.pt`` (the non-tensor state). Lightning writes that folder in place, over
the previous checkpoint of the same name (``last.ckpt``): a rank killed during the save leaves new shards
beside the previous save's ``.metadata`` and ``meta.pt``, which loads a mixture or fails far from its cause.

``FSDP2Strategy`` therefore writes every checkpoint (``last.ckpt``, top-k, SLURM's ``hpc_ckpt_<n>.ckpt``) to
``.partial/<name>``, a hidden folder beside it, and, after a barrier that every rank reaches only once its part
is written, rank 0 puts it in place (``install``): a file by one ``os.replace``; a folder by renames, ``<name>``
to ``<stem>.previous<suffix>`` and ``.partial/<name>`` to ``<name>``, after which the previous one is removed (a
removal moves it into ``.partial`` first, so a removal cut short never leaves a damaged folder under a
checkpoint's name either). At every instant a complete checkpoint is at ``<name>`` or, between the two
renames, at ``<stem>.previous<suffix>``: Lightning's ``ckpt_path="last"`` takes any ``last*.ckpt`` of the
folder, so it finds that one too. Nothing in ``.partial`` is ever loaded; the next save of its name deletes it.
Lightning never sees it either: under SLURM it resumes from the highest ``hpc_ckpt_<n>`` *named in the folder*,
so a cut-short save named beside the complete ones would send a requeued job to a checkpoint that is not there.

Loading checks that a folder is whole (``damage``): ``.metadata`` and ``meta.pt`` present, ``meta.pt`` a
complete zip archive (``torch.save`` writes the archive's index last), and every shard file the index names
at least as long as the bytes it refers to. That also holds for checkpoints written before this module. A
damaged checkpoint, or a missing one with a cut-short save's leftovers, is reported in one line naming it and
the newest complete checkpoint of its folder (``problem``).
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

INDEX = ".metadata"  # DCP's index of the shards, written by rank 0 after every rank's shards
META = "meta.pt"  # Lightning's non-tensor state, written by rank 0 after DCP's save returned
_CHECKPOINT_FILES = (INDEX, INDEX + ".tmp", META)
_SHARD_SUFFIX = ".distcp"
STAGING = ".partial"  # the folder beside the checkpoints where they are written and deleted


def staging_path(path: Path) -> Path:
    """Where the checkpoint for ``path`` is written, or moved to be deleted: never taken for a checkpoint."""
    return path.parent / STAGING / path.name


def clear_staging(path: Path) -> Path:
    """The empty staging path of ``path``, after deleting what a save of it that was cut short left there."""
    staging = staging_path(path)
    _delete(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def aside_path(path: Path) -> Path:
    """Where the previous checkpoint waits while the new one is renamed to ``path``; it ends in ``path``'s
    suffix so that Lightning's ``ckpt_path="last"`` finds it should the run be killed in between."""
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def check_replaceable(path: Path) -> None:
    """Refuse to replace a folder that holds anything but checkpoint files: a save would delete it."""
    if path.is_dir() and not all(_is_checkpoint_file(entry.name) for entry in path.iterdir()):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory that is not a checkpoint: {path}")


def install(staging: Path, path: Path) -> None:
    """Move the complete checkpoint ``staging`` to ``path``, replacing (and then deleting) the one there."""
    aside = aside_path(path)
    if not os.path.lexists(path):
        os.rename(staging, path)
    elif path.is_file() and staging.is_file():
        os.replace(staging, path)
    else:  # a folder cannot be renamed over another one
        remove(aside)  # left by a run killed after the rename below; ``path`` is complete, so not needed
        os.rename(path, aside)
        os.rename(staging, path)
    remove(aside)  # which also drops the staging folder once empty


def remove(path: Path) -> None:
    """Delete a checkpoint; moved into the staging folder first, so a removal cut short leaves no damaged one
    under its name."""
    trash = staging_path(path)
    _delete(trash)  # left by a removal cut short
    if os.path.lexists(path):
        trash.parent.mkdir(exist_ok=True)
        os.rename(path, trash)
        _delete(trash)
    _drop_if_empty(trash.parent)


def leftovers(path: Path) -> list[Path]:
    """What a save of ``path`` that was cut short left beside it."""
    return [p for p in (staging_path(path), aside_path(path)) if os.path.lexists(p)]


def damage(folder: Path) -> str | None:
    """What the checkpoint folder lacks, or None when every file it needs is there in full."""
    if not (folder / INDEX).is_file():
        return f"no {INDEX}"
    if not (folder / META).is_file() or not zipfile.is_zipfile(folder / META):
        return f"{META} missing or cut short"
    needed: dict[str, int] = {}
    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file() or shard.stat().st_size < size:
            return f"shard {name} missing or cut short"
    return None


def problem(path: Path) -> str | None:
    """Why ``path`` must not be loaded, in one line naming a complete checkpoint to use instead; None to load
    it as Lightning would (a missing path without leftovers fails there, as before)."""
    if path.is_dir():
        reason = damage(path)
        return None if reason is None else f"checkpoint {path} is incomplete ({reason}); {_instead(path)}"
    left = leftovers(path)
    if os.path.lexists(path) or not left:
        return None
    names = ", ".join(str(p) for p in left)
    return f"checkpoint {path} is missing: a save of it was cut short ({names} left behind); {_instead(path)}"


def newest_complete(folder: Path, other_than: Path) -> Path | None:
    """The most recently written complete ``*.ckpt`` of ``folder`` apart from ``other_than``."""
    if not folder.is_dir():
        return None
    complete = [
        p for p in folder.iterdir()
        if p.suffix == ".ckpt" and p != other_than and (p.is_file() or (p.is_dir() and damage(p) is None))
    ]
    return max(complete, key=lambda p: p.stat().st_mtime, default=None)


def _instead(path: Path) -> str:
    newest = newest_complete(path.parent, other_than=path)
    return f"resume from {newest} instead" if newest else f"{path.parent} holds no complete checkpoint"


def _is_checkpoint_file(name: str) -> bool:
    return name in _CHECKPOINT_FILES or name.endswith(_SHARD_SUFFIX)


def _drop_if_empty(folder: Path) -> None:
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
