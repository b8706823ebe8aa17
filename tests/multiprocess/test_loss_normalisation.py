"""The update of a global batch does not depend on how its documents were split across ranks.

Two gloo ranks on the CPU run the real FSDP2 sharding of the module; their gradients are compared with one
process holding the whole global batch, for two different splits.
"""

import pytest
import torch
from rank_runner import run_ranks

DOCS = [31, 90, 12, 64, 47, 5]
SPLITS = {"balanced": ([0, 1, 2], [3, 4, 5]), "skewed": ([0, 2, 5], [1, 3, 4])}


def _module():
    from sparsebalance_pl.attention import AttentionConfig
    from sparsebalance_pl.model import ModelConfig
    from sparsebalance_pl.module import SparseCausalLM

    torch.manual_seed(0)
    module = SparseCausalLM(
        model=ModelConfig(
            preset="demo",
            overrides={"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
        ),
        attention=AttentionConfig(backend="dense", block_size=16, stride=4),
    )
    module.configure_model()
    return module


def _batch(doc_ids):
    from sparsebalance_pl.datamodules.packing import collate_packed

    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in DOCS]
    return collate_packed([{"tokens": docs[i].numpy()} for i in doc_ids])


def _full_grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.net.named_parameters()}


def _rank_main(rank, split, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    from sparsebalance_pl.loss import globally_normalised_loss
    from sparsebalance_pl.strategy import apply_fully_shard

    module = _module()
    apply_fully_shard(module.net, list(module.net.hf.model.layers), init_device_mesh("cpu", (2,)))
    loss_sum, count = module(_batch(SPLITS[split][rank]))
    loss, _ = globally_normalised_loss(loss_sum, count)
    loss.backward()
    grads = _full_grads(module)
    if rank == 0:
        torch.save(grads, out_path)


def _two_rank_grads(split, tmp_path):
    out = tmp_path / f"{split}.pt"
    assert run_ranks(_rank_main, split, str(out)) == {}
    return torch.load(out)


@pytest.mark.slow
def test_gradients_do_not_depend_on_the_split(tmp_path):
    module = _module()
    loss_sum, count = module(_batch(range(len(DOCS))))
    (loss_sum / count).backward()
    expected = _full_grads(module)
    for split in SPLITS:
        grads = _two_rank_grads(split, tmp_path)
        for name, want in expected.items():
            torch.testing.assert_close(grads[name], want, rtol=0, atol=1e-5, msg=f"{split}: {name}")
