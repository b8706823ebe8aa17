"""Context parallelism on real masks: kept-tile balance of ring layouts, and the 2-rank sparse ring for real.

Masks come from the real pretrained model (SmolLM2-135M as a Hugging Face Qwen2, ``data/smollm2-135m``) on
real text: files of the installed Python packages and ``/usr/share/common-licenses``, tokenized with the
model's tokenizer and packed into streams. The model runs forward once per stream with an attention function
that records each layer's q and k after rotary, selects blocks with ``rank_blocks`` / ``select`` (tau 0.9,
block 64, stride 16 by default, the same as ``select_blocks``) and attends exactly, so the next layer sees the
model's real hidden states. Streams (``--streams``):

- ``doc8k``: one real document of 8,192 tokens (the model's context), the first 8K tokens of a long file;
- ``long32k``: four such 8K documents of four files packed (the case context parallelism is for);
- ``packed8k`` / ``packed16k`` / ``packed32k``: documents of real lengths (files cut at 8,192 tokens as
  training does), packed in a seeded order, the last one cut to fill the stream.

With B = 64, an 8K stream has 128 blocks: 4 blocks per rank at W = 32, where a ring step holds 4 x 4 tiles per
rank and head, so per-step counts are coarse; the 32K streams have 16 blocks per rank there.

Part 1, computed from the masks, for W = 2 .. 32 and three layouts (``owners``):

- contiguous: rank r holds the r-th of W equal chunks of blocks;
- zigzag: rank r holds chunks r and 2W-1-r of 2W equal chunks;
- striped: rank r holds blocks r, r + W, ... (``context_shard``, what ``sparse_ring_attention`` runs).

Every layout runs the same ring: at step t rank r attends its queries to the K/V of source (r - t) mod W.
Reported per layer, as the median and worst layer: the per-rank total imbalance (max / mean over ranks of the
kept tiles of all steps and heads), the per-step imbalance (mean over steps of max / mean at that step) and
the synchronous ring's cost over the ideal (sum over steps of the busiest rank's tiles, over all tiles / W),
which is what a ring that waits for every step pays. Dense causal masks (every candidate tile) for reference.

Part 2, run for real on W = 2 gloo ranks (one thread each) with the real q, k, v of ``--ring-layers`` of the
``--ring-stream`` stream: ``sparse_ring_attention`` with the real mask, with masks of the same ranking capped
at ``--densities`` (``select(tau=1, max_density=d)``) and dense (``block_mask=None``), forward + backward.
The tiles each ring step computes are counted from the ring's own layouts and checked against Part 1. Timed
alternately, repetition by repetition, medians of the slowest rank. Whole-document placement against the ring:
each rank attends a whole document alone (``block_sparse_attention``, both ranks at once, so two documents in
the time of one) against both documents through the 2-rank ring one after the other.

    python experiments/context_parallel.py --out outputs/context_parallel
    python experiments/context_parallel.py --quick --out /tmp/cp   # 2 layers, doc8k only, 2 reps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


LAYOUTS = ("contiguous", "zigzag", "striped")
# What sparse_ring_attention runs: striped, with the first block (the sink) of each document longer than W blocks
# copied to every rank once per layer (``kernels.ring.sink_blocks``), so its tiles are computed by each rank in a
# sink step of its own, counted here with the rank's own ring step, instead of at the step visiting the sink's
# holder. "striped" is the ring without the sink step (as it ran before 2026-11-25, third pass).
SINKS_LOCAL = "striped, sinks local"
STREAMS = {  # name: (tokens, kind)
    "doc8k": (8192, "long"),
    "long32k": (32768, "long"),
    "packed8k": (8192, "packed"),
    "packed16k": (16384, "packed"),
    "packed32k": (32768, "packed"),
}
DOC_TOKENS = 8192  # the model's context; longer files are cut into documents of at most this many tokens


# ---------------------------------------------------------------------------------------------------------------
# Part 1: layouts and their kept-tile balance (pure functions of a mask)


def owners(num_blocks: int, world_size: int, layout: str) -> torch.Tensor:
    """int64 [num_blocks]: the rank holding each block in ``layout`` over ``world_size`` ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    chunks = {"contiguous": world_size, "zigzag": 2 * world_size, "striped": world_size}[layout]
    if world_size < 1 or num_blocks % chunks:
        raise ValueError(f"{num_blocks} blocks do not split into the {chunks} equal parts of the {layout} layout "
                         f"over {world_size} ranks")
    block = torch.arange(num_blocks)
    if layout == "striped":
        return block % world_size
    chunk = block // (num_blocks // chunks)
    if layout == "contiguous":
        return chunk
    return torch.where(chunk < world_size, chunk, 2 * world_size - 1 - chunk)


