"""Scoring answers planted in packed evaluation streams, without materialising the full logits."""

from __future__ import annotations

import torch


def answer_exact_match(
    hidden: torch.Tensor, head_weight: torch.Tensor, input_ids: torch.Tensor, answer_spans: torch.Tensor
) -> torch.Tensor:
    """Whether greedy next-token prediction reproduces each answer, bool [n].

    hidden [T, H] are the final hidden states of one packed stream, ``input_ids`` [T] its tokens and
    ``answer_spans`` [n, 2] the answers as stream positions [start, end). Only the positions that predict an
    answer token go through the LM head.
    """
    sizes = (answer_spans[:, 1] - answer_spans[:, 0]).tolist()
    if not sizes:
        return torch.zeros(0, dtype=torch.bool, device=hidden.device)
    positions = torch.cat([torch.arange(s - 1, e - 1, device=hidden.device) for s, e in answer_spans.tolist()])
    predicted = (hidden[positions] @ head_weight.to(hidden.dtype).T).argmax(dim=-1)
    right = predicted == input_ids[positions + 1]
    return torch.stack([chunk.all() for chunk in torch.split(right, sizes)])
