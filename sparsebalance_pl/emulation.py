"""Synchronous data parallelism over N ranks, emulated on one device.

A data-parallel step is sequential in effect: every rank runs forward and backward on its own micro-batch,
gradients are averaged, one optimiser step follows, and the step lasts as long as its slowest rank. So N
ranks can be measured on one device: run the N micro-batches of a step one after another, each with its own
sparse-attention budget from the one ``DSTController`` every rank would run, time each alone (synchronised on
a GPU; recall's measurement, where the module makes it, left out; the median of ``repeats`` runs on a noisy
machine), add the gradients under the global-token normalisation (``loss.globally_normalised_loss``) and take
one optimiser step. The updates are those of a real N-rank run; the step's time is the slowest rank's
measured compute plus the measured optimiser time. Not in it: the collectives and their overlap with compute
(``allreduce_seconds`` estimates them apart, never folded into the step).

The cost model learns from every emulated rank's record as it would from the all-gather of a real run, so its
per-rank speeds, calibration and densities are the ones the real callback would have.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import seed_everything

from sparsebalance_pl.dst import DSTController
from sparsebalance_pl.cost import SparsityReport, StepObservation, StepRecord
from sparsebalance_pl.datamodules.datamodule import LongContextDataModule, PlanItems
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.datamodules.sampler import StepPlan
from sparsebalance_pl.loss import IGNORE_INDEX
from sparsebalance_pl.module import SparseCausalLM


def build(args: Sequence[str]) -> tuple[SparseCausalLM, LongContextDataModule, L.Trainer]:
    """The model (configured, its latency table loaded or profiled as in ``fit``) and the data module (built,
    connected to the model's cost model) that ``main.py fit *args`` would train, parsed and checked the same
    way, and the Trainer holding the run's settings (``gradient_clip_val``, ``max_steps``), with one device and
    nothing run. The weights are drawn after re-seeding with ``seed_everything``, so every emulated variant
    starts from the same model."""
    from sparsebalance_pl.cli import main  # the command line builds on the library, not the other way round

    cli = main([*args, "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.num_nodes=1"], run=False)
    module, data = cli.model, cli.datamodule
    module.trainer = data.trainer = cli.trainer
    seed_everything(cli.config["seed_everything"], verbose=False)
    module.configure_model()
    module.to(cli.trainer.strategy.root_device)
    module.setup("fit")
    data.prepare_data()
    data.connect(module.sparse_attention.cost_model)
    return module, data, cli.trainer


@dataclass(frozen=True)
class EmulatedStep:
    """One optimiser step of the emulated ranks.

    Attributes:
        rank_seconds: each rank's forward and backward, measured alone, over its micro-batches, less the time
            spent measuring recall (``SparsityReport.measurement_seconds``): that measurement is the benchmark's
            instrumentation, which a run without ``recall_rows`` does not spend, and a rank's time is its work.
        optimizer_seconds: gradient clipping, the optimiser and the schedule.
        tokens: tokens of the step over all ranks (padding included, as the ranks compute them).
        loss: mean loss per loss-bearing token over all ranks and micro-batches.
        round_losses: per micro-batch round, the mean loss per loss-bearing token over all ranks (what a real
            run logs as ``train/loss`` for each micro-batch).
        lengths: per rank, per micro-batch, the documents' token counts (the batches the planner gave it).
        observations: what the cost model made of each micro-batch round.
        predicted_seconds: each rank's forward and backward as DST's controller predicted them before they ran
            (NaN without a controller): how far a rank's time strays from its prediction.
        rank_draws: per rank, the seconds of each of its ``repeats`` runs in run order, over its micro-batches;
            ``rank_seconds`` is their median per micro-batch, the first run alone what one timing gives.
    """

    rank_seconds: list[float]
    optimizer_seconds: float
    tokens: int
    loss: float
    round_losses: list[float]
    lengths: list[list[list[int]]]
    observations: list[StepObservation]
    predicted_seconds: list[float]
    rank_draws: list[list[float]]

    @property
    def seconds(self) -> float:
        """The step as a real synchronous run would take it, collectives left out."""
        return max(self.rank_seconds) + self.optimizer_seconds

    @property
    def first_run_seconds(self) -> float:
        """``seconds`` with each rank timed by its first run alone, as without ``repeats``."""
        return max(draws[0] for draws in self.rank_draws) + self.optimizer_seconds


class EmulatedRanks:
    """N data-parallel ranks of ``module`` run one after another on its device.

    Args:
        module: a configured ``SparseCausalLM`` (``configure_model`` done), trained in place.
        num_ranks: how many ranks to emulate.
        total_steps: optimiser steps of the run (the learning-rate schedule's length).
        controller: DST's rule, shared by all ranks (None: the base budgets throughout).
        gradient_clip: clip the gradients to this, as ``trainer.gradient_clip_val`` does.
        gradient_clip_algorithm: ``"norm"`` (the global norm) or ``"value"`` (each element), as the Trainer's.
        repeats: run each rank's micro-batch this many times and take the median time (the lower middle of an
            even count). A shared CPU's clock strays for identical work (``experiments/timing_noise.py`` measures
            by how much), and a balanced step lasts as long as its slowest rank, so that stray, which a GPU's
            kernels hardly have, lengthens a balanced step of many ranks; the median of three narrows it. The
            extra runs' gradients are dropped.
    """

    def __init__(
        self,
        module: SparseCausalLM,
        num_ranks: int,
        total_steps: int,
        *,
        controller: DSTController | None = None,
        gradient_clip: float | None = None,
        gradient_clip_algorithm: str = "norm",
        repeats: int = 1,
    ) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks} must be at least 1")
        if repeats < 1:
            raise ValueError(f"repeats={repeats} must be at least 1")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r} must be 'norm' or 'value'")
        self.module, self.num_ranks, self.controller, self.repeats = module, num_ranks, controller, repeats
        self.gradient_clip, self.gradient_clip_algorithm = gradient_clip, gradient_clip_algorithm
        schedule = module.optimizer_and_schedule(total_steps)
        self.optimizer = schedule["optimizer"]
        self.scheduler = schedule["lr_scheduler"]["scheduler"]

    def step(self, micro_batches: Sequence[Sequence[dict]], update: bool = True) -> EmulatedStep:
        """One optimiser step over ``micro_batches[rank][micro]`` (packed batches, ``collate_packed``);
        ``update=False`` drops the gradients instead (the weights and the schedule stay), so the step only
        teaches the cost model and DST, as the steps before a measured epoch of a long run have.

        Every rank needs the same number of micro-batches, as the collectives of a real run do (the planners
        give every rank the same count). A step whose loss is not finite drops its update, as ``SparseCausalLM``
        does, and the schedule still moves on.
        """
        if len(micro_batches) != self.num_ranks:
            raise ValueError(f"a step needs {self.num_ranks} ranks' micro-batches, got {len(micro_batches)}")
        rounds = len(micro_batches[0])
        if rounds == 0 or any(len(rank) != rounds for rank in micro_batches):
            counts = [len(rank) for rank in micro_batches]
            raise ValueError(f"every rank needs the same number (at least one) of micro-batches, got {counts}")
        module, device = self.module, self.module.device
        sparse = module.sparse_attention
        module.train()
        rank_seconds, round_losses, round_counts, tokens, observations = [0.0] * self.num_ranks, [], [], 0, []
        rank_draws = [[0.0] * self.repeats for _ in range(self.num_ranks)]
        predicted_seconds = [0.0 if self.controller is not None else math.nan] * self.num_ranks
        all_lengths: list[list[list[int]]] = [[] for _ in micro_batches]
        for m in range(rounds):
            batches = [move_data_to_device(rank[m], device) for rank in micro_batches]
            lengths = [sparse.document_lengths(b) for b in batches]
            for rank, rank_lengths in enumerate(lengths):
                all_lengths[rank].append(rank_lengths)
            decision = self.controller.plan(lengths) if self.controller is not None else None
            # Lightning divides each micro-batch's loss by the accumulation; the ranks by the global token count.
            round_tokens = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in batches)
            scale = 1.0 / (max(round_tokens, 1) * rounds)
            records, round_seconds, round_loss = [], [], 0.0
            for rank, batch in enumerate(batches):
                sparse.budgets = decision.ranks[rank].budgets if decision else list(sparse.base_budgets)
                if decision:
                    predicted_seconds[rank] += decision.predicted[rank]
                seconds, draws, rank_loss, report = self._run_rank(batch, scale)
                rank_seconds[rank] += seconds
                for k, draw in enumerate(draws):
                    rank_draws[rank][k] += draw
                round_seconds.append(seconds)
                round_loss += rank_loss
                tokens += batch["input_ids"].shape[-1]
                records.append(StepRecord(lengths[rank], report))
            round_losses.append(round_loss / max(round_tokens, 1))
            round_counts.append(round_tokens)
            # alone on the device, a rank's whole forward and backward is free of collectives: it teaches every term
            observations.append(sparse.cost_model.observe(records, whole_seconds=round_seconds))
        loss = sum(r * n for r, n in zip(round_losses, round_counts)) / max(sum(round_counts), 1)
        optimizer_seconds = 0.0
        if not update:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            optimizer_seconds, _ = _timed(device, lambda: self._update(math.isfinite(loss)))
            if math.isfinite(loss):  # what the real run's optimizer_step teaches the cost model
                sparse.cost_model.observe_step_overhead(optimizer_seconds)
        return EmulatedStep(rank_seconds, optimizer_seconds, tokens, loss, round_losses, all_lengths, observations,
                            predicted_seconds, rank_draws)

    def _run_rank(self, batch: dict, scale: float) -> tuple[float, list[float], float, SparsityReport]:
        """A rank's forward and backward on ``batch``, ``repeats`` times: the median run's seconds, every run's
        (in run order; recall's measurement left out of each), the loss, and the median run's report (its
        attention seconds belong with its time). Only the last run's gradients are kept."""
        module = self.module
        parameters = [p for p in module.parameters() if p.requires_grad]
        runs = []
        for k in range(self.repeats):
            kept = [p.grad for p in parameters] if k < self.repeats - 1 else None
            if kept is not None:  # an extra run: its gradients go to fresh tensors, dropped below
                for p in parameters:
                    p.grad = None
            seconds, loss = _timed(module.device, lambda: _forward_backward(module, batch, scale))
            report = module.sparse_attention.report()
            if kept is not None:
                for p, grad in zip(parameters, kept):
                    p.grad = grad
            runs.append((seconds - report.measurement_seconds, loss, report))  # instrumentation is not the rank's
        seconds, loss, report = sorted(runs, key=lambda run: run[0])[(self.repeats - 1) // 2]
        return seconds, [run[0] for run in runs], loss, report

    def warm_up(self, batch: dict) -> None:
        """One untimed forward and backward whose gradients are dropped: a process's first pays one-time costs
        (lazy initialisation, allocator growth) that no rank of a running job pays. The cost model is left as
        it is: its own ``warmup_steps`` still leave out the first observed micro-batch's times, as in a real run."""
        loss_sum, _ = self.module(move_data_to_device(batch, self.module.device))
        loss_sum.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _update(self, finite: bool) -> None:
        """Clip and step, or drop the gradients of a step whose loss was not finite; the schedule moves on."""
        if finite:
            if self.gradient_clip is not None and self.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(self.module.parameters(), self.gradient_clip)
            elif self.gradient_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.gradient_clip)
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def step_batches(items: Sequence | PlanItems, step: StepPlan) -> list[list[dict]]:
    """A planned step's micro-batches, packed, as ``[rank][micro]`` (``items``: the data module's ``items``)."""
    return [[collate_packed([items[i] for i in mb]) for mb in rank] for rank in step.micro_batches]


@torch.no_grad()
def validation_loss(module: SparseCausalLM, data: LongContextDataModule) -> float:
    """Mean loss per loss-bearing token over the validation split, at the base budgets."""
    was_training = module.training
    module.eval()
    total, count = 0.0, 0
    for batch in data.val_dataloader():
        loss_sum, num_tokens = module(move_data_to_device(batch, module.device))
        total, count = total + float(loss_sum), count + int(num_tokens)
    module.train(was_training)
    return total / max(count, 1)


def allreduce_seconds(parameters: int, num_ranks: int, bandwidth_gbps: float, bytes_per_value: int = 4) -> float:
    """A ring all-reduce's time for the gradients (2 (N - 1) / N of their bytes through each rank's link at
    ``bandwidth_gbps`` GB/s): the collective time an emulated step leaves out, estimated, not measured."""
    if num_ranks < 1 or bandwidth_gbps <= 0:
        raise ValueError(f"num_ranks={num_ranks} must be at least 1 and bandwidth_gbps={bandwidth_gbps} positive")
    return 2.0 * (num_ranks - 1) / num_ranks * parameters * bytes_per_value / (bandwidth_gbps * 1e9)


def _forward_backward(module: SparseCausalLM, batch: dict, scale: float) -> float:
    loss_sum, _ = module(batch)
    (loss_sum * scale).backward()
    return float(loss_sum.detach())


def _timed(device: torch.device, work: Callable[[], object]) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result
