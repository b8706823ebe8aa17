"""The model on a GPU: compiled Triton kernels inside Qwen2, and a short Lightning fit (skipped without CUDA).

CI has no GPU; these run wherever one exists (and ran on an H100, see the issue notes).
"""

import lightning as L
from lightning.fabric.utilities.apply_func import move_data_to_device
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import OptimConfig, SparseCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}


def _module(backend: str, tau: float = 0.9) -> SparseCausalLM:
    torch.manual_seed(0)
    module = SparseCausalLM(
        model=ModelConfig(preset="demo", overrides=TINY),
        attention=AttentionConfig(backend=backend, tau=tau),
        optim=OptimConfig(lr=2e-3, warmup_steps=2),
    )
    module.configure_model()
    return module


def _documents(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    """Each document repeats a short random phrase over 32 of the tokens, so a few steps of training visibly
    lower the loss (from about ln(vocab) towards ln(32) and below)."""
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        phrase = rng.integers(0, min(vocab, 32), size=int(rng.integers(8, 32)))
        docs.append({"tokens": np.resize(phrase, n)})
    return docs


def test_sparse_at_tau_one_matches_dense_on_cuda():
    dense, sparse = _module("dense").cuda(), _module("sparse", tau=1.0).cuda()
    sparse.net.load_state_dict(dense.net.state_dict())
    # a packed batch also carries plain numbers (its shared-stream count): move it as Lightning does
    batch = move_data_to_device(collate_packed(_documents([1500, 700, 1900], dense.dims.vocab_size, 0)), "cuda")
    with torch.no_grad():
        (a, _), (b, _) = dense(batch), sparse(batch)
    assert torch.isfinite(b) and abs(float(a - b)) / float(a) <= 1e-4
    assert sparse.sparse_attention.micro_batch.mean_density() == pytest.approx(1.0)


def test_lightning_fit_on_gpu_with_sparse_attention(tmp_path):
    module = _module("sparse", tau=0.8)
    batches = [collate_packed(_documents([1024, 2048, 700, 324], module.dims.vocab_size, s)) for s in range(24)]
    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=24, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, DataLoader(batches, batch_size=None, shuffle=False))
    assert len(losses) == 24 and all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4])
    assert module.sparse_attention.micro_batch.mean_density() < 1.0
