"""Every collective SparseBalance issues, in one place.

They run on ``torch.distributed``'s default group (the one Lightning's strategies create) unless a ``group``
is given, and degrade to local no-ops when the process is not distributed, so each caller works the same in a
single process, in tests and under any strategy. None of them runs inside a model's layers: they exchange a
few numbers per step (the loss's token count, DST's predicted times, what each rank measured).

Timeouts are the process group's (``trainer.strategy.init_args.timeout``); ``is_collective_failure`` tells
the errors they raise apart from others, so a strategy can name the rank and step where a peer was lost.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from sparsebalance_pl.errors import DataError


def is_distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def global_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of a tensor over all ranks (the value itself when not distributed); no autograd through it."""
    if is_distributed(group):
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def gather_objects(obj: Any, group=None) -> list:
    """Every rank's small picklable ``obj``, in rank order (variable-length lists of documents and the like)."""
    if not is_distributed(group):
        return [obj]
    out: list = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# The all-gather into one tensor: torch 2.14 names it all_gather_single (and warns on every run under the old name);
# older releases, as on the GPU check's image, know only all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_floats(values: Sequence[float], device: torch.device | str = "cpu", group=None) -> np.ndarray:
    """[world, len(values)]: every rank's few floats in one all-gather (``values`` must have the same length on
    every rank; ``device`` is where the backend wants its tensors: the GPU under NCCL)."""
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    if not is_distributed(group):
        return local[None].cpu().numpy()
    out = torch.empty(world_size(group) * local.numel(), dtype=torch.float64, device=device)
    _all_gather_single(out, local, group=group)
    return out.view(world_size(group), local.numel()).cpu().numpy()


def all_ranks(flag: bool, device: torch.device | str = "cpu", group=None) -> bool:
    """Whether ``flag`` is true on every rank (the same answer on every rank)."""
    return bool(gather_floats([float(flag)], device, group).all())


def check_ranks_agree(fingerprint: bytes, what: str, group=None) -> None:
    """Stop every rank with one message naming the groups of ranks when ``fingerprint`` differs between ranks.

    Ranks that would plan from different data or settings compute different plans, and their collectives then
    wait forever: one all-gather of a digest at start turns that hang into an error.
    """
    digests = gather_objects(hashlib.sha256(fingerprint).hexdigest(), group)
    if len(set(digests)) > 1:
        groups = {d: [r for r, x in enumerate(digests) if x == d] for d in dict.fromkeys(digests)}
        ranks = "; ".join(f"ranks {v}: {k[:12]}" for k, v in groups.items())
        raise DataError(f"ranks disagree on {what} ({ranks})")


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` after an error. A rank of a launched run leaves its process group (a local step, no
    collective) and skips the interpreter's teardown: torch's and gloo's threads still alive then can abort it
    ("terminate called without an active exception", exit code -6 instead of ``code``)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


_LOST_COLLECTIVE = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer: NCCL and the rendezvous store raise ``DistError``, gloo
    raises RuntimeErrors known by their text."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(text in str(err) for text in _LOST_COLLECTIVE)
    )
