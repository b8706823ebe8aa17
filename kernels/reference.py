"""Dense fp64 block-sparse attention: the executable definition of the kernels' semantics
(``block_sparse_attention``) that the backends are tested against."""

from __future__ import annotations

import torch

from .layout import check_attention_inputs, check_cu_seqlens, pair_mask, token_doc_ids


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; rows with nothing allowed give all zeros
    (and zero gradients) instead of NaN."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def reference_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as ``block_sparse_attention`` but dense over T x T and in fp64; returns fp64 [T, Hq, D].

    Only for tests and small inputs: memory is Hq * T * T.
    """
    check_attention_inputs(q, k, v, block_mask, block_size)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    doc = token_doc_ids(cu_seqlens.to(q.device), num_tokens)
    allowed = pair_mask(doc, torch.arange(num_tokens, device=q.device), block_size, block_mask)
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    probs = masked_softmax(qd @ kd.transpose(1, 2) * scale, allowed)
    return (probs @ vd).transpose(0, 1)
