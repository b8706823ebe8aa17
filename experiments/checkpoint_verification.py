"""What verifying a checkpoint costs (``sparsebalance_pl.checkpoints.damage``: completeness and every file's
xxh3-64 digest), set against writing and reading the same state.

    python experiments/checkpoint_verification.py outputs/demo/checkpoints/last.ckpt
    python experiments/checkpoint_verification.py --qwen05b --dir /tmp

The first measures an existing checkpoint folder. The second writes a Qwen2.5-0.5B-sized state (fp32 weights and
Adam's two moments, about 6 GB) with ``FSDP2Strategy`` into a temporary folder under ``--dir``, measures it and
deletes it; check the free space first.

Reported, as medians of ``--repeats`` runs: verification with the files in the page cache (as right after a save,
when the save computes the same digests) and read from disk (the files evicted from the cache first); DCP loading
every tensor of the state from disk, alone and after verification (which leaves the files in the cache when
memory allows); for the written state also the whole save. One process: under FSDP2 every rank reads its share
of the files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from sparsebalance_pl import checkpoints
from sparsebalance_pl.strategy import FSDP2Strategy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="an existing checkpoint folder to measure")
    parser.add_argument("--qwen05b", action="store_true", help="write a Qwen2.5-0.5B-sized state and measure it")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where --qwen05b writes (and deletes) it")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if (args.checkpoint is None) == (not args.qwen05b):
        parser.error("give a checkpoint folder or --qwen05b")
    return args


def qwen05b_state() -> dict:
    """Lightning's checkpoint of Qwen2.5-0.5B trained with Adam: fp32 weights and two moments per weight."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen2ForCausalLM(config).named_parameters()}
    weights = {name: torch.randn(shape) for name, shape in shapes.items()}
    moments = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(shape) * 1e-3, "exp_avg_sq": torch.rand(shape) * 1e-6}
        for i, shape in enumerate(shapes.values())
    }
    groups = [{"lr": 1e-4, "params": list(range(len(shapes)))}]
    return {"state_dict": weights, "optimizer_states": [{"state": moments, "param_groups": groups}], "global_step": 100}


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache, so that the next read comes from the disk."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_tensors(folder: Path) -> None:
    """DCP's load of every tensor the checkpoint holds, into freshly allocated tensors."""
    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in stored.items() if isinstance(md, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)


def timed(fn, repeats: int, before=None) -> list[float]:
    seconds = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def report(what: str, seconds: list[float], size: int) -> None:
    median = statistics.median(seconds)
    print(f"{what:<38} {median:8.3f} s  ({min(seconds):.3f}-{max(seconds):.3f}), {size / median / 1e9:5.2f} GB/s")


def measure(folder: Path, repeats: int) -> None:
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1e9:.3f} GB in {len(list(folder.iterdir()))} files")
    damage = checkpoints.damage(folder)
    if damage is not None:
        sys.exit(f"{folder} is damaged ({damage}): nothing to measure")
    report("verify, files in the page cache", timed(lambda: checkpoints.damage(folder), repeats), size)
    cold = timed(lambda: checkpoints.damage(folder), repeats, lambda: evict(folder))
    report("verify, files read from disk", cold, size)
    load = timed(lambda: load_tensors(folder), repeats, lambda: evict(folder))
    report("DCP load of every tensor, from disk", load, size)
    both = timed(lambda: (checkpoints.damage(folder), load_tensors(folder)), repeats, lambda: evict(folder))
    report("verify, then load, from disk", both, size)
    print(f"verification adds {statistics.median(both) / statistics.median(load) - 1:+.0%} to loading from disk")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.checkpoint:
        measure(Path(args.checkpoint), args.repeats)
        return
    work = Path(tempfile.mkdtemp(prefix="checkpoint_verification_", dir=args.dir))
    try:
        state = qwen05b_state()
        path = work / "last.ckpt"
        start = time.perf_counter()
        FSDP2Strategy().save_checkpoint(state, path)
        save = time.perf_counter() - start
        del state
        size = sum(p.stat().st_size for p in path.iterdir())
        report("save with FSDP2Strategy (digests included)", [save], size)
        measure(path, args.repeats)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
