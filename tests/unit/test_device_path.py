"""A whole training micro-batch of the module on the device path (Triton kernels; the interpreter's on the CPU, its
tensors standing in for a device's): from the first decoder layer's forward to the last one's, and from the last
one's backward to the first one's, nothing is read back from the device. The one read a step needs, for logging
after the backward, lies outside."""

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from attention_cases import TRITON_OK, device_for

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.kernels import LayerBudget
from sparsebalance_pl.kernels.launches import count_launches
from sparsebalance_pl.model import ModelConfig, decoder_layers
from sparsebalance_pl.module import SparseCausalLM

TINY = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("moved", [False, True], ids=["base budgets", "budgets moved by DST"])
def test_no_host_read_inside_the_layers_forward_or_backward(moved):
    torch.manual_seed(0)
    module = SparseCausalLM(model=ModelConfig(preset="demo", overrides=TINY),
                            attention=AttentionConfig(block_size=16, stride=8, kernel_backend="triton"))
    module.configure_model()
    device = device_for("triton")  # a GPU where there is one, else the interpreter on the CPU
    module.to(device)
    if moved:  # what DST writes before a micro-batch: another tau and a tile bound in every layer
        budgets = module.sparse_attention.budgets
        budgets[:] = [LayerBudget(0.95, None, 0.7) for _ in budgets]
    rng = np.random.default_rng(0)
    batch = move_data_to_device(collate_packed([{"tokens": rng.integers(0, 512, n)} for n in (40, 60, 28)]), device)
    layers = decoder_layers(module.net.hf)
    reads = {}
    with count_launches(as_device=True) as count:
        def mark(name):
            return lambda *args: reads.setdefault(name, count.host_syncs) and None

        hooks = [layers[0].register_forward_pre_hook(mark("forward starts")),
                 layers[-1].register_forward_hook(mark("forward ends")),
                 layers[-1].register_full_backward_pre_hook(mark("backward starts")),
                 layers[0].register_full_backward_hook(mark("backward ends"))]
        loss, tokens = module(batch)
        (loss / tokens).backward()
    for hook in hooks:
        hook.remove()
    assert reads["forward ends"] == reads["forward starts"], count.syncs
    assert reads["backward ends"] == reads["backward starts"], count.syncs
    assert module.sparse_attention.report().density  # the layers did select
