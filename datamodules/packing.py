"""Packing documents into micro-batches and a micro-batch into one packed stream.

A micro-batch is a list of document indices; ``collate_packed`` turns their token arrays into one stream with
position ids restarting at each document, next-token targets that never cross a document boundary, and
``cu_seqlens`` for the attention. ``stripe_packed`` gives a rank of a context-parallel group its block-striped
share of such a stream, once per micro-batch.
"""

from __future__ import annotations

import numpy as np
import torch

from sparsebalance_pl.loss import IGNORE_INDEX

FIRST_FIT_WINDOW = 64


def first_fit(lengths: np.ndarray, order: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Documents in ``order`` packed first-fit into micro-batches of at most ``max_tokens`` tokens.

    Only the most recent ``FIRST_FIT_WINDOW`` open micro-batches are candidates, which keeps packing linear in
    the number of documents and close to stream order (a token-count baseline, not a balanced plan).
    """
    batches: list[list[int]] = []
    free: list[int] = []
    for index in order:
        n = int(lengths[index])
        if n > max_tokens:
            raise ValueError(f"document {int(index)} has {n} tokens, more than max_tokens={max_tokens}")
        lo = max(0, len(batches) - FIRST_FIT_WINDOW)
        target = next((b for b in range(lo, len(batches)) if free[b] >= n), None)
        if target is None:
            batches.append([])
            free.append(max_tokens)
            target = len(batches) - 1
        batches[target].append(int(index))
        free[target] -= n
    return batches


def collate_packed(samples: list[dict]) -> dict[str, torch.Tensor]:
    """One packed stream ([1, T] tensors) from samples holding ``tokens`` arrays.

    A sample with ``bears_loss: False`` (padding that keeps ranks in step) gets no targets. A marker sample
    ``{"shared_stream": W}`` (the plan's ``SharedStream``) makes the batch's ``shared_stream`` W: a context-parallel
    group of W ranks trains it as one stream; 1 otherwise.
    """
    shared = [s["shared_stream"] for s in samples if "shared_stream" in s]
    samples = [s for s in samples if "shared_stream" not in s]
    tokens = [torch.as_tensor(np.asarray(s["tokens"]), dtype=torch.long) for s in samples]
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
    input_ids = torch.cat(tokens)
    targets = torch.cat([_next_tokens(t, s.get("bears_loss", True)) for t, s in zip(tokens, samples)])
    position_ids = torch.cat([torch.arange(len(t)) for t in tokens])
    cu_seqlens = torch.zeros(len(tokens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return {
        "input_ids": input_ids[None],
        "targets": targets[None],
        "position_ids": position_ids[None],
        "cu_seqlens": cu_seqlens,
        "shared_stream": shared[0] if shared else 1,
    }


def stripe_packed(batch: dict, *, world_size: int, rank: int, block_size: int) -> dict:
    """This rank's share of a packed stream held by a context-parallel group of ``world_size`` ranks.

    The stream is padded to a multiple of ``world_size * block_size`` with a padding document (token 0, no
    loss), never truncated; ``input_ids``, ``position_ids`` and ``targets`` become this rank's block-striped
    rows (``sparsebalance_pl.kernels.context_shard``) and ``cu_seqlens`` stays the whole stream's, which every
    rank of the group needs. The targets were taken before striping, so each still names its own next token,
    and each loss-bearing token lies on exactly one rank.
    """
    from sparsebalance_pl.kernels import context_shard

    num_tokens = batch["input_ids"].shape[1]
    padding = -num_tokens % (world_size * block_size)
    cu_seqlens = batch["cu_seqlens"]
    if padding:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([num_tokens + padding])])
    padding_document = {  # token 0, positions from 0, no targets
        "input_ids": torch.zeros(padding), "position_ids": torch.arange(padding),
        "targets": torch.full((padding,), IGNORE_INDEX),
    }
    striped = dict(batch, cu_seqlens=cu_seqlens)
    for key, tail in padding_document.items():
        row = batch[key][0]
        stream = torch.cat([row, tail.to(row.device, row.dtype)])
        striped[key] = context_shard(stream, world_size=world_size, rank=rank, block_size=block_size)[None]
    return striped


def _next_tokens(tokens: torch.Tensor, bears_loss: bool) -> torch.Tensor:
    """Each token's target: the next token of the same document; none after the last or without loss."""
    if not bears_loss:
        return torch.full_like(tokens, IGNORE_INDEX)
    return torch.cat([tokens[1:], tokens.new_full((1,), IGNORE_INDEX)])


def collate_answers(samples: list[dict]) -> dict[str, torch.Tensor]:
    """A packed stream of evaluation samples plus where each answer lies in it.

    ``answer_spans`` [n, 2] holds each sample's answer as stream positions [start, end); ``cells`` [n] the
    sample's (task, length) cell. Padding samples carry no answer and are left out of both.
    """
    batch = collate_packed(samples)
    starts = batch["cu_seqlens"][:-1].long()
    spans, cells = [], []
    for sample, start in zip(samples, starts.tolist()):
        if sample.get("bears_loss", True):
            spans.append([start + sample["answer_start"], start + len(sample["tokens"])])
            cells.append(sample["cell"])
    batch["answer_spans"] = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)
    batch["cells"] = torch.tensor(cells, dtype=torch.long)
    return batch
