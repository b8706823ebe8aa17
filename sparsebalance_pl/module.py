"""The LightningModule: Hugging Face Qwen2 with packed, sparse attention and a globally normalised loss."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from sparsebalance_pl.attention import ATTN_IMPLEMENTATION, AttentionConfig, AttentionContext
from sparsebalance_pl.context_parallel import ContextParallel
from sparsebalance_pl.cost import CostModel, DensityEstimator, LatencyModel, SparsityReport, StepRecord, observe_step
from sparsebalance_pl.cost.profiler import latency_model_for_run, training_dtype
from sparsebalance_pl.datamodules.packing import collate_packed, stripe_packed
from sparsebalance_pl.distributed import all_ranks, gather_floats, gather_objects
from sparsebalance_pl.errors import ConfigError, TrainingError
from sparsebalance_pl.evaluation import Evaluation
from sparsebalance_pl.kernels.selection import LayerBudget
from sparsebalance_pl.loss import globally_normalised_loss
from sparsebalance_pl.metrics import TokenMeanLoss
from sparsebalance_pl.model import ModelConfig, PackedCausalLM
from sparsebalance_pl.strategy import apply_fully_shard
from sparsebalance_pl.timing import AttentionTimer


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


class SparseQwen(L.LightningModule):
    """Qwen2/Qwen2.5 causal LM trained on packed micro-batches with dynamic block-sparse attention.

    Batches are packed streams of documents (see ``sparsebalance_pl.datamodules.packing``): ``input_ids``,
    ``position_ids`` (reset at each document), ``targets`` (next token within the document, -100 at document
    ends) and ``cu_seqlens``. Budgets for the sparse attention are per layer (``layer_budgets``) so that the
    dynamic sparsity tuning callback can move them between steps (``SparsityTunable``).

    The module owns the run's ``CostModel`` (``cost_model``): it builds it for its dimensions and kernels
    (loading or profiling the latency table in ``setup``), calibrates it after every training micro-batch
    from its own collective-free attention timings, and checkpoints it. ``main.py`` hands the same object to
    the data module and the DST callback. ``evaluations`` are the test suites ``test`` runs (the data module
    builds them).

    Context parallelism (the strategy's ``context_parallel``): where the plan gives a micro-batch to a whole
    group (``shared_stream``: it holds a document longer than one rank can), ``group_share`` gives each of the
    group's ranks its block-striped share of the stream; the attention then runs the ring over the group, and
    the group's ranks attend with one budget, that of its member with the fewest kept tiles (its slowest rank
    sets the group's time). Other micro-batches train on single ranks. Test suites and density calibration run
    whole streams on each rank.

    Args:
        model: which Qwen2 (preset, overrides, or a local Hugging Face directory).
        attention: dense or sparse attention and its budget.
        optim: optimiser and learning-rate schedule.
        loss_chunk_tokens: tokens per chunk of the fused LM head + cross-entropy.
        activation_checkpointing: recompute each decoder layer in the backward (long contexts on GPU).
        latency_table: JSON latency table (``sparsebalance_pl.cost.profiler``) for this device and model; a
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
        sparse = self.attention_config.backend == "sparse"
        self.cost_model = CostModel(
            self._analytic_latency_model(),
            DensityEstimator(block_size=self.attention_config.block_size) if sparse else None,
        )
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0
        self.skip_update = False
        self._batch_start = 0.0
        self.net: PackedCausalLM | None = None
        self.val_loss = TokenMeanLoss()
        self.evaluations: list[Evaluation] = []
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
        if stage == "fit" and self.latency_table is not None:
            self.cost_model.latency = self._load_latency_model()

    def _load_latency_model(self) -> LatencyModel:
        """The table for this device and model, else the quick profile or the analytic prior; never raises.

        With profiling on, rank 0 profiles and saves the table while the others wait, then every rank loads
        the same file, so all ranks start from identical predictions.
        """
        cfg = self.attention_config
        device = self.trainer.strategy.root_device
        settings = dict(
            device=device, dtype=training_dtype(self.trainer.precision, device), block_size=cfg.block_size,
            stride=cfg.stride, max_length=self.dims.max_position_embeddings, progress=False,
            selection=cfg.selection_options(),
        )
        if self.latency_profile and self.trainer.world_size > 1:
            if self.trainer.is_global_zero:
                latency_model_for_run(self.latency_table, self.dims, profile=True, **settings)
            self.trainer.strategy.barrier("latency_profile")
        profile = self.latency_profile and self.trainer.world_size == 1
        return latency_model_for_run(self.latency_table, self.dims, profile=profile, **settings)

    def _analytic_latency_model(self) -> LatencyModel:
        cfg = self.attention_config
        return LatencyModel.analytic(self.dims, block_size=cfg.block_size, stride=cfg.stride,
                                     selection=cfg.selection_options())

    def attention_context(
        self, cu_seqlens: torch.Tensor, striped: bool = False, measure_recall: bool = False
    ) -> AttentionContext:
        """The attention's state for one forward; ``striped``: the stream is shared by the context-parallel group;
        recall is measured (``recall_rows``) in training, and outside it where ``measure_recall``."""
        cp = self.context_parallel if striped else ContextParallel()
        budgets = self.layer_budgets if self.training else self.base_budgets  # evaluate the model, not DST
        return AttentionContext(
            cu_seqlens=cu_seqlens,
            config=self.attention_config,
            budgets=_group_budgets(budgets, cp) if cp.active and self.training else budgets,
            base_budgets=self.base_budgets,
            timer=AttentionTimer(cu_seqlens.device),
            ring_timer=AttentionTimer(cu_seqlens.device) if cp.active else None,
            measurement_timer=AttentionTimer(cu_seqlens.device),
            recall_rows=self.attention_config.recall_rows if self.training or measure_recall else 0,
            context_parallel=cp,
        )

    @property
    def context_parallel(self) -> ContextParallel:
        """This rank's context-parallel group, as the strategy set it up (a group of one without one)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "context_parallel", None) or ContextParallel()

    def group_share(self, batch: dict) -> dict:
        """This rank's striped share of a stream the plan gave to its whole context-parallel group, cut once per
        micro-batch (``stripe_packed``); the batch itself otherwise."""
        cp = self.context_parallel
        if batch.get("shared_stream", 1) == 1:
            return batch
        if batch["shared_stream"] != cp.size:
            raise TrainingError(
                f"the batch plan shares a stream over {batch['shared_stream']} ranks, but this rank's "
                f"context-parallel group has {cp.size}: the data module and the strategy disagree"
            )
        shard = stripe_packed(batch, world_size=cp.size, rank=cp.rank, block_size=self.attention_config.block_size)
        return dict(shard, striped=True)

    def document_lengths(self, batch: dict) -> list[int]:
        """Token count of each document of a packed micro-batch (``SparsityTunable``)."""
        return torch.diff(batch["cu_seqlens"]).tolist()

    def stream_share(self, batch: dict) -> float:
        """The part of the batch's documents this rank computes: 1 / W of a stream its group of W shares
        (``SparsityTunable``'s optional member)."""
        return 1.0 / batch.get("shared_stream", 1)

    def sparsity_report(self) -> SparsityReport:
        """Densities, recall, attention time, ring waits and the time recall's measurement took of the last
        micro-batch (dense attention keeps every tile)."""
        ctx = self.last_context
        docs = len(ctx.cu_seqlens) - 1
        ring_seconds = 0.0 if ctx.ring_timer is None else ctx.ring_timer.seconds()
        if not ctx.stats:
            dense = [1.0] * self.dims.num_layers
            return SparsityReport(dense, dense, [1.0] * docs, ctx.timer.seconds(), ring_seconds=ring_seconds)
        layers = [ctx.stats[i] for i in sorted(ctx.stats)]
        return SparsityReport(
            density=[float(s.density) for s in layers],
            estimated_recall=[float(s.estimated_recall) for s in layers],
            base_document_density=torch.stack([s.base_document_density for s in layers]).mean(0).tolist(),
            attention_seconds=ctx.timer.seconds(),
            recall=ctx.mean_recall(),
            ring_seconds=ring_seconds,
            base_density=[float(s.base_density) for s in layers],
            base_estimated_recall=[float(s.base_estimated_recall) for s in layers],
            base_recall=ctx.mean_base_recall(),
            probe_moves=ctx.mean_probe_moves(),
            measurement_seconds=ctx.measurement_timer.seconds(),
        )

    def forward(self, batch: dict, measure_recall: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and number of loss-bearing tokens of one packed micro-batch on this rank (``measure_recall``:
        outside training too)."""
        ctx = self.attention_context(batch["cu_seqlens"], striped=batch.get("striped", False),
                                     measure_recall=measure_recall)
        self.last_context = ctx
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        batch = self.group_share(batch)
        loss_sum, num_tokens = self(batch)
        loss, reported = globally_normalised_loss(loss_sum, num_tokens)
        if torch.isfinite(reported):
            self._log_step("train", reported, batch, start)
        else:
            self._flag_nonfinite(batch_idx)
        return loss

    def on_after_backward(self) -> None:
        """The cost model learns from this micro-batch on every rank: its documents, what attention kept and
        how long the attention calls took, gathered from all ranks (one all-gather of a few numbers each)."""
        ctx = self.last_context
        lengths = torch.diff(ctx.cu_seqlens).tolist()
        group_size = ctx.context_parallel.size
        ring_predicted = self.cost_model.ring.seconds(sum(lengths), group_size)  # before it learns from this step
        report = self.sparsity_report()
        observation = observe_step(self.cost_model, lengths, report, share=1.0 / group_size)
        rank = self.global_rank
        self.log("latency/predicted_s", float(observation.predicted[rank]), batch_size=1)
        self.log("latency/measured_s", float(observation.measured[rank]), batch_size=1)
        if self.context_parallel.size > 1:  # every step (0 when not shared): Lightning repeats a value not re-logged
            self.log("latency/ring_predicted_s", ring_predicted, batch_size=1)
            self.log("latency/ring_wait_s", report.ring_seconds, batch_size=1)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Whole-batch wall time (forward, backward, optimiser step) and the global token throughput (a
        context-parallel group's ranks share their stream's tokens)."""
        seconds = time.perf_counter() - self._batch_start
        self.log("train/step_s", seconds, batch_size=1)
        tokens = batch["input_ids"].shape[1] * self.stream_share(batch)
        tokens_per_s = torch.tensor(tokens / seconds, device=self.device)
        self.log("train/tokens_per_s", tokens_per_s, batch_size=1, sync_dist=True, reduce_fx="sum")

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The usual step, unless a loss of this step was not finite: then the gradients are dropped. The
        optimiser's time (the slowest rank's) teaches the cost model the step overhead SAB weighs."""
        if optimizer_closure is not None:
            optimizer_closure()  # forward and backward, run on every rank alike so collectives stay matched
        if self.skip_update:
            optimizer.zero_grad(set_to_none=True)
            self.skip_update = False
            return
        start = time.perf_counter()
        optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = gather_floats([time.perf_counter() - start], device=self.device).max()
        self.cost_model.observe_step_overhead(float(seconds))
        self.log("latency/step_overhead_s", self.cost_model.step_overhead, batch_size=1)

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

    @torch.no_grad()
    def calibrate_density(self, batches: Sequence[dict]) -> None:
        """Forward passes over ``batches`` (the same list on every rank, shared out among the ranks) at the base
        budget; what attention did on each, gathered in rank order, teaches the cost model identically on every
        rank: every document's selected density, and, where recall is measured (``recall_rows``), the recall
        prices of each batch's lengths (``DensityCalibration`` calls this before the first epoch)."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        observed = []
        was_training = self.training
        self.eval()  # base budgets
        for i in range(rank, -(-len(batches) // world) * world, world):
            batch = batches[min(i, len(batches) - 1)]  # a rank short of work repeats one: forwards are collective
            self(move_data_to_device(batch, self.device), measure_recall=True)
            if i < len(batches):
                observed.append(StepRecord(self.document_lengths(batch), self.sparsity_report()))
        self.train(was_training)
        self.last_context = None
        records = [record for part in gather_objects(observed) for record in part]
        if not records:
            return
        self.cost_model.observe_attention(records)
        lengths = [n for r in records for n in r.lengths]
        densities = [d for r in records for d in r.report.base_document_density]
        rank_zero_info(
            f"attention density calibrated on {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens: "
            f"mean {np.mean(densities):.3f} at the base budget"
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Skipped steps count over the whole run, across resumes, against ``max_nonfinite_steps``; the cost model
        plans the next epochs and predicts the next steps as it would have without the stop. The model's
        dimensions let ``main.py export`` rebuild it without the run's ``pretrained_path`` directory."""
        checkpoint["nonfinite_steps"] = self.nonfinite_steps
        checkpoint["model_dims"] = self.dims.as_dict()
        checkpoint["cost_model"] = self.cost_model.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)  # 0: a checkpoint from before the count was saved
        if "cost_model" in checkpoint:
            self.cost_model.load_state_dict(checkpoint["cost_model"])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss_sum, num_tokens = self(self.group_share(batch))
        self.val_loss.update(loss_sum, num_tokens)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Scores ``batch`` with the evaluation suite whose loader it came from (``batch["suite"]``)."""
        if not self.evaluations:
            raise RuntimeError("SparseQwen.evaluations is empty: set it to the data module's evaluations() before test")
        self.evaluations[int(batch["suite"])].update(self, batch)

    def on_test_epoch_end(self) -> None:
        logged = {name: value for suite in self.evaluations for name, value in suite.compute().items()}
        if logged:  # summed over ranks already: sync_dist only tells Lightning so
            self.log_dict(logged, sync_dist=True)

    # ----------------------------------------------------------------------- what the evaluations call
    def answers_correct(self, batch: dict) -> torch.Tensor:
        """bool [n]: whether greedy next-token prediction reproduces each of the batch's ``answer_spans``."""
        ctx = self.attention_context(batch["cu_seqlens"])
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx, batch["answer_spans"])

    def greedy_next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """Each sequence's greedy next token, from one forward of them all packed into one stream."""
        batch = move_data_to_device(collate_packed([{"tokens": s} for s in sequences]), self.device)
        last = batch["cu_seqlens"][1:].long() - 1
        ctx = self.attention_context(batch["cu_seqlens"])
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], ctx, predict_at=last).tolist()

    def all_ranks(self, flag: bool) -> bool:
        return all_ranks(flag, self.device)

    def _log_step(self, stage: str, loss: torch.Tensor, batch: dict, start: float) -> None:
        tokens = batch["input_ids"].shape[1]
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=1)
        self.log(f"{stage}/tokens", float(tokens), batch_size=1)
        self.log(f"{stage}/documents", float(len(batch["cu_seqlens"]) - 1), batch_size=1)
        if self.context_parallel.active:  # 1: the group trained this micro-batch as one stream, 0: split over it
            self.log(f"{stage}/shared_stream", float(batch.get("striped", False)), batch_size=1)
        self.log(f"{stage}/forward_s", time.perf_counter() - start, batch_size=1)
        ctx = self.last_context
        if ctx is not None and ctx.stats:
            self.log(f"{stage}/density", ctx.mean_density(), prog_bar=True, batch_size=1)
            self.log(f"{stage}/estimated_recall", ctx.mean_estimated_recall(), batch_size=1)
            recall = ctx.mean_recall()
            if recall is not None:
                self.log(f"{stage}/recall", recall, batch_size=1)

    def configure_optimizers(self):
        return self.optimizer_and_schedule(max(1, int(self.trainer.estimated_stepping_batches)))

    def optimizer_and_schedule(self, total_steps: int) -> dict:
        """AdamW (no weight decay on vectors) and the warm-up + cosine schedule over ``total_steps`` optimiser
        steps, in Lightning's ``configure_optimizers`` format (an emulation of many ranks steps them itself)."""
        cfg = self.optim_config
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=cfg.betas,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cfg.lr_factor(step, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _group_budgets(budgets: list[LayerBudget], cp: ContextParallel) -> list[LayerBudget]:
    """One budget for the whole context-parallel group (its selection is collective and needs equal budgets):
    the budgets of the member keeping the fewest tiles (least mean ``density_scale``, then lowest mean tau),
    whose time sets the group's; the first such member on a tie."""
    members = gather_objects(budgets, group=cp.group)

    def tightness(member: list[LayerBudget]) -> tuple[float, float]:
        scales = [1.0 if b.density_scale is None else b.density_scale for b in member]
        return float(np.mean(scales)), float(np.mean([b.tau for b in member]))

    return min(members, key=tightness)
