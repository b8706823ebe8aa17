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

Before a folder is put in place, and once every rank has written its part, the ranks record the digest of
each of its files in ``CHECKSUMS`` (xxh3-64), the last file written: DCP's shards carry no checksum, and
``torch.load`` reads flipped bytes without complaint. A checkpoint file (sharded saving switched off) needs no
record: it is a zip archive whose entries carry their own CRC-32.

Loading checks that a checkpoint is intact (``damage``): a folder's ``.metadata`` and ``meta.pt`` present,
``meta.pt`` a complete zip archive (``torch.save`` writes the archive's index last), every shard file the index
names at least as long as the bytes it refers to, and every file as its recorded digest says; a file's entries
as their CRC-32s say. A folder saved before digests were recorded is checked for completeness only
(``unverified``). A damaged checkpoint, or a missing one with a cut-short save's leftovers, is reported in
one line naming it, what is wrong with it and the newest intact checkpoint of its folder (``refusal``).
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path

import xxhash
from torch.distributed.checkpoint import FileSystemReader

INDEX = ".metadata"  # DCP's index of the shards, written by rank 0 after every rank's shards
META = "meta.pt"  # Lightning's non-tensor state, written by rank 0 after DCP's save returned
CHECKSUMS = "checksums.json"  # the digest of every other file of the folder, written last
_CHECKPOINT_FILES = (INDEX, INDEX + ".tmp", META, CHECKSUMS)
_SHARD_SUFFIX = ".distcp"
_DIGEST = "xxh3_64"
_READ_BYTES = 16 << 20
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


def file_digests(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """The xxh3-64 digest of each named file of ``folder`` that exists, read in pieces of bounded size."""
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    digests = {}
    for name in names:
        if not (folder / name).is_file():
            continue
        digest = xxhash.xxh3_64()
        with open(folder / name, "rb", buffering=0) as f:
            while size := f.readinto(buffer):
                digest.update(view[:size])
        digests[name] = digest.hexdigest()
    return digests


def checksummed_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder that its checksums cover: all but the record itself."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS)


def write_checksums(folder: Path, digests: dict[str, str]) -> None:
    (folder / CHECKSUMS).write_text(json.dumps({"algorithm": _DIGEST, "files": digests}, indent=1, sort_keys=True))


def unverified(path: Path) -> str | None:
    """The warning that the checkpoint folder at ``path`` was saved before digests were recorded, so that only
    its completeness could be checked; None for any other checkpoint."""
    if path.is_dir() and not (path / CHECKSUMS).is_file():
        return (f"checkpoint {path} was saved without checksums: its files are complete, but their content "
                "cannot be verified")
    return None


def recorded_checksums(folder: Path) -> dict[str, str]:
    """The digests recorded when the folder was saved, by file name (none before they were recorded);
    ValueError when the record cannot be read."""
    if not (folder / CHECKSUMS).is_file():
        return {}
    try:
        record = json.loads((folder / CHECKSUMS).read_text())
        files = dict(record["files"])
        if record["algorithm"] != _DIGEST or not all(isinstance(d, str) for d in files.values()):
            raise ValueError(record["algorithm"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{CHECKSUMS} unreadable") from err
    return files


def damage(path: Path, digests: dict[str, str] | None = None) -> str | None:
    """What makes the checkpoint at ``path`` unfit to load (a part missing or cut short, a file that differs
    from what was saved), or None when it is intact. ``digests``: those of its recorded files, when the caller
    has computed them already (the strategy has every rank read its share)."""
    if path.is_file():
        return _archive_damage(path)
    try:
        recorded = recorded_checksums(path)
    except ValueError as err:
        return str(err)
    actual = file_digests(path, recorded) if digests is None else digests
    for name, digest in sorted(recorded.items()):
        if name not in actual:
            return f"{name} missing"
        if actual[name] != digest:
            return f"{name} differs from the checksum recorded when it was saved"
    return _missing_part(path)


def problem(path: Path, digests: dict[str, str] | None = None) -> str | None:
    """Why ``path`` must not be loaded, in words naming it; None to load it as Lightning would (a missing path
    without leftovers fails there, as before). ``digests`` as for ``damage``."""
    if os.path.lexists(path):
        reason = damage(path, digests)
        return None if reason is None else f"checkpoint {path} is damaged ({reason})"
    left = leftovers(path)
    if not left:
        return None
    names = ", ".join(str(p) for p in left)
    return f"checkpoint {path} is missing: a save of it was cut short ({names} left behind)"


def refusal(path: Path, digests: dict[str, str] | None = None) -> str | None:
    """``problem`` in one line that also names the newest intact checkpoint beside ``path`` to use instead."""
    reason = problem(path, digests)
    return None if reason is None else f"{reason}; {instead(path, newest_intact(path.parent, other_than=path))}"


def instead(path: Path, intact: Path | None) -> str:
    """What to do when ``path`` cannot be loaded and ``intact`` is the newest intact checkpoint beside it."""
    return f"resume from {intact} instead" if intact else f"{path.parent} holds no intact checkpoint"


def newest_intact(folder: Path, other_than: Path) -> Path | None:
    """The most recently written intact ``*.ckpt`` of ``folder`` apart from ``other_than``, verified newest
    first so that only as many are read as it takes."""
    if not folder.is_dir():
        return None
    candidates = [p for p in folder.iterdir() if p.suffix == ".ckpt" and p != other_than]
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if damage(candidate) is None:
            return candidate
    return None


def _missing_part(folder: Path) -> str | None:
    """What the checkpoint folder lacks, or None when every file it needs is there in full."""
    if not (folder / INDEX).is_file():
        return f"no {INDEX}"
    if not (folder / META).is_file() or not zipfile.is_zipfile(folder / META):
        return f"{META} missing or cut short"
    try:
        stored = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:  # whatever unpickling damaged bytes raises
        return f"{INDEX} unreadable"
    needed: dict[str, int] = {}
    for info in stored.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file() or shard.stat().st_size < size:
            return f"shard {name} missing or cut short"
    return None


def _archive_damage(path: Path) -> str | None:
    """What is wrong with a checkpoint file, a zip archive as ``torch.save`` writes it, by its CRC-32s."""
    if not zipfile.is_zipfile(path):
        return "not a complete zip archive"
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    return None if bad is None else f"{bad} differs from the CRC-32 recorded when it was saved"


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
