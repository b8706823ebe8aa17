"""The LightningModule: Hugging Face Qwen2 with packed, sparse attention and a globally normalised loss."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import lightning as L
import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
import torch
from torch import nn

from sparsebalance_pl.attention import (
    ATTN_IMPLEMENTATION,
    AttentionConfig,
    AttentionContext,
    AttentionTimer,
    LayerBudget,
)
from sparsebalance_pl.callbacks.protocol import SparsityReport
from sparsebalance_pl.datamodules.density import DensityEstimator
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.errors import ConfigError, TrainingError
from sparsebalance_pl.evaluation import answer_exact_match, greedy_generate, greedy_tokens, qa_scores
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.loss import chunked_cross_entropy_sum, globally_normalised_loss
from sparsebalance_pl.metrics import CellAccuracy, CellMeans, TokenMeanLoss
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.strategy import apply_fully_shard, gather_objects


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
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        ctx: AttentionContext,
        answer_spans: torch.Tensor | None = None,
        predict_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """(summed loss, loss-bearing tokens); with ``answer_spans``, whether each answer is predicted; with
        ``predict_at``, the greedy next token at each of those stream positions."""
        hidden = self.hf.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, sb_context=ctx
        ).last_hidden_state
        if answer_spans is not None:
            return answer_exact_match(hidden[0], self.hf.lm_head.weight, input_ids[0], answer_spans)
        if predict_at is not None:
            return greedy_tokens(hidden[0], self.hf.lm_head.weight, predict_at)
        return chunked_cross_entropy_sum(hidden[0], self.hf.lm_head.weight, targets[0], self.loss_chunk_tokens)


class SparseQwen(L.LightningModule):
    """Qwen2/Qwen2.5 causal LM trained on packed micro-batches with dynamic block-sparse attention.

    Batches are packed streams of documents (see ``sparsebalance_pl.datamodules.packing``): ``input_ids``,
    ``position_ids`` (reset at each document), ``targets`` (next token within the document, -100 at document
    ends) and ``cu_seqlens``. Budgets for the sparse attention are per layer (``layer_budgets``) so that the
    dynamic sparsity tuning callback can move them between steps: the module implements
    ``sparsebalance_pl.callbacks.protocol.SparsityTunable``.

    Args:
        model: which Qwen2 (preset, overrides, or a local Hugging Face directory).
        attention: dense or sparse attention and its budget.
        optim: optimiser and learning-rate schedule.
        loss_chunk_tokens: tokens per chunk of the fused LM head + cross-entropy.
        activation_checkpointing: recompute each decoder layer in the backward (long contexts on GPU).
        latency_table: JSON latency table (``sparsebalance_pl.profiler``) for this device and model; a
            missing, unreadable or mismatched one is reported and replaced (see ``latency_profile``).
        latency_profile: when the table is missing or from other hardware, run the quick profile (about a
            minute) and save it to ``latency_table``; otherwise start from the analytic FLOP prior.
        max_nonfinite_steps: steps with a non-finite loss are skipped on every rank; more than this many in
            a run stop it with a message naming the step.
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        attention: AttentionConfig = AttentionConfig(),
        optim: OptimConfig = OptimConfig(),
        loss_chunk_tokens: int = 4096,
        activation_checkpointing: bool = False,
        latency_table: str | None = None,
        latency_profile: bool = False,
        max_nonfinite_steps: int = 10,
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
        self.base_budgets = [
            LayerBudget(self.attention_config.tau, self.attention_config.max_density)
            for _ in range(self.dims.num_layers)
        ]
        self.layer_budgets = [replace(b) for b in self.base_budgets]
        self.latency_table = latency_table
        self.latency_profile = latency_profile
        self.latency_model: LatencyModel | None = None
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0
        self.skip_update = False
        self._batch_start = 0.0
        self.density_estimator = DensityEstimator(block_size=self.attention_config.block_size)
        self.net: PackedCausalLM | None = None
        self.val_loss = TokenMeanLoss()
        self.test_loss = TokenMeanLoss()
        self.answer_accuracy: CellAccuracy | None = None
        self.longbench_scores: CellMeans | None = None
        self.last_context: AttentionContext | None = None
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.net is not None:
            return
        device = self.trainer.strategy.root_device if self._trainer is not None else None
        hf_model = self.model_config.build(ATTN_IMPLEMENTATION, device=device)
        if self.activation_checkpointing:
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.net = PackedCausalLM(hf_model, self.loss_chunk_tokens)
        mesh = self.device_mesh
        if mesh is not None:
            apply_fully_shard(self.net, list(hf_model.model.layers), mesh["data_parallel"])

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.latency_model is None:
            self.latency_model = self._load_latency_model()

    def _load_latency_model(self) -> LatencyModel:
        """The table for this device and model, else the quick profile or the analytic prior; never raises.

        With profiling on, rank 0 profiles and saves the table while the others wait, then every rank loads
        the same file, so all ranks start from identical predictions.
        """
        from sparsebalance_pl.profiler import device_name, latency_model_for_run

        cfg = self.attention_config
        device = self.trainer.strategy.root_device
        if self.latency_table is None:
            return self._analytic_latency_model(device_name(device))
        settings = dict(device=device, block_size=cfg.block_size, stride=cfg.stride, progress=False)
        if self.latency_profile and self.trainer.world_size > 1:
            if self.trainer.is_global_zero:
                latency_model_for_run(self.latency_table, self.dims, profile=True, **settings)
            self.trainer.strategy.barrier("latency_profile")
        profile = self.latency_profile and self.trainer.world_size == 1
        return latency_model_for_run(self.latency_table, self.dims, profile=profile, **settings)

    def _analytic_latency_model(self, device: str = "unknown") -> LatencyModel:
        cfg = self.attention_config
        return LatencyModel.analytic(self.dims, block_size=cfg.block_size, stride=cfg.stride, device=device)

    def attention_context(self, cu_seqlens: torch.Tensor) -> AttentionContext:
        return AttentionContext(
            cu_seqlens=cu_seqlens,
            config=self.attention_config,
            budgets=self.layer_budgets if self.training else self.base_budgets,  # evaluate the model, not DST
            base_budgets=self.base_budgets,
            timer=AttentionTimer(cu_seqlens.device),
            recall_rows=self.attention_config.recall_rows if self.training else 0,
        )

    def document_costs(self, lengths) -> np.ndarray:
        """Predicted seconds each document adds to a micro-batch, at its estimated density: what the
        sparsity-aware batch planner balances (``LongContextDataModule``)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        sparse = self.attention_config.backend == "sparse"
        density = self.density_estimator(np.maximum(lengths, 1)) if sparse else 1.0
        return (self.latency_model or self._analytic_latency_model()).doc_costs(lengths, density)

    def document_lengths(self, batch: dict) -> list[int]:
        """Token count of each document of a packed micro-batch (``SparsityTunable``)."""
        return torch.diff(batch["cu_seqlens"]).tolist()

    def sparsity_report(self) -> SparsityReport | None:
        """Densities, recall and attention time of the last micro-batch (``SparsityTunable``); None if dense."""
        ctx = self.last_context
        if ctx is None or not ctx.stats:
            return None
        layers = [ctx.stats[i] for i in sorted(ctx.stats)]
        return SparsityReport(
            density=[float(s.density) for s in layers],
            estimated_recall=[float(s.estimated_recall) for s in layers],
            base_document_density=torch.stack([s.base_document_density for s in layers]).mean(0).tolist(),
            attention_seconds=ctx.timer.seconds(),
            recall=ctx.mean_recall(),
        )

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and number of loss-bearing tokens of one packed micro-batch on this rank."""
        ctx = self.attention_context(batch["cu_seqlens"])
        self.last_context = ctx
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        loss_sum, num_tokens = self(batch)
        loss, reported = globally_normalised_loss(loss_sum, num_tokens)
        if torch.isfinite(reported):
            self._log_step("train", reported, batch, start)
        else:
            self._flag_nonfinite(batch_idx)
        return loss

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Whole-batch wall time (forward, backward, optimiser step) and the global token throughput."""
        seconds = time.perf_counter() - self._batch_start
        self.log("train/step_s", seconds, batch_size=1)
        tokens_per_s = torch.tensor(batch["input_ids"].shape[1] / seconds, device=self.device)
        self.log("train/tokens_per_s", tokens_per_s, batch_size=1, sync_dist=True, reduce_fx="sum")

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The usual step, unless a loss of this step was not finite: then the gradients are dropped."""
        if optimizer_closure is not None:
            optimizer_closure()  # forward and backward, run on every rank alike so collectives stay matched
        if self.skip_update:
            optimizer.zero_grad(set_to_none=True)
            self.skip_update = False
            return
        optimizer.step()

    def _flag_nonfinite(self, batch_idx: int) -> None:
        """Mark this step's update to be skipped because its loss is not finite on some rank.

        The reported loss is already summed over ranks, so every rank reaches the same verdict and skips the
        same update (the backward still runs everywhere, keeping the collectives of all ranks matched). A
        step counts once however many of its accumulated micro-batches were not finite.
        """
        if self.skip_update:
            return
        self.skip_update = True
        self.nonfinite_steps += 1
        self.log("train/nonfinite_steps", float(self.nonfinite_steps), batch_size=1)
        where = f"step {self.global_step} (batch {batch_idx} of epoch {self.current_epoch})"
        if self.nonfinite_steps > self.max_nonfinite_steps:
            raise TrainingError(
                f"the loss was not finite at {where}, {self.nonfinite_steps} times in this run, more than "
                f"max_nonfinite_steps={self.max_nonfinite_steps}: stopping"
            )
        rank_zero_warn(f"non-finite loss at {where}: update skipped on every rank")

    def on_fit_start(self) -> None:
        """A fresh run measures its attention density by document length before the first epoch is planned:
        the length prior can be far from what a trained model selects, and the batch planner would balance
        the wrong costs for a whole epoch. Resumed runs restore the estimate instead."""
        data = self.trainer.datamodule
        if self.attention_config.backend == "sparse" and not self.density_estimator.observed:
            if hasattr(data, "calibration_batches"):
                self.calibrate_density(data.calibration_batches(min_length=self.attention_config.block_size))

    @torch.no_grad()
    def calibrate_density(self, batches: list[dict]) -> None:
        """Forward passes over ``batches`` (the same list on every rank, shared out among the ranks) at the base
        budget; every document's selected density, gathered in rank order, corrects the density estimate
        identically on every rank."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        observed = []
        was_training = self.training
        self.eval()  # base budgets, no recall sampling
        for i in range(rank, -(-len(batches) // world) * world, world):
            batch = batches[min(i, len(batches) - 1)]  # a rank short of work repeats one: forwards are collective
            self({k: v.to(self.device) for k, v in batch.items()})
            if i < len(batches):
                observed.append((self.document_lengths(batch), self.sparsity_report().base_document_density))
        self.train(was_training)
        self.last_context = None
        documents = [doc for part in gather_objects(self.trainer, observed) for ls, ds in part for doc in zip(ls, ds)]
        if not documents:
            return
        self.density_estimator.observe([n for n, _ in documents], [d for _, d in documents])
        rank_zero_info(
            f"attention density calibrated on {len(documents)} documents of {min(n for n, _ in documents)}-"
            f"{max(n for n, _ in documents)} tokens: mean {np.mean([d for _, d in documents]):.3f} at the base budget"
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Skipped steps count over the whole run, across resumes, against ``max_nonfinite_steps``; the density
        estimate plans the next epochs as it would have without the stop. The model's dimensions let
        ``main.py export`` rebuild it without the run's ``pretrained_path`` directory."""
        checkpoint["nonfinite_steps"] = self.nonfinite_steps
        checkpoint["model_dims"] = self.dims.as_dict()
        checkpoint["density_estimator"] = self.density_estimator.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)  # 0: a checkpoint from before the count was saved
        if "density_estimator" in checkpoint:
            self.density_estimator.load_state_dict(checkpoint["density_estimator"])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, "val/loss")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Retrieval accuracy on evaluation tasks (batches with ``answer_spans``), generated answers on LongBench
        prompts (batches with ``prompts``), else the loss."""
        if "prompts" in batch:
            self._score_longbench(batch)
            return
        if "answer_spans" not in batch:
            self._evaluate(batch, self.test_loss, "test/loss")
            return
        ctx = self.attention_context(batch["cu_seqlens"])
        correct = self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx, batch["answer_spans"])
        self._answer_accuracy(batch["cells"]).update(batch["cells"], correct)

    def _answer_accuracy(self, cells: torch.Tensor) -> CellAccuracy:
        """The per-(task, length) accuracy of this test run, named by the data module's evaluation cells."""
        if self.answer_accuracy is None:
            names = getattr(getattr(self.trainer, "datamodule", None), "eval_config", None)
            names = names.cells if names is not None else [str(i) for i in range(int(cells.max()) + 1)]
            self.answer_accuracy = CellAccuracy(names).to(self.device)
        return self.answer_accuracy

    def _score_longbench(self, batch: dict) -> None:
        """Greedy answers to the packed prompts, scored by QA F1 and exact match against their references.

        Without a KV cache each new token is one forward of the whole packed micro-batch: up to
        ``eval_max_new_tokens`` forwards per micro-batch. Generation ends early only when every rank is done.
        """
        data = self.trainer.datamodule
        tokenizer = data.tokenizer
        generated = greedy_generate(
            self._greedy_next_tokens,
            batch["prompts"],
            data.eval_max_new_tokens,
            tokenizer.eos_id,
            stop=lambda finished: self.trainer.strategy.reduce_boolean_decision(finished, all=True),
        )
        scores = [qa_scores(tokenizer.decode(ids), answers) for ids, answers in zip(generated, batch["answers"])]
        if self.longbench_scores is None:
            self.longbench_scores = CellMeans(data.longbench_cells, ["f1", "exact_match"]).to(self.device)
        scored = batch["scored"]
        self.longbench_scores.update(batch["cells"][scored], torch.tensor(scores, device=self.device)[scored])

    def _greedy_next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """Each sequence's greedy next token, from one forward of them all packed into one stream."""
        batch = {k: v.to(self.device) for k, v in collate_packed([{"tokens": s} for s in sequences]).items()}
        last = batch["cu_seqlens"][1:].long() - 1
        ctx = self.attention_context(batch["cu_seqlens"])
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx, predict_at=last).tolist()

    def on_test_epoch_end(self) -> None:
        """Accuracy per task and length, and LongBench F1 and exact match per dataset and length bucket (already
        summed over ranks)."""
        logged = {}
        if self.answer_accuracy is not None:
            logged |= {f"test/accuracy/{cell}": value for cell, value in self.answer_accuracy.compute().items()}
            self.answer_accuracy = None
        if self.longbench_scores is not None:
            for score, cells in self.longbench_scores.compute().items():
                logged |= {f"test/longbench/{score}/{cell}": value for cell, value in cells.items()}
            self.longbench_scores = None
        if logged:  # equal on every rank already: sync_dist only tells Lightning so
            self.log_dict(logged, sync_dist=True)

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
            recall = ctx.mean_recall()
            if recall is not None:
                self.log(f"{stage}/recall", recall, batch_size=1)

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
