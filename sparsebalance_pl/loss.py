"""Language-model loss over a packed stream without materialising all logits, normalised globally.

With a 151,936-entry vocabulary the logits of an 8K-token micro-batch take about 5 GB in fp32. The fused
LM-head + cross-entropy below works chunk by chunk and computes the gradients for the hidden states and the
head weight during the forward, so neither the logits nor their softmax are ever held for the whole stream.
"""

from __future__ import annotations

import torch

from sparsebalance_pl.distributed import global_sum, world_size

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy_sum", "globally_normalised_loss"]

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets``; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens: int, compute_dtype: torch.dtype):
        need_hidden_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        weight_c = weight.to(compute_dtype)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens].to(compute_dtype)
            t = targets[start : start + chunk_tokens]
            valid = t != IGNORE_INDEX
            safe_t = torch.where(valid, t, 0)
            logits = (h @ weight_c.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, safe_t[:, None])[:, 0]
            loss_sum += torch.where(valid, lse - target_logit, 0.0).sum()
            if need_hidden_grad or need_weight_grad:
                grad_logits = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of the logits
                grad_logits[torch.arange(len(t), device=t.device), safe_t] -= 1.0
                grad_logits *= valid[:, None]
                if need_hidden_grad:
                    grad_hidden[start : start + chunk_tokens] = (grad_logits.to(compute_dtype) @ weight_c).to(
                        hidden.dtype
                    )
                if need_weight_grad:
                    # Tensor cores under autocast; each chunk's product is rounded to the compute dtype before the
                    # fp32 sum, as autocast's own linear layers round their weight gradients.
                    grad_weight += (grad_logits.to(compute_dtype).T @ h).float()
        ctx.save_for_backward(
            grad_hidden if need_hidden_grad else None, grad_weight if need_weight_grad else None
        )
        ctx.weight_dtype = weight.dtype
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses, number of loss-bearing tokens) for hidden [N, H], weight [V, H], targets [N].

    Targets equal to ``IGNORE_INDEX`` (-100) bear no loss. The matmul runs in the autocast dtype when autocast
    is on, the softmax in fp32.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = hidden.dtype
    with torch.autocast(device_type, enabled=False):
        loss_sum = _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, compute_dtype)
    return loss_sum, (targets != IGNORE_INDEX).sum()


def globally_normalised_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to back-propagate, loss to report) for one micro-batch on this rank.

    Ranks hold different numbers of loss-bearing tokens, so each rank's summed loss is divided by the global
    count of such tokens. Data-parallel gradient averaging then divides by the world size once more, which
    the factor ``world_size()`` undoes: the update equals the gradient of (total loss / total tokens)
    whichever way documents were split across ranks.
    """
    total_tokens = global_sum(num_tokens.float()).clamp_min(1.0)
    to_backprop = loss_sum * world_size() / total_tokens
    reported = global_sum(loss_sum.detach()) / total_tokens
    return to_backprop, reported
