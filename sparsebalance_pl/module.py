"""The LightningModule: Hugging Face Qwen2 with packed, sparse attention and a globally normalised loss."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch import nn

from sparsebalance_pl.attention import ATTN_IMPLEMENTATION, AttentionConfig, AttentionContext, LayerBudget
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.loss import chunked_cross_entropy_sum, globally_normalised_loss
from sparsebalance_pl.metrics import TokenMeanLoss
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.strategy import apply_fully_shard


@dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``.

    Args:
        lr: peak learning rate.
        weight_decay: applied to matrices only (not to norms and biases).
        betas: AdamW betas.
        warmup_steps: optimiser steps of linear warm-up from 0.
        min_lr_ratio: final learning rate as a fraction of the peak.
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")

    def lr_factor(self, step: int, total_steps: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class PackedCausalLM(nn.Module):
    """Qwen2 backbone and LM head computing the summed loss of one packed stream.

    This is the FSDP root: calling the backbone and the head inside one forward keeps the tied
    embedding/head weight gathered for both.
    """

    def __init__(self, hf_model: nn.Module, loss_chunk_tokens: int) -> None:
        super().__init__()
        self.hf = hf_model
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, sb_context=ctx
        ).last_hidden_state
        return chunked_cross_entropy_sum(hidden[0], self.hf.lm_head.weight, targets[0], self.loss_chunk_tokens)


class SparseQwen(L.LightningModule):
    """Qwen2/Qwen2.5 causal LM trained on packed micro-batches with dynamic block-sparse attention.

    Batches are packed streams of documents (see ``sparsebalance_pl.datamodules.packing``): ``input_ids``,
    ``position_ids`` (reset at each document), ``targets`` (next token within the document, -100 at document
    ends) and ``cu_seqlens``. Budgets for the sparse attention are per layer (``layer_budgets``) so that the
    dynamic sparsity tuning callback can move them between steps.

    Args:
        model: which Qwen2 (preset, overrides, or a local Hugging Face directory).
        attention: dense or sparse attention and its budget.
        optim: optimiser and learning-rate schedule.
        loss_chunk_tokens: tokens per chunk of the fused LM head + cross-entropy.
        activation_checkpointing: recompute each decoder layer in the backward (long contexts on GPU).
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        attention: AttentionConfig = AttentionConfig(),
        optim: OptimConfig = OptimConfig(),
        loss_chunk_tokens: int = 4096,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.model_config = model
        self.attention_config = attention
        self.optim_config = optim
        if loss_chunk_tokens <= 0:
            raise ConfigError(f"loss_chunk_tokens={loss_chunk_tokens} must be positive")
        self.loss_chunk_tokens = loss_chunk_tokens
        self.activation_checkpointing = activation_checkpointing
        self.dims = self.model_config.dims()
        self.layer_budgets = [
            LayerBudget(self.attention_config.tau, self.attention_config.max_density)
            for _ in range(self.dims.num_layers)
        ]
        self.net: PackedCausalLM | None = None
        self.val_loss = TokenMeanLoss()
        self.test_loss = TokenMeanLoss()
        self.last_context: AttentionContext | None = None
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.net is not None:
            return
        device = self.trainer.strategy.root_device if self._trainer is not None else None
        hf_model = self.model_config.build(ATTN_IMPLEMENTATION, device=device)
        if self.activation_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.net = PackedCausalLM(hf_model, self.loss_chunk_tokens)
        mesh = self.device_mesh
        if mesh is not None:
            apply_fully_shard(self.net, list(hf_model.model.layers), mesh["data_parallel"])

    def attention_context(self, cu_seqlens: torch.Tensor) -> AttentionContext:
        return AttentionContext(cu_seqlens=cu_seqlens, config=self.attention_config, budgets=self.layer_budgets)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and number of loss-bearing tokens of one packed micro-batch on this rank."""
        ctx = self.attention_context(batch["cu_seqlens"])
        self.last_context = ctx
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        loss_sum, num_tokens = self(batch)
        loss, reported = globally_normalised_loss(loss_sum, num_tokens)
        self._log_step("train", reported, batch, start)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, "val/loss")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, "test/loss")

    def _evaluate(self, batch: dict, metric: TokenMeanLoss, name: str) -> None:
        loss_sum, num_tokens = self(batch)
        metric.update(loss_sum, num_tokens)
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)

    def _log_step(self, stage: str, loss: torch.Tensor, batch: dict, start: float) -> None:
        tokens = batch["input_ids"].shape[1]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=1)
        self.log(f"{stage}/tokens", float(tokens), batch_size=1)
        self.log(f"{stage}/documents", float(len(batch["cu_seqlens"]) - 1), batch_size=1)
        self.log(f"{stage}/forward_s", time.perf_counter() - start, batch_size=1)
        ctx = self.last_context
        if ctx is not None and ctx.stats:
            self.log(f"{stage}/density", ctx.mean_density(), prog_bar=True, batch_size=1)
            self.log(f"{stage}/estimated_recall", ctx.mean_estimated_recall(), batch_size=1)

    def configure_optimizers(self):
        cfg = self.optim_config
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=cfg.betas,
        )
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cfg.lr_factor(step, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