def tile_matrix(kept: torch.Tensor, owner: torch.Tensor, world_size: int,
                shared_keys: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [W, W]: kept tiles (all heads) whose query block rank r holds and whose key block rank s holds.

    kept: bool [H, nB, nB] (or [nB, nB]), already restricted to candidate tiles (causal, same document).
    shared_keys: bool [nB], key blocks every rank holds a copy of (their tiles count at the rank's own step)."""
    per_tile = kept.reshape(-1, *kept.shape[-2:]).sum(0)  # [nB, nB] heads that keep each tile
    key_owner = owner[None, :].expand(owner.numel(), -1)
    if shared_keys is not None:
        key_owner = torch.where(shared_keys[None, :], owner[:, None], key_owner)
    pair = owner[:, None] * world_size + key_owner
    return torch.bincount(pair.flatten(), weights=per_tile.flatten().double(),
                          minlength=world_size * world_size).round().long().view(world_size, world_size)


def sink_blocks(cu_seqlens: torch.Tensor, num_blocks: int, block_size: int, world_size: int) -> torch.Tensor:
    """bool [nB]: the sink blocks every rank of a ring of ``world_size`` holds a copy of (none: all False)."""
    from sparsebalance_pl.kernels.ring import sink_blocks as ring_sinks

    sinks = ring_sinks(cu_seqlens, num_blocks, block_size, world_size)
    return torch.zeros(num_blocks, dtype=torch.bool) if sinks is None else sinks


def ring_steps(matrix: torch.Tensor) -> torch.Tensor:
    """int64 [steps, ranks]: the tiles rank r computes at ring step t, against the K/V of (r - t) mod W."""
    w = matrix.shape[0]
    rank = torch.arange(w)
    return torch.stack([matrix[rank, (rank - t) % w] for t in range(w)])


def _max_over_mean(x: torch.Tensor) -> float:
    mean = x.double().mean()
    return float(x.max() / mean) if mean > 0 else 1.0  # a step where no rank has work costs nothing


def balance(matrix: torch.Tensor) -> dict:
    """Per-rank and per-step kept tiles of one ring and their imbalances (module docstring)."""
    steps = ring_steps(matrix)
    per_rank = steps.sum(0)
    total = int(per_rank.sum())
    return {
        "rank_tiles": per_rank.tolist(),
        "step_tiles": steps.tolist(),
        "total_imbalance": _max_over_mean(per_rank),
        "step_imbalance": statistics.fmean(_max_over_mean(s) for s in steps),
        "sync_cost": float(steps.max(1).values.sum().item() * matrix.shape[0] / total) if total else 1.0,
    }


def layout_balance(kept: torch.Tensor, world_size: int, layout: str) -> dict:
    return balance(tile_matrix(kept, owners(kept.shape[-1], world_size, layout), world_size))


def candidates_of(cu_seqlens: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    from sparsebalance_pl.kernels.layout import candidate_tiles, token_doc_ids

    return candidate_tiles(token_doc_ids(cu_seqlens, num_tokens), block_size)


# ---------------------------------------------------------------------------------------------------------------
# Real text and the real model's masks


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def build_streams(names: list[str], tokenizer, max_files: int, seed: int) -> dict:
    """{name: (token ids int64 [T], cu_seqlens int32, document sources)} from the installed real text."""
    from sparsebalance_pl.datamodules.builder import InstalledTextSource, default_real_text_roots, read_documents

    files = list(InstalledTextSource.scan(default_real_text_roots(), max_files, seed).files)
    order = np.random.default_rng(seed).permutation(len(files))
    need_long = max((STREAMS[n][0] // DOC_TOKENS for n in names if STREAMS[n][1] == "long"), default=0)
    need_packed = max((STREAMS[n][0] for n in names if STREAMS[n][1] == "packed"), default=0)
    long_docs, pieces, packed_tokens = [], [], 0
    for index in order:
        if len(long_docs) >= need_long and packed_tokens >= need_packed:
            break
        for where, text in read_documents(files[index]):
            if not text.strip():
                continue
            ids = tokenizer.encode(text) + [tokenizer.eos_id]
            if len(ids) >= DOC_TOKENS and len(long_docs) < need_long:
                long_docs.append((where, ids[:DOC_TOKENS]))
            if packed_tokens < need_packed:
                for start in range(0, len(ids), DOC_TOKENS):
                    pieces.append((where, ids[start:start + DOC_TOKENS]))
                    packed_tokens += len(pieces[-1][1])
    if len(long_docs) < need_long or packed_tokens < need_packed:
        raise SystemExit(f"error: the first {max_files} real-text files hold {len(long_docs)} documents of "
                         f"{DOC_TOKENS} tokens and {packed_tokens} tokens in all; raise --max-files")
    streams = {}
    for name in names:
        tokens, kind = STREAMS[name]
        docs, ids = [], []
        for where, piece in (long_docs if kind == "long" else pieces):
            if len(ids) == tokens:
                break
            piece = piece[: tokens - len(ids)]
            docs.append((where, len(piece)))
            ids.extend(piece)
        cu = torch.tensor(np.cumsum([0] + [n for _, n in docs]), dtype=torch.int32)
        streams[name] = (torch.tensor(ids, dtype=torch.long), cu, docs)
    return streams


class _Capture:
    """What the capturing attention function records for the stream being run."""

    def __init__(self, cu_seqlens, args, keep_layers, densities):
        self.cu_seqlens, self.args, self.keep_layers, self.densities = cu_seqlens, args, keep_layers, densities
        self.masks, self.density, self.qkv, self.capped = {}, {}, {}, {}


_CAPTURE: _Capture | None = None


def _capturing_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered with transformers: records the layer's selection, then attends exactly within documents."""
    from sparsebalance_pl.attention import varlen_causal_attention
    from sparsebalance_pl.kernels import rank_blocks

    cap, layer = _CAPTURE, module.layer_idx
    if attention_mask is not None:
        raise RuntimeError("the capturing attention expects no attention mask (it masks documents itself)")
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D], after rotary
    args = cap.args
    ranking = rank_blocks(q, k, cap.cu_seqlens, block_size=args.block_size, stride=args.stride, scale=scaling,
                          backend="torch")
    mask, stats = ranking.select(args.tau)
    cap.masks[layer], cap.density[layer] = mask, float(stats.mean_density())
    if layer in cap.keep_layers:
        cap.qkv[layer] = (q.clone(), k.clone(), v.clone())
        cap.capped[layer] = {d: ranking.select(1.0, max_density=d)[0] for d in cap.densities}
    progress(f"  layer {layer}: density {cap.density[layer]:.3f}")
    return varlen_causal_attention(q, k, v, cap.cu_seqlens, scaling).unsqueeze(0), None


def default_ring_layers(density: dict) -> list[int]:
    """The lowest-density and the median-density layer."""
    by_density = sorted(density, key=density.get)
    return sorted({by_density[0], by_density[len(by_density) // 2]})


def save_capture(path: Path | None, ids: torch.Tensor, cap: _Capture) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": ids, "masks": cap.masks, "density": cap.density, "qkv": cap.qkv, "capped": cap.capped},
                   path)


def load_capture(path: Path | None, ids: torch.Tensor, keep, densities) -> _Capture | None:
    """A capture saved by an earlier run of the same stream and settings, if it holds what this run needs."""
    if path is None or not path.is_file():
        return None
    saved = torch.load(path)
    if not torch.equal(saved["ids"], ids):
        return None
    if keep and not (set(saved["qkv"]) and all(all(d in saved["capped"].get(layer, {}) for d in densities)
                                               for layer in saved["qkv"])):
        return None
    if keep and not isinstance(keep, range) and not set(keep) <= set(saved["qkv"]):
        return None
    cap = _Capture(None, None, set(keep), densities)
    cap.masks, cap.density, cap.qkv, cap.capped = saved["masks"], saved["density"], saved["qkv"], saved["capped"]
    return cap


def capture_stream(model, ids, cu, args, keep_layers) -> _Capture:
    """Runs the model over one packed stream (positions restart at each document)."""
    global _CAPTURE
    _CAPTURE = _Capture(cu, args, set(keep_layers), args.densities)
    bounds = cu.tolist()
    positions = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])
    with torch.no_grad():
        model.model(input_ids=ids[None], position_ids=positions[None], use_cache=False)
    cap, _CAPTURE = _CAPTURE, None
    return cap


def load_model(path: str):
    from transformers import AttentionInterface

    from sparsebalance_pl.model import ModelConfig

    AttentionInterface.register("cp_capture", _capturing_attention)
    return ModelConfig(pretrained_path=path).build("cp_capture").eval()


# ---------------------------------------------------------------------------------------------------------------
# Part 2: the 2-rank ring for real


def _counting_layouts():
    """Patches ``TileLayout.build_ring_step`` and ``build_sink_step`` to record (source, tiles) of every step
    layout a ring builds (source ``"sink"`` for the sink step); returns the record and an undo function."""
    from sparsebalance_pl.kernels.layout import TileLayout

    originals = {name: TileLayout.__dict__[name] for name in ("build_ring_step", "build_sink_step")}
    record = []

    def counting(name):
        def counted(*args, **kwargs):
            layout = originals[name].__func__(*args, **kwargs)
            record.append((kwargs.get("source", "sink"), int(layout.tiles.sum())))
            return layout
        return staticmethod(counted)

    for name in originals:
        setattr(TileLayout, name, counting(name))
    return record, lambda: [setattr(TileLayout, name, f) for name, f in originals.items()]


def _ring_rank(rank: int, world_size: int, port: int, job_path: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _ring_work(rank, world_size, torch.load(job_path), out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ring_work(rank: int, world_size: int, job: dict, out_path: str) -> None:
    import torch.distributed as dist

    from sparsebalance_pl.kernels import block_sparse_attention, context_shard, sparse_ring_attention

    block, cu, reps = job["block_size"], job["cu_seqlens"], job["reps"]
    result = {"tiles": {}, "ring": {}, "whole": {}}

    def shard(x):
        return context_shard(x, world_size=world_size, rank=rank, block_size=block)

    for layer, data in job["layers"].items():
        q, k, v = data["qkv"]
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(layer), dtype=q.dtype)
        local = [shard(x).requires_grad_() for x in (q, k, v)]
        local_grad = shard(grad)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]

        def ring(mask):
            out = sparse_ring_attention(*local, cu, block_size=block, block_mask=mask, backend="torch")
            torch.autograd.grad(out, local, local_grad)

        def alone(mask):
            out = block_sparse_attention(*whole, mask, cu, block_size=block, backend="torch")
            torch.autograd.grad(out, whole, grad)

        masks = data["masks"]  # name: mask, None for dense
        runs = [(f"ring {name}", ring, mask) for name, mask in masks.items()]
        runs += [(f"whole {name}", alone, mask if mask is not None else torch.ones_like(masks["real"]))
                 for name, mask in masks.items() if name in job["whole_masks"]]
        record, undo = _counting_layouts()
        try:
            for name, mask in masks.items():  # the warm-up call, counted
                record.clear()
                ring(mask)
                result["tiles"][(layer, name)] = list(record)
        finally:
            undo()
        times = {name: [] for name, _, _ in runs}
        for rep in range(reps):
            for name, fn, mask in runs[rep % len(runs):] + runs[: rep % len(runs)]:  # rotate the order
                dist.barrier()
                start = time.perf_counter()
                fn(mask)
                times[name].append(time.perf_counter() - start)
            if rank == 0:
                progress(f"  ring layer {layer}: repetition {rep + 1}/{reps} done")
        result["ring"][layer] = times
    torch.save(result, f"{out_path}/rank{rank}.pt")


def run_ring(job: dict, world_size: int = 2, timeout: float = 3600) -> list[dict]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(job, f"{tmp}/job.pt")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_ring_rank, args=(r, world_size, port, f"{tmp}/job.pt", tmp))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        if any(p.is_alive() or p.exitcode for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise SystemExit(f"error: a ring rank failed or timed out (exit codes {[p.exitcode for p in procs]})")
        return [torch.load(f"{tmp}/rank{r}.pt") for r in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------
# Driver


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise SystemExit(f"{self.prog}: error: {message}")


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="context_parallel.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="data/smollm2-135m", help="local Hugging Face Qwen2 directory")
    p.add_argument("--streams", nargs="+", choices=sorted(STREAMS), default=["doc8k", "long32k", "packed32k"])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--stride", type=int, default=16)
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--ring-stream", default="doc8k", help="stream whose layers the 2-rank ring runs")
    p.add_argument("--ring-layers", type=int, nargs="*", default=None,
                   help="layers run on the 2-rank ring (default: the layers of lowest and median density)")
    p.add_argument("--densities", type=float, nargs="*", default=[0.3, 0.1],
                   help="caps of the real ranking timed besides the real mask")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-files", type=int, default=600, help="real-text files scanned")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the model forward")
    p.add_argument("--max-load", type=float, default=1.5, help="wait while the 1-minute load is above this")
    p.add_argument("--load-wait", type=float, default=60.0)
    p.add_argument("--load-retries", type=int, default=5)
    p.add_argument("--skip-ring", action="store_true", help="Part 1 only")
    p.add_argument("--quick", action="store_true", help="doc8k, W <= 8, 2 repetitions: a smoke run")
    p.add_argument("--out", default=None, help="folder for results.json, table.md and imbalance.png")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.world_sizes, args.reps, args.ring_stream = ["doc8k"], [2, 4, 8], 2, "doc8k"
        args.densities = args.densities[:1]
    if args.block_size < 16 or args.block_size & (args.block_size - 1):
        p.error(f"--block-size {args.block_size} must be a power of two >= 16")
    if args.stride < 1 or args.stride & (args.stride - 1) or args.stride > args.block_size:
        p.error(f"--stride {args.stride} must be a power of two no larger than --block-size")
    if not 0 < args.tau <= 1:
        p.error(f"--tau {args.tau} must lie in (0, 1]")
    if any(not 0 < d <= 1 for d in args.densities):
        p.error(f"--densities {args.densities} must lie in (0, 1]")
    for w in args.world_sizes:
        if w < 2 or w & (w - 1):
            p.error(f"--world-sizes: {w} is not a power of two >= 2")
        for name in args.streams:
            if STREAMS[name][0] % (2 * w * args.block_size):
                p.error(f"--world-sizes {w}: stream {name} ({STREAMS[name][0]} tokens) does not split into 2W = "
                        f"{2 * w} chunks of whole {args.block_size}-token blocks (zigzag)")
    if args.reps < 1:
        p.error(f"--reps {args.reps} must be >= 1")
    if not args.skip_ring and args.ring_stream not in args.streams:
        p.error(f"--ring-stream {args.ring_stream!r} is not among --streams {args.streams}")
    if args.max_load <= 0 or args.load_retries < 0 or args.load_wait < 0:
        p.error("--max-load must be > 0, --load-wait and --load-retries >= 0")
    if not (Path(args.model) / "config.json").is_file():  # last: the settings above need no model to check
        p.error(f"--model {args.model!r} is not a local Hugging Face model directory (no config.json)")
    return args


def wait_for_quiet(args) -> float:
    load = os.getloadavg()[0]
    for attempt in range(args.load_retries):
        if load <= args.max_load:
            break
        progress(f"load {load:.2f} > {args.max_load}: waiting {args.load_wait:.0f} s "
                 f"({attempt + 1}/{args.load_retries})")
        time.sleep(args.load_wait)
        load = os.getloadavg()[0]
    return load


def median(xs) -> float:
    return float(statistics.median(xs))


def part1(stream_masks: dict, candidates: torch.Tensor, world_sizes: list[int], cu_seqlens: torch.Tensor,
          block_size: int) -> dict:
    """{W: {layout: {"real": {layer: balance}, "dense": balance}}}, with ``SINKS_LOCAL``."""
    heads = next(iter(stream_masks.values())).shape[0]
    dense = candidates.expand(heads, -1, -1)
    out = {}
    for w in world_sizes:
        out[w] = {}
        for layout in (*LAYOUTS, SINKS_LOCAL):
            owner = owners(candidates.shape[-1], w, "striped" if layout == SINKS_LOCAL else layout)
            shared = sink_blocks(cu_seqlens, candidates.shape[-1], block_size, w) if layout == SINKS_LOCAL else None
            out[w][layout] = {
                "real": {layer: balance(tile_matrix(m & candidates, owner, w, shared))
                         for layer, m in stream_masks.items()},
                "dense": balance(tile_matrix(dense, owner, w, shared)),
            }
    return out


def summarise(results: dict) -> list[str]:
    lines = []
    for name, stream in results["streams"].items():
        dens = list(stream["density"].values())
        lines += [
            f"### Stream {name}: {stream['tokens']:,} tokens, {stream['documents']} documents "
            f"(longest {stream['longest_document']:,}), {stream['blocks']} blocks",
            "",
            f"Real masks: tau {results['args']['tau']}, density per layer median {median(dens):.3f} "
            f"(min {min(dens):.3f}, max {max(dens):.3f}). Imbalance = max / mean over ranks; per layer, median "
            "over layers (worst layer); sync = sum over steps of the busiest rank's tiles over total / W.",
            "",
            "| W | blocks/rank | layout | total, real | per step, real | sync, real | total, dense causal "
            "| per step, dense | sync, dense |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for w, layouts in stream["balance"].items():
            for layout, b in layouts.items():
                real = list(b["real"].values())

                def cell(key):
                    xs = [r[key] for r in real]
                    return f"{median(xs):.3f} ({max(xs):.3f})"

                d = b["dense"]
                lines.append(f"| {w} | {stream['blocks'] // int(w)} | {layout} | {cell('total_imbalance')} | "
                             f"{cell('step_imbalance')} | {cell('sync_cost')} | {d['total_imbalance']:.3f} | "
                             f"{d['step_imbalance']:.3f} | {d['sync_cost']:.3f} |")
        lines.append("")
        if "8" in map(str, stream["balance"]):
            b = {str(k): v for k, v in stream["balance"].items()}["8"]
            density = {str(k): v for k, v in stream["density"].items()}
            layer = sorted(density, key=density.get)[len(density) // 2]
            lines += [f"Kept tiles (all heads) per ring step (rows) and rank (columns), W = 8, layer {layer} "
                      f"(median density {density[layer]:.3f}):", ""]
            for layout in b:
                steps = b[layout]["real"][layer if layer in b[layout]["real"] else int(layer)]["step_tiles"]
                lines += [f"{layout}:", "", "| step | " + " | ".join(f"rank {r}" for r in range(8)) + " | max / mean |",
                          "|---" * 10 + "|"]
                for t, row in enumerate(steps):
                    mean = sum(row) / len(row)
                    lines.append(f"| {t} | " + " | ".join(f"{x:,}" for x in row)
                                 + f" | {max(row) / mean if mean else 1.0:.2f} |")
                total = [sum(col) for col in zip(*steps)]
                lines += ["| all | " + " | ".join(f"{x:,}" for x in total)
                          + f" | {max(total) * len(total) / sum(total):.3f} |", ""]
    ring = results.get("ring")
    if ring:
        lines += [
            f"### 2-rank ring ({ring['stream']}, gloo, 1 thread per rank, fwd + bwd, {ring['reps']} repetitions, "
            f"1-minute load {ring['load_before']:.2f} before / {ring['load_after']:.2f} after)",
            "",
            f"Tiles each ring step computed (counted from the ring's own layouts) equal the computed striped W = 2 "
            f"counts: **{ring['tiles_match']}**.",
            "",
            "| layer | mask | density | kept tiles rank 0 / rank 1 | median s (slowest rank) | over dense ring |",
            "|---|---|---|---|---|---|",
        ]
        for row in ring["rows"]:
            lines.append(f"| {row['layer']} | {row['mask']} | {row['density']:.3f} | {row['rank_tiles'][0]:,} / "
                         f"{row['rank_tiles'][1]:,} | {row['median_s']:.3f} | {row['over_dense']:.3f} |")
        lines += [
            "",
            "Whole-document placement (each rank attends one whole document alone, both ranks at once) against the "
            "2-rank ring (both documents through the ring one after the other): time for the two documents.",
            "",
            "| layer | mask | whole documents, 1 per rank (s) | ring, 2 documents (s) | ring / whole |",
            "|---|---|---|---|---|",
        ]
        for row in ring["whole"]:
            lines.append(f"| {row['layer']} | {row['mask']} | {row['whole_s']:.3f} | {row['ring_two_s']:.3f} | "
                         f"{row['ratio']:.3f} |")
        lines.append("")
    lines += ["### Done-when", ""] + [f"- {x}" for x in results["done_when"]] + [""]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from sparsebalance_pl.datamodules.tokenizer import load_tokenizer

    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    progress(f"reading real text ({args.max_files} files at most) and tokenizing")
    streams = build_streams(args.streams, load_tokenizer(args.model), args.max_files, args.seed)
    loaded = []

    def model():
        if not loaded:
            progress(f"loading {args.model}")
            loaded.append(load_model(args.model))
        return loaded[0]

    from transformers import AutoConfig

    num_layers = AutoConfig.from_pretrained(args.model, local_files_only=True).num_hidden_layers
    if args.ring_layers and any(not 0 <= x < num_layers for x in args.ring_layers):
        raise SystemExit(f"context_parallel.py: error: --ring-layers {args.ring_layers} must lie in [0, {num_layers})")

    results = {"args": vars(args), "streams": {}, "done_when": []}
    ring_capture = None
    for name in args.streams:
        ids, cu, docs = streams[name]
        ring_here = name == args.ring_stream and not args.skip_ring
        keep = (range(num_layers) if args.ring_layers is None else args.ring_layers) if ring_here else []
        progress(f"stream {name}: {ids.numel()} tokens, {len(docs)} documents; model forward and selection")
        cache = out / "captures" / f"{name}_tau{args.tau:g}_b{args.block_size}_s{args.stride}_seed{args.seed}.pt" \
            if out else None
        cap = load_capture(cache, ids, keep, args.densities)
        if cap is None:
            start = time.perf_counter()
            cap = capture_stream(model(), ids, cu, args, keep)
            progress(f"stream {name}: captured in {time.perf_counter() - start:.0f} s")
            if ring_here and args.ring_layers is None:  # keep q, k, v of the layers the ring will run only
                chosen = set(default_ring_layers(cap.density))
                cap.qkv = {k: v for k, v in cap.qkv.items() if k in chosen}
            save_capture(cache, ids, cap)
        else:
            progress(f"stream {name}: masks read from {cache}")
        candidates = candidates_of(cu, ids.numel(), args.block_size)
        results["streams"][name] = {
            "tokens": ids.numel(), "documents": len(docs), "longest_document": max(n for _, n in docs),
            "document_sources": docs, "blocks": candidates.shape[0], "density": cap.density,
            "balance": part1(cap.masks, candidates, args.world_sizes, cu, args.block_size),
        }
        if ring_here:
            ring_capture, ring_candidates = cap, candidates
        else:
            del cap

    if 8 in args.world_sizes:
        for key in ("doc8k", "long32k", "packed32k", "packed16k", "packed8k"):
            if key not in results["streams"]:
                continue
            b = results["streams"][key]["balance"][8]
            s = [r["total_imbalance"] for r in b["striped"]["real"].values()]
            c = [r["total_imbalance"] for r in b["contiguous"]["real"].values()]
            z = [r["total_imbalance"] for r in b["zigzag"]["real"].values()]
            dense = b["striped"]["dense"]["total_imbalance"]
            results["done_when"].append(
                f"{key}, W = 8, real masks: striped per-rank kept-tile imbalance median {median(s):.3f}, worst layer "
                f"{max(s):.3f}, <= 1.05 in {sum(x <= 1.05 for x in s)} of {len(s)} layers (dense causal striped: "
                f"{dense:.3f}); contiguous median {median(c):.3f} (worst {max(c):.3f}); zigzag median "
                f"{median(z):.3f} (worst {max(z):.3f})")

    if ring_capture is not None:
        ring = results["ring"] = ring_part(args, ring_capture, ring_candidates, streams[args.ring_stream][1])
        for row in ring["rows"]:
            if row["mask"] != "dense" and row["density"] <= 0.3:
                results["done_when"].append(
                    f"2-rank ring, layer {row['layer']}, {row['mask']} mask at density {row['density']:.3f}: sparse "
                    f"ring / dense ring = {row['over_dense']:.3f} "
                    f"({'faster' if row['over_dense'] < 1 else 'NOT faster'})")

    lines = summarise(results)
    text = "\n".join(lines)
    print(text)
    if out:
        (out / "table.md").write_text(text + "\n")
        (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1) + "\n")
        plot(results, out / "imbalance.png")
        progress(f"wrote {out}/results.json, table.md, imbalance.png")


def ring_part(args, cap: _Capture, candidates: torch.Tensor, cu: torch.Tensor) -> dict:
    layers = default_ring_layers(cap.density) if args.ring_layers is None else args.ring_layers
    heads = cap.masks[layers[0]].shape[0]
    job = {"block_size": args.block_size, "cu_seqlens": cu, "reps": args.reps, "whole_masks": ("dense", "real"),
           "layers": {}}
    densities = {}
    for layer in layers:
        masks = {"dense": None, "real": cap.masks[layer]}
        masks.update({f"cap {d:g}": m for d, m in cap.capped[layer].items()})
        job["layers"][layer] = {"qkv": cap.qkv[layer], "masks": masks}
        for name, m in masks.items():
            kept = candidates.expand(heads, -1, -1) if m is None else m & candidates
            densities[(layer, name)] = (kept, float(kept.sum() / (candidates.sum() * heads)))
    load_before = wait_for_quiet(args)
    progress(f"2-rank ring on layers {layers} of {args.ring_stream}, {args.reps} repetitions "
             f"(1-minute load {load_before:.2f})")
    ranks = run_ring(job)
    load_after = os.getloadavg()[0]
    rows, whole, match = [], [], True
    owner = owners(candidates.shape[0], 2, "striped")
    sinks = sink_blocks(cu, candidates.shape[0], args.block_size, 2)
    for layer in layers:
        names = list(job["layers"][layer]["masks"])
        slowest = {n: [max(r["ring"][layer][n][i] for r in ranks) for i in range(args.reps)]
                   for n in ranks[0]["ring"][layer]}
        dense_s = median(slowest["ring dense"])
        for name in names:
            kept, density = densities[(layer, name)]
            want = ring_steps(tile_matrix(kept, owner, 2, sinks))  # [step, rank], the sink step's with step 0
            for rank, r in enumerate(ranks):
                got = [(src, n) for src, n in r["tiles"][(layer, name)] if src != "sink"]
                sink = sum(n for src, n in r["tiles"][(layer, name)] if src == "sink")
                measured = [tiles + (sink if t == 0 else 0) for t, (_, tiles) in enumerate(got)]
                expect = [int(want[t, rank]) for t in range(2)]
                sources = [src for src, _ in got]
                if measured != expect or sources != [(rank - t) % 2 for t in range(2)]:
                    match = False
                    progress(f"MISMATCH layer {layer} {name} rank {rank}: ring computed {got}, expected {expect}")
            t = median(slowest[f"ring {name}"])
            rows.append({"layer": layer, "mask": name, "density": density,
                         "rank_tiles": [int(x) for x in want.sum(0)], "step_tiles": want.tolist(),
                         "times_s": slowest[f"ring {name}"], "median_s": t, "over_dense": t / dense_s})
            if f"whole {name}" in slowest:
                w = median(slowest[f"whole {name}"])
                whole.append({"layer": layer, "mask": name, "whole_s": w, "ring_two_s": 2 * t, "ratio": 2 * t / w,
                              "times_s": slowest[f"whole {name}"]})
    return {"stream": args.ring_stream, "layers": layers, "reps": args.reps, "load_before": load_before,
            "load_after": load_after, "tiles_match": match, "rows": rows, "whole": whole}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(results["streams"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
    colours = {"contiguous": "tab:red", "zigzag": "tab:orange", "striped": "tab:blue", SINKS_LOCAL: "tab:green"}
    for row, name in zip(axes, names):
        bal = results["streams"][name]["balance"]
        ws = sorted(bal, key=int)
        xs = [int(w) for w in ws]  # keys are str when read back from results.json
        for ax, key, title in zip(row, ("total_imbalance", "step_imbalance"),
                                  ("per-rank total kept tiles", "per ring step (mean over steps)")):
            for layout in (x for x in colours if x in bal[ws[0]]):
                real = [[r[key] for r in bal[w][layout]["real"].values()] for w in ws]
                ax.plot(xs, [median(x) for x in real], "-o", color=colours[layout], label=f"{layout}, real (median)")
                ax.fill_between(xs, [min(x) for x in real], [max(x) for x in real], color=colours[layout], alpha=0.15)
                ax.plot(xs, [bal[w][layout]["dense"][key] for w in ws], "--", color=colours[layout],
                        label=f"{layout}, dense causal")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("W (ranks)")
            ax.set_ylabel("max / mean kept tiles")
            ax.set_title(f"{name}: {title}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
