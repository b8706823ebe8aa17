"""Exact recall of a block mask: the share of the true softmax attention mass that the kept blocks capture.

This is the accuracy side of every sparsity budget, measured on sampled query rows so that its
cost is rows x T, not T x T.
"""

from __future__ import annotations

import math

import torch

from .layout import check_cu_seqlens, check_power_of_two, check_qk, num_blocks, pair_mask, token_doc_ids

_ROWS_PER_CHUNK = 64


@torch.no_grad()
def attention_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    block_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    num_rows: int = 256,
    seed: int = 0,
    per_head: bool = False,
) -> torch.Tensor:
    """Token-weighted mean over about ``num_rows`` sampled query tokens (all tokens when T is smaller) of the
    exact attention mass, under causal document attention, that falls on tokens the mask keeps; a 0-d tensor,
    or [Hq] if ``per_head``. Rows are drawn per document (``sampled_rows``), so a document is measured on the
    same rows in whichever pack it lands.

    ``block_mask`` [Hq, nB, nB], or M masks stacked [M, Hq, nB, nB] for M recalls ([M] or [M, Hq]) measured on
    the same rows from one softmax: their differences are then free of the sampling's noise (what a moved
    budget cost or bought against the base one).
    """
    check_power_of_two("block_size", block_size)
    check_qk(q, k)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    num_tokens, num_q_heads, head_dim = q.shape
    nb = num_blocks(num_tokens, block_size)
    stacked = block_mask.dim() == 4
    masks = block_mask if stacked else block_mask[None]
    if block_mask.dtype != torch.bool or tuple(masks.shape[1:]) != (num_q_heads, nb, nb):
        raise ValueError(
            f"block_mask must be bool [{num_q_heads}, {nb}, {nb}] or [M, {num_q_heads}, {nb}, {nb}], "
            f"got {tuple(block_mask.shape)}"
        )
    scale = head_dim**-0.5 if scale is None else scale
    rows, weights = sampled_rows(cu_seqlens, num_rows, seed)
    rows, weights = rows.to(q.device), weights.to(q.device)
    doc = token_doc_ids(cu_seqlens.to(q.device), num_tokens)
    kf = k.float().repeat_interleave(num_q_heads // k.shape[1], dim=1).transpose(0, 1)  # [Hq, T, D]
    captured = []
    for chunk in rows.split(_ROWS_PER_CHUNK):
        allowed = pair_mask(doc, chunk, block_size)  # [R, T]
        scores = (q[chunk].float().transpose(0, 1) @ kf.transpose(1, 2)) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        # [M, Hq, R]: each mask's kept mass of every row
        captured.append(torch.stack([(probs * pair_mask(doc, chunk, block_size, m)).sum(dim=-1) for m in masks]))
    # [M, Hq]; a share of the mass, so rounding in the sums must not carry it past 1
    recall = ((torch.cat(captured, dim=-1) * weights).sum(dim=-1) / weights.sum()).clamp(max=1.0)
    recall = recall if per_head else recall.mean(dim=-1)
    return recall if stacked else recall[0]


def sampled_rows(cu_seqlens: torch.Tensor, num_rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows ``attention_recall`` measures and the tokens each stands for, both [R] (int64, float32).

    A document of n of the pack's T tokens gets ceil(num_rows * n / T) rows (all of them when num_rows >= T),
    the first ones of a permutation of its positions that depends only on n and ``seed``. The same document
    is thus measured on the same rows (or a prefix of them) in any pack, so planners that pack the same
    documents differently are compared on the same tokens, not on samples that differ by chance. A single
    document gets the num_rows rows of one permutation of the pack.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu().tolist()
    num_tokens = sum(lengths)
    if num_rows >= num_tokens:
        return torch.arange(num_tokens), torch.ones(num_tokens)
    rows, weights, start = [], [], 0
    for n in lengths:
        if n > 0:
            k = min(n, math.ceil(num_rows * n / num_tokens))
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]
            rows.append(start + order.sort().values)
            weights.append(torch.full((k,), n / k))
        start += n
    return torch.cat(rows), torch.cat(weights)
