"""The LightningModule: any Hugging Face causal LM with packed, sparse attention and a globally normalised loss."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from sparsebalance_pl.attention import ATTN_IMPLEMENTATION, AttentionConfig, SparseAttention
from sparsebalance_pl.context_parallel import ContextParallel
from sparsebalance_pl.cost.latency import LatencyModel
from sparsebalance_pl.cost.profiler import KernelSettings, analytic_prior, latency_model_for_run, training_dtype
from sparsebalance_pl.datamodules.packing import collate_packed, stripe_packed
from sparsebalance_pl.distributed import all_ranks, gather_floats, gather_objects
from sparsebalance_pl.errors import ConfigError, TrainingError
from sparsebalance_pl.evaluation import Evaluation
from sparsebalance_pl.loss import globally_normalised_loss
from sparsebalance_pl.metrics import TokenMeanLoss
from sparsebalance_pl.model import ModelConfig, PackedCausalLM, decoder_layers
from sparsebalance_pl.strategy import apply_fully_shard, attached_trainer

__all__ = ["OptimConfig", "SparseCausalLM"]


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


class SparseCausalLM(L.LightningModule):
    """A Hugging Face causal LM of any family that attends through transformers' ``AttentionInterface`` (Qwen2,
    Qwen3, Llama, Mistral, Gemma 3, Phi-3, ...), trained on packed micro-batches with dynamic block-sparse attention.

    Batches are packed streams of documents (see ``sparsebalance_pl.datamodules.packing``): ``input_ids``,
    ``position_ids`` (reset at each document), ``targets`` (next token within the document, -100 at document
    ends) and ``cu_seqlens``. Every layer attends through the module's ``sparse_attention``
    (``SparseAttention``): its per-layer budgets are what the dynamic sparsity tuning callback moves, and its cost
    model is the run's. The module starts that cost model from the latency table for its dimensions and kernels
    (loading or profiling it in ``setup``), lets it learn after every training micro-batch from its own
    collective-free attention timings, and checkpoints it; ``main.py`` hands it to the data module.
    ``evaluations`` are the test suites ``test`` runs (the data module builds them).

    Context parallelism (the strategy's ``context_parallel``): where the plan gives a micro-batch to a whole
    group (``shared_stream``: it holds a document longer than one rank can), ``group_share`` gives each of the
    group's ranks its block-striped share of the stream; the attention then runs the ring over the group, and
    the group's ranks attend with one budget, that of its member with the fewest kept tiles (its slowest rank
    sets the group's time). Other micro-batches train on single ranks. Test suites and density calibration run
    whole streams on each rank.

    Args:
        model: which causal LM (a preset, a family and dimensions, or a local Hugging Face directory).
        attention: dense or sparse attention and its budget.
        optim: optimiser and learning-rate schedule.
        loss_chunk_tokens: tokens per chunk of the fused LM head + cross-entropy.
        activation_checkpointing: recompute each decoder layer in the backward (long contexts on GPU).
        latency_table: JSON latency table (``sparsebalance_pl.cost.profiler``) for this device and model; a
            missing, unreadable or mismatched one is reported and replaced (see ``latency_profile``). None: the
            analytic FLOP prior at a throughput typical of the run's device.
        latency_profile: when the table is missing, or was measured on other hardware or for shorter streams,
            run the quick profile (about a minute) and save it to ``latency_table``. Off, such a table is used
            as it is (online calibration corrects it), and a missing one gives the analytic prior.
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
        self.optim_config = optim
        if loss_chunk_tokens <= 0:
            raise ConfigError(f"loss_chunk_tokens={loss_chunk_tokens} must be positive")
        self.loss_chunk_tokens = loss_chunk_tokens
        self.activation_checkpointing = activation_checkpointing
        self.dims = self.model_config.dims()
        self.sparse_attention = SparseAttention(self.dims, attention)
        self.latency_table = latency_table
        self.latency_profile = latency_profile
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0
        self.skip_update = False
        self._batch_start = 0.0
        self.net: PackedCausalLM | None = None
        self.val_loss = TokenMeanLoss()
        self.evaluations: list[Evaluation] = []
        self.save_hyperparameters()

    def configure_model(self) -> None:
        if self.net is not None:
            return
        trainer = attached_trainer(self)
        device = trainer.strategy.root_device if trainer is not None else None
        hf_model = self.model_config.build(ATTN_IMPLEMENTATION, device=device)
        if self.activation_checkpointing:
            hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.net = PackedCausalLM(hf_model, self.loss_chunk_tokens)
        mesh = self.device_mesh
        if mesh is not None:
            apply_fully_shard(self.net, decoder_layers(hf_model), mesh["data_parallel"])

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.sparse_attention.cost_model.latency = self._load_latency_model()

    def _load_latency_model(self) -> LatencyModel:
        """The table for this device and model, else the quick profile or the analytic prior for this device;
        never raises.

        The table must reach the longest stream the run trains (the data module's ``max_tokens``, as
        ``main.py profile`` measures), else the model's context length. With several ranks, rank 0 alone reads
        the table (or profiles and saves it) and hands every rank its model: ranks that predicted differently
        (one that could not read the file would take the prior) would plan different epochs and wait on each
        other's collectives forever.
        """
        device = self.trainer.strategy.root_device
        dtype = training_dtype(self.trainer.precision, device)
        kernels = KernelSettings.of(self.sparse_attention.config, device, dtype)
        config = self.model_config.hf_config()
        if self.latency_table is None:
            return analytic_prior(config, kernels)
        batching = getattr(self.trainer.datamodule, "batching", None)
        longest = getattr(batching, "max_tokens", self.dims.max_position_embeddings)
        settings = dict(profile=self.latency_profile, max_length=longest, progress=False)
        if self.trainer.world_size == 1:
            return latency_model_for_run(self.latency_table, config, kernels, **settings)
        model = None
        if self.trainer.is_global_zero:
            model = latency_model_for_run(self.latency_table, config, kernels, **settings)
        return self.trainer.strategy.broadcast(model, src=0)

    def begin_micro_batch(self, batch: dict, measure_recall: bool = False) -> SparseAttention:
        """The sparse attention, its micro-batch begun for ``batch``: at the tuned budgets in training and the base
        ones outside it; recall measured (``recall_rows``) in training, and outside it where ``measure_recall``;
        over the context-parallel group where the batch is this rank's share of a stream it shares."""
        cp = self.context_parallel if batch.get("striped", False) else ContextParallel()
        self.sparse_attention.begin(batch["cu_seqlens"], training=self.training, measure_recall=measure_recall,
                                    context_parallel=cp)
        return self.sparse_attention

    @property
    def context_parallel(self) -> ContextParallel:
        """This rank's context-parallel group, as the strategy set it up (a group of one without one)."""
        trainer = attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
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
        block_size = self.sparse_attention.config.block_size
        shard = stripe_packed(batch, world_size=cp.size, rank=cp.rank, block_size=block_size)
        return dict(shard, striped=True)

    def forward(self, batch: dict, measure_recall: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed loss and number of loss-bearing tokens of one packed micro-batch on this rank (``measure_recall``:
        outside training too)."""
        sparse = self.begin_micro_batch(batch, measure_recall)
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], sparse)

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
        """The cost model learns from this micro-batch on every rank (``SparseAttention.observe``: what attention
        kept and how long its calls took, one all-gather of a few numbers per rank), and this rank's part is
        logged: predicted and measured attention seconds, density and recall."""
        observation = self.sparse_attention.observe()
        rank = self.global_rank
        report = observation.records[rank].report
        logs = {"latency/predicted_s": observation.predicted[rank], "latency/measured_s": observation.measured[rank],
                "train/density": report.mean_density, "train/estimated_recall": report.mean_estimated_recall}
        if report.recall is not None:
            logs["train/recall"] = report.recall
        if self.context_parallel.size > 1:  # every step (0 when not shared): Lightning repeats a value not re-logged
            logs.update({"latency/ring_predicted_s": observation.ring_predicted[rank],
                         "latency/ring_wait_s": report.ring_seconds})
        for name, value in logs.items():
            self.log(name, float(value), prog_bar=name == "train/density", batch_size=1)

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch: dict, batch_idx: int) -> None:
        """Whole-batch wall time (forward, backward, optimiser step) and the global token throughput (a
        context-parallel group's ranks share their stream's tokens)."""
        seconds = time.perf_counter() - self._batch_start
        self.log("train/step_s", seconds, batch_size=1)
        tokens = batch["input_ids"].shape[1] * self.sparse_attention.stream_share(batch)
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the backward's queued kernels are not the optimiser's time
        start = time.perf_counter()
        optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = gather_floats([time.perf_counter() - start], device=self.device).max()
        cost_model = self.sparse_attention.cost_model
        cost_model.observe_step_overhead(float(seconds))
        self.log("latency/step_overhead_s", cost_model.step_overhead, batch_size=1)

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
        with self.trainer.precision_plugin.forward_context():  # in the training's precision (bf16 autocast)
            for i in range(rank, -(-len(batches) // world) * world, world):
                batch = batches[min(i, len(batches) - 1)]  # a rank short of work repeats one: forwards are collective
                self(move_data_to_device(batch, self.device), measure_recall=True)
                if i < len(batches):
                    observed.append(self.sparse_attention.record())
        self.train(was_training)
        records = [record for part in gather_objects(observed) for record in part]
        if not records:
            return
        self.sparse_attention.cost_model.observe_attention(records)
        lengths = [n for r in records for n in r.lengths]
        densities = [d for r in records for d in r.report.base_document_density]
        rank_zero_info(
            f"attention density calibrated on {len(lengths)} documents of {min(lengths)}-{max(lengths)} tokens: "
            f"mean {np.mean(densities):.3f} at the base budget"
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Skipped steps count over the whole run, across resumes, against ``max_nonfinite_steps``; the cost model
        plans the next epochs and predicts the next steps as it would have without the stop. The model's Hugging
        Face configuration lets ``main.py export`` rebuild it without the run's ``pretrained_path`` directory."""
        checkpoint["nonfinite_steps"] = self.nonfinite_steps
        checkpoint["hf_config"] = self.model_config.hf_config().to_dict()
        checkpoint["cost_model"] = self.sparse_attention.cost_model.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.nonfinite_steps = checkpoint.get("nonfinite_steps", 0)  # 0: a checkpoint from before the count was saved
        if "cost_model" in checkpoint:
            self.sparse_attention.cost_model.load_state_dict(checkpoint["cost_model"])

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss_sum, num_tokens = self(self.group_share(batch))
        self.val_loss.update(loss_sum, num_tokens)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Scores ``batch`` with the evaluation suite whose loader it came from (``batch["suite"]``)."""
        if not self.evaluations:
            raise RuntimeError("SparseCausalLM.evaluations is empty: set it to the data module's evaluations() before "
                               "test")
        self.evaluations[int(batch["suite"])].update(self, batch)

    def on_test_epoch_end(self) -> None:
        logged = {name: value for suite in self.evaluations for name, value in suite.compute().items()}
        if logged:  # summed over ranks already: sync_dist only tells Lightning so
            self.log_dict(logged, sync_dist=True)

    # ----------------------------------------------------------------------- what the evaluations call
    def answers_correct(self, batch: dict) -> torch.Tensor:
        """bool [n]: whether greedy next-token prediction reproduces each of the batch's ``answer_spans``."""
        sparse = self.begin_micro_batch(batch)
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], sparse, batch["answer_spans"])

    def greedy_next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """Each sequence's greedy next token, from one forward of them all packed into one stream."""
        batch = move_data_to_device(collate_packed([{"tokens": s} for s in sequences]), self.device)
        last = batch["cu_seqlens"][1:].long() - 1
        sparse = self.begin_micro_batch(batch)
        return self.net(batch["input_ids"], batch["position_ids"], batch["targets"], sparse, predict_at=last).tolist()

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

