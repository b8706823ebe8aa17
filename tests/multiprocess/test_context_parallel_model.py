"""The tiny model with context parallelism 2 (two gloo ranks sharing one striped stream) gives the loss and the
gradients of one process holding the whole stream, over two optimiser steps, with dense and sparse attention.

Each rank stripes the packed stream with ``stripe_packed`` (which pads it with a padding document), runs the
model with the ring, back-propagates the globally normalised loss and averages gradients over the ranks as
FSDP does; it also runs an identical model on the whole unpadded stream in one process. Both take the same
optimiser step, then a second step is compared.
"""

import pytest
import torch
from rank_runner import run_ranks

BLOCK = 16
DOCUMENTS = [7, 50, 100, 3, 75]  # 235 tokens: a document shorter than a block, documents across stripes, padding
TOLERANCE = 1e-5
CASES = [("dense", False), ("sparse", False), ("sparse", True)]  # (attention, activation checkpointing)
DIMS = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=128)


def _model(checkpointing: bool = False):
    from sparsebalance_pl.model import ModelConfig, PackedCausalLM

    torch.manual_seed(0)
    hf_model = ModelConfig(preset="demo", overrides=DIMS).build("sparsebalance")
    if checkpointing:  # the backward recomputes each layer, ring included, with the masks of the forward
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return PackedCausalLM(hf_model, loss_chunk_tokens=64)


def _batch(step: int) -> dict:
    from sparsebalance_pl.datamodules.packing import collate_packed

    gen = torch.Generator().manual_seed(step)
    return collate_packed([{"tokens": torch.randint(0, 128, (n,), generator=gen).numpy()} for n in DOCUMENTS])


def _context(batch, backend, cp):
    """The sparse attention of the two-layer model, its micro-batch begun on ``batch`` (striped over ``cp``)."""
    from sparsebalance_pl.attention import AttentionConfig, SparseAttention

    config = AttentionConfig(backend=backend, block_size=BLOCK, stride=4, tau=0.9, kernel_backend="torch")
    sparse = SparseAttention(DIMS, config)
    sparse.begin(batch["cu_seqlens"], training=True, context_parallel=cp)
    return sparse


def _loss_and_grads(net, batch, ctx, world_size):
    """The reported loss and the gradients as FSDP leaves them (averaged over ranks) after one backward."""
    import torch.distributed as dist

    from sparsebalance_pl.loss import globally_normalised_loss

    net.zero_grad()
    loss_sum, tokens = net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx)
    to_backprop, reported = globally_normalised_loss(loss_sum, tokens)
    to_backprop.backward()
    for p in net.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    return float(reported), {name: p.grad.clone() for name, p in net.named_parameters()}


def _rank(rank, out_dir):
    import torch.distributed as dist

    from sparsebalance_pl.context_parallel import ContextParallel
    from sparsebalance_pl.datamodules.packing import stripe_packed
    from sparsebalance_pl.attention import _group_budgets
    from sparsebalance_pl.kernels import LayerBudget

    results = {}
    cp = ContextParallel(size=2, rank=rank, group=dist.new_group([0, 1]))
    for backend, checkpointing in CASES:
        striped_net, whole_net = _model(checkpointing), _model()
        # SGD: an update proportional to the gradient (Adam's sign-like steps on near-zero gradients would
        # turn rounding into differences the second step then measures)
        optimisers = [torch.optim.SGD(n.parameters(), lr=1.0) for n in (striped_net, whole_net)]
        for step in range(2):
            batch = _batch(step)
            shard = stripe_packed(batch, world_size=2, rank=rank, block_size=BLOCK)
            got = _loss_and_grads(striped_net, shard, _context(shard, backend, cp), world_size=2)
            want = _whole_stream(whole_net, batch, backend)
            results[(backend, checkpointing, step)] = (got, want)
            for opt in optimisers:
                opt.step()
    # The group agrees on its tightest member's budgets.
    mine = [LayerBudget(0.9, None, 0.6 if rank == 1 else 0.8), LayerBudget(0.9)]
    results["budgets"] = _group_budgets(mine, cp)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _whole_stream(net, batch, backend):
    """The same model on the whole stream in one process, loss normalised by the stream's tokens."""
    from sparsebalance_pl.context_parallel import ContextParallel

    net.zero_grad()
    loss_sum, tokens = net(batch["input_ids"], batch["position_ids"], batch["targets"],
                           _context(batch, backend, ContextParallel()))
    (loss_sum / tokens).backward()
    return float(loss_sum.detach() / tokens), {name: p.grad.clone() for name, p in net.named_parameters()}


@pytest.mark.slow
def test_context_parallel_model_equals_whole_stream(tmp_path):
    assert run_ranks(_rank, str(tmp_path), world_size=2, timeout=300) == {}
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for backend, checkpointing in CASES:
            for step in range(2):
                (loss, grads), (want_loss, want_grads) = results[(backend, checkpointing, step)]
                assert abs(loss - want_loss) <= TOLERANCE * abs(want_loss), (backend, step, loss, want_loss)
                for name, want in want_grads.items():
                    error = float((grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-12))
                    assert error <= TOLERANCE, f"{backend} {checkpointing} step {step}: gradient of {name} off by {error:.2e}"
        budgets = results["budgets"]
        assert budgets[0].density_scale == 0.6 and budgets[1].density_scale is None
