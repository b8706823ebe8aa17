"""Measure the latency table on this device, with the model's real dimensions and the real kernels.

A table is only as good as the hardware and software it was measured on (the paper's stated limitation),
so it is measured where it is used, in about a minute for the quick grid. Timed, forward + backward unless
said otherwise:

- attention core: ``block_sparse_attention`` on one document of each grid length, with masks made by
  ``select_blocks(tau=1, max_density=rho)``, the same rule the training path uses to cap density;
- selection: ``select_blocks`` on one document of each length (forward only, it is not differentiable),
  and once on a stream of several documents, to tell whether its cost follows the stream or the documents;
  attention once on a stream of several short documents too, for the fixed cost of a call (per layer);
- the rest of a layer: a one-layer model of the same family whose attention core is a no-op, at a few token
  counts (slope: seconds per token; intercept: fixed seconds per layer);
- embedding, LM head and chunked loss, at the same token counts;
- the whole model (``ModelStep``) on a few packed micro-batches of random documents and densities: the
  parts timed alone miss what joins them (layer glue, memory traffic between kernels), so the table's
  terms are scaled to fit these steps (``LatencyModel.fit_scales``) before it is saved.

Each time is the fastest of a few repetitions after a warm-up: on a shared machine contention only ever
adds time, so the minimum is the most repeatable estimate (the benchmark measures whole steps the same way).
On a CPU shared with other jobs even the minimum drifts with their load; ``clock="cpu"`` (one torch thread)
times the process's CPU time instead, which is what the wall time would be without them. A wall-clock profile
records how much other work shared its CPUs (``cost.contention``), and a table profiled beside other work is
warned about whenever it is used.
"""

from __future__ import annotations

import copy
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from transformers import AttentionInterface, PretrainedConfig

from sparsebalance_pl.cost.contention import CpuContention, measure_contention
from sparsebalance_pl.cost.latency import TERMS, LatencyModel, LatencyTable, TableMeta, cost_dims
from sparsebalance_pl.loss import chunked_cross_entropy_sum
from sparsebalance_pl.attention import ATTN_IMPLEMENTATION, AttentionConfig, SparseAttention
from sparsebalance_pl.kernels.selection import LayerBudget, selection_options
from sparsebalance_pl.model import ModelDims, PackedCausalLM, build_model
from sparsebalance_pl.progress import LoggedProgress

log = logging.getLogger(__name__)

__all__ = [
    "KernelSettings",
    "ModelStep",
    "ProfileGrid",
    "analytic_prior",
    "device_name",
    "latency_model_for_run",
    "measure_seconds",
    "profile_hardware",
    "profile_module",
    "training_dtype",
]

NOOP_ATTENTION = "sparsebalance_profile_noop"
#: Documents in the packed stream that decides the selection scope.
SCOPE_DOCS = 8
Clock = Literal["wall", "cpu"]


@dataclass(frozen=True)
class KernelSettings:
    """What a latency table times and where: the device and dtype, and the attention kernels' block size,
    selection stride and selection options. A table fits a run only for the settings it was measured with, so
    the profiler, the table's lookup and the prior all take them as this one object, built from the run's
    ``AttentionConfig`` by ``of``.

    Args:
        device: where the kernels run.
        dtype: what they compute in (``training_dtype`` of the run's precision).
        block_size: tokens per block of selection and sparse attention.
        stride: antidiagonal scoring stride of the selection.
        selection: the selection's keyword options (``kernels.selection.SELECTION_OPTIONS`` keys; the rest
            take their defaults), with which selection is timed.
    """

    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    block_size: int = 64
    stride: int = 16
    selection: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))
        object.__setattr__(self, "selection", selection_options(**self.selection))

    @classmethod
    def of(cls, attention: AttentionConfig, device: torch.device | str = "cpu",
           dtype: torch.dtype = torch.float32) -> KernelSettings:
        """The settings of a run that attends with ``attention`` on ``device`` in ``dtype``."""
        return cls(device, dtype, attention.block_size, attention.stride, attention.selection_options())


def _noop_attention(module, query, key, value, attention_mask, **kwargs):
    """Stands in for the attention core: returns q in Hugging Face's output layout, still using k and v so
    their projections get gradients as in training."""
    return query.transpose(1, 2) + 0 * (key.mean() + value.mean()), None


AttentionInterface.register(NOOP_ATTENTION, _noop_attention)


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure and how often.

    Args:
        lengths: document lengths for attention and selection (tokens).
        densities: attention densities (must end at 1.0).
        token_counts: stream lengths for the per-token fits (at least two).
        repeats: timed repetitions per cell after the warm-up.
        cell_seconds: stop repeating a cell once this much time went into it (the quick profile's bound).
        model_steps: whole-model steps the table's terms are fitted to (0: none).
        model_tokens: smallest and largest token count of those steps.
        passes: sweeps over all cells, each in a new order, keeping every cell's fastest time: a slow spell
            of a shared machine then hits different cells in each sweep instead of a whole row.
    """

    lengths: tuple[int, ...]
    densities: tuple[float, ...]
    token_counts: tuple[int, ...]
    repeats: int
    cell_seconds: float
    model_steps: int = 0
    model_tokens: tuple[int, int] = (256, 4096)
    passes: int = 1

    @classmethod
    def quick(cls, max_length: int = 8192) -> ProfileGrid:
        """About a minute for the CPU demo model: powers of two, four densities, two samples per cell, eight
        whole-model steps of up to half the longest length."""
        token_counts = (max_length // 8, max_length // 4, max_length // 2)
        return cls(_powers_of_two(256, max_length), (0.05, 0.15, 0.4, 1.0), token_counts, 2, 1.0,
                   8, (max_length // 32, max_length // 2), 2)

    @classmethod
    def full(cls, max_length: int = 8192) -> ProfileGrid:
        """Finer lengths (powers of two and their 1.5x), eight densities, five samples per cell, sixteen
        whole-model steps up to the longest length."""
        powers = _powers_of_two(128, max_length)
        lengths = tuple(sorted({*powers, *(p * 3 // 2 for p in powers if p * 3 // 2 <= max_length)}))
        densities = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
        return cls(lengths, densities, tuple(max_length // d for d in (16, 8, 4, 2)), 5, 5.0,
                   16, (max_length // 32, max_length), 3)

    def model_step_batches(self, seed: int) -> list[tuple[list[int], float]]:
        """The whole-model steps: first the extremes that tell the terms apart (one long document, dense
        and at the lowest density: attention against tokens; eight short ones at the lowest density:
        tokens and per-call costs), then random ones of 1 to 8 documents, ``model_tokens`` in total."""
        longest, low = self.model_tokens[1], self.densities[0]
        extremes = [([longest], 1.0), ([longest], low), ([longest // 8] * 8, low)]
        rng = np.random.default_rng([seed, 2])  # not the stream a benchmark's held-out batches come from
        random = random_micro_batches(max(self.model_steps - len(extremes), 0), rng, *self.model_tokens)
        return (extremes + random)[: self.model_steps]


def random_micro_batches(
    count: int, rng: np.random.Generator, min_tokens: int, max_tokens: int
) -> list[tuple[list[int], float]]:
    """(document lengths, density) pairs: 1-8 documents cut at random from ``min_tokens`` to ``max_tokens``
    tokens in total, density uniform in [0.05, 1]."""
    batches = []
    for _ in range(count):
        docs = int(rng.integers(1, 9))
        total = int(rng.integers(max(min_tokens, docs), max_tokens + 1))
        cuts = np.sort(rng.choice(np.arange(1, total), size=docs - 1, replace=False))
        batches.append((np.diff(np.concatenate([[0], cuts, [total]])).tolist(), float(rng.uniform(0.05, 1.0))))
    return batches


def _powers_of_two(low: int, high: int) -> tuple[int, ...]:
    return tuple(2**e for e in range(int(np.log2(low)), int(np.log2(high)) + 1))


def device_name(device: torch.device | str) -> str:
    """A name that changes when timings would: the GPU model, or the CPU model and torch's thread count."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def library_versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "triton", "transformers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def check_clock(clock: Clock, device: torch.device | str) -> None:
    """CPU time stands for wall time only for one torch thread on the CPU (it sums threads, and GPUs run async)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    if clock == "cpu" and (torch.device(device).type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("clock='cpu' needs device 'cpu' and torch.set_num_threads(1)")


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call of ``fn``, the device synchronised around it."""
    _synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    _synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_seconds(
    fn: Callable[[], object], *, device: torch.device, repeats: int, budget: float, clock: Clock = "wall"
) -> float:
    """Fastest of up to ``repeats`` runs of ``fn`` on ``clock`` after one warm-up run, stopping early once
    ``budget`` wall seconds went into it. A warm-up slower than ``budget`` counts as the only sample: such a
    call is long enough that its warm-up cost is noise.
    """
    pick = 0 if clock == "wall" else 1
    first = timed(fn, device)
    if first[0] > budget:
        return first[pick]
    samples, spent = [], first[0]
    while len(samples) < repeats and (not samples or spent < budget):
        sample = timed(fn, device)
        samples.append(sample[pick])
        spent += sample[0]
    return min(samples)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _KernelBench:
    """Timed workloads of the attention kernels: random q, k, v of the attention shape (heads, KV heads, head
    dimension in ``cost_dims``) on the device, whatever model they come from."""

    def __init__(self, dims, kernels: KernelSettings):
        self.shape = shape = cost_dims(dims)
        self.heads, self.kv_heads, self.head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
        self.kernels = kernels

    def _qkv(self, tokens: int, grad: bool) -> tuple[torch.Tensor, ...]:
        shapes = (self.heads, self.kv_heads, self.kv_heads)
        device, dtype = self.kernels.device, self.kernels.dtype
        return tuple(
            torch.randn(tokens, h, self.head_dim, device=device, dtype=dtype, requires_grad=grad) for h in shapes
        )

    def _documents(self, tokens: int, docs: int = 1):
        """The stream's ``PackedDocuments``, made outside the timed work as a model makes them once per micro-batch."""
        from sparsebalance_pl.kernels import PackedDocuments

        cu_seqlens = torch.linspace(0, tokens, docs + 1, device=self.kernels.device).round().to(torch.int32)
        return PackedDocuments(cu_seqlens, tokens, self.kernels.block_size)

    def attention(self, length: int, density: float, docs: int = 1) -> Callable[[], None]:
        from sparsebalance_pl.kernels import block_sparse_attention, select_blocks

        q, k, v = self._qkv(length, grad=True)
        documents = self._documents(length, docs)
        block_size = self.kernels.block_size
        mask = select_blocks(
            q.detach(), k.detach(), documents, block_size=block_size, tau=1.0, stride=self.kernels.stride,
            max_density=None if density >= 1.0 else density,
        )
        grad_out = torch.randn_like(q)

        def run() -> None:
            out = block_sparse_attention(q, k, v, mask, documents, block_size=block_size)
            out.backward(grad_out)
            q.grad = k.grad = v.grad = None

        return run

    def selection(self, tokens: int, docs: int = 1) -> Callable[[], None]:
        from sparsebalance_pl.kernels import select_blocks

        q, k, _ = self._qkv(tokens, grad=False)
        documents = self._documents(tokens, docs)
        kernels = self.kernels
        return lambda: select_blocks(q, k, documents, block_size=kernels.block_size, tau=0.9, stride=kernels.stride,
                                     **kernels.selection)


class _ModelBench(_KernelBench):
    """The kernels' workloads, and the rest of a layer and the head of a model of ``config``'s family, on inputs
    of its shapes."""

    def __init__(self, config: PretrainedConfig, kernels: KernelSettings):
        dims = ModelDims.from_hf_config(config)
        super().__init__(dims, kernels)
        self.dims = dims
        one_layer = copy.deepcopy(config)
        one_layer.num_hidden_layers = 1
        if getattr(one_layer, "layer_types", None):
            one_layer.layer_types = one_layer.layer_types[:1]
        self.model = build_model(one_layer, NOOP_ATTENTION, kernels.device).to(kernels.dtype)

    def layer_rest(self, tokens: int) -> Callable[[], None]:
        """One decoder layer (and the final norm) with a no-op attention core."""
        device, dtype = self.kernels.device, self.kernels.dtype
        x = torch.randn(1, tokens, self.dims.hidden_size, device=device, dtype=dtype, requires_grad=True)
        positions = torch.arange(tokens, device=device)[None]
        decoder = self.model.get_decoder()

        def run() -> None:
            decoder(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state.sum().backward()
            decoder.zero_grad(set_to_none=True)
            x.grad = None

        return run

    def head(self, tokens: int) -> Callable[[], None]:
        """The embedding, and the LM head with the chunked loss."""
        ids = torch.randint(0, self.dims.vocab_size, (tokens,), device=self.kernels.device)
        embedding, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()

        def run() -> None:
            loss, _ = chunked_cross_entropy_sum(embedding(ids), head.weight, ids)
            loss.backward()
            self.model.zero_grad(set_to_none=True)

        return run


class ModelStep:
    """Forward+backward of the whole model of ``config`` as training runs it (``PackedCausalLM``: sparse attention
    with ``kernels`` at tau 1 with the density capped, chunked loss) on packed micro-batches of random tokens."""

    def __init__(self, config: PretrainedConfig, kernels: KernelSettings = KernelSettings()) -> None:
        self.device = kernels.device
        hf_model = build_model(config, ATTN_IMPLEMENTATION)
        self.net = PackedCausalLM(hf_model, loss_chunk_tokens=4096).to(self.device, kernels.dtype)
        attention = AttentionConfig(backend="sparse", block_size=kernels.block_size, stride=kernels.stride, tau=1.0,
                                    **kernels.selection)
        self.dims = ModelDims.from_hf_config(config)
        self.sparse_attention = SparseAttention(self.dims, attention)

    def workload(self, lengths: list[int], density: float) -> Callable[[], None]:
        """A call that runs one step on ``lengths`` documents with at most ``density`` of each one's blocks."""
        total = sum(lengths)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=self.device)
        ids = torch.randint(0, self.dims.vocab_size, (1, total), device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])[None]
        targets = torch.cat([ids[0, 1:], ids.new_full((1,), -100)])[None]
        targets[0, cu[1:] - 1] = -100
        budgets = [LayerBudget(1.0, None if density >= 1 else density)] * self.dims.num_layers

        def run() -> None:
            self.sparse_attention.budgets = budgets
            self.sparse_attention.begin(cu, training=True)
            self.net(ids, positions, targets, self.sparse_attention)[0].backward()
            self.net.zero_grad(set_to_none=True)

        return run


def profile_hardware(
    config: PretrainedConfig,
    kernels: KernelSettings = KernelSettings(),
    *,
    quick: bool = True,
    max_length: int = 8192,
    grid: ProfileGrid | None = None,
    progress: bool = True,
    seed: int = 0,
    output: str | Path | None = None,
    clock: Clock = "wall",
) -> LatencyModel:
    """Profile this device for a model of ``config`` (its Hugging Face configuration, any supported family) with
    ``kernels`` (the run's, ``KernelSettings.of``) and return the fitted ``LatencyModel`` (saved to ``output``).

    ``grid`` overrides the quick (``quick=True``) or full grid up to ``max_length`` tokens per document;
    ``clock`` as in the module docstring.
    """
    device = kernels.device
    check_clock(clock, device)
    grid = grid or (ProfileGrid.quick(max_length) if quick else ProfileGrid.full(max_length))
    cells, scope_tokens = _kernel_cells(grid)
    cells += [(part, n, None) for part in ("layer", "head") for n in grid.token_counts]
    cells += [("model", i, None) for i in range(grid.model_steps)]
    step_batches = grid.model_step_batches(seed)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        bench = _ModelBench(config, kernels)
        whole = ModelStep(config, kernels) if grid.model_steps else None
        workloads = {
            "layer": lambda n, _: bench.layer_rest(n),
            "head": lambda n, _: bench.head(n),
            "model": lambda i, _: whole.workload(*step_batches[i]),
        }
        with measure_contention(_cores_used(device)) as contention:
            times, spread = _measure(cells, bench, workloads, grid, device, clock, progress, seed)
    counts = np.asarray(grid.token_counts, dtype=np.float64)
    token_layer, layer_overhead = _line([times[("layer", n, None)] for n in grid.token_counts], counts)
    token_head, model_overhead = _line([times[("head", n, None)] for n in grid.token_counts], counts)
    table = _table(times, grid, bench, scope_tokens, clock, (token_layer, token_head, layer_overhead, model_overhead),
                   {"timing_spread": spread, **contention.as_notes()})
    steps = [(lengths, density, times[("model", i, None)]) for i, (lengths, density) in enumerate(step_batches)]
    steps = [step for step in steps if np.isfinite(step[2])]
    model = LatencyModel(_fitted_to_steps(table, steps) if steps else table)
    if output is not None:
        model.save(output)
    warn_if_busy(model, output or "just profiled")
    return model


def profile_module(
    dims: dict,
    step: Callable[[list[int]], object],
    kernels: KernelSettings = KernelSettings(),
    *,
    max_length: int = 8192,
    grid: ProfileGrid | None = None,
    progress: bool = True,
    seed: int = 0,
    output: str | Path | None = None,
    clock: Clock = "wall",
) -> LatencyModel:
    """Profile this device for a module of any architecture that attends with SparseBalance's kernels.

    ``dims`` names the cost-relevant dimensions (``num_layers``, ``hidden_size``, ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size``); ``step(lengths)`` runs the module's
    forward and backward on one micro-batch of documents of those lengths (the device synchronised after it on
    a GPU). Attention and selection are measured with the real kernels (``kernels``) at the module's attention
    shape, as ``profile_hardware`` does; everything else comes from the module's own steps on streams of short
    documents (whose attention is nearly dense at any budget): the time left after their predicted attention
    and selection, fitted to a line in the token count, is the per-token cost and the fixed cost per step.
    """
    device = kernels.device
    check_clock(clock, device)
    grid = grid or ProfileGrid.quick(max_length)
    short = grid.lengths[0]
    cells, scope_tokens = _kernel_cells(grid)
    cells += [("step", n, None) for n in grid.token_counts]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        bench = _KernelBench(dims, kernels)
        workloads = {"step": lambda n, _: lambda: step([short] * max(n // short, 1))}
        with measure_contention(_cores_used(device)) as contention:
            times, spread = _measure(cells, bench, workloads, grid, device, clock, progress, seed)
    kernels_only = LatencyModel(_table(times, grid, bench, scope_tokens, clock, (0.0, 0.0, 0.0, 0.0), {}))
    layers = kernels_only.num_layers
    streams = [[short] * max(n // short, 1) for n in grid.token_counts]
    rest = [times[("step", n, None)] - kernels_only.predict(ls, 1.0) for n, ls in zip(grid.token_counts, streams)]
    per_token, fixed = _line(rest, np.array([sum(lengths) for lengths in streams], dtype=np.float64))
    model = LatencyModel(_table(times, grid, bench, scope_tokens, clock, (per_token / layers, 0.0, fixed / layers, 0.0),
                                {"token_costs": "module steps", "timing_spread": spread, **contention.as_notes()}))
    if output is not None:
        model.save(output)
    warn_if_busy(model, output or "just profiled")
    return model


def _cores_used(device: torch.device) -> int:
    """The CPU cores a profile keeps busy: torch's threads on a CPU, one driving a GPU."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def warn_if_busy(model: LatencyModel, where: str | Path) -> None:
    """Warns when other work shared the CPUs while the table was profiled on the wall clock
    (``CpuContention.busy``). Its times are then too slow, and the plans built on them skewed until calibration
    catches up; the table is not profiled again for this alone, since the machine may be as busy next time.
    A table timed in CPU time (``clock="cpu"``) does not count the time others took."""
    notes = model.table.meta.notes
    contention = CpuContention.from_notes(notes)
    if notes.get("clock") == "wall" and contention is not None and contention.busy:
        log.warning("latency table %s was profiled while other work took %.1f cores of its CPUs (%d left spare): "
                    "its times are too slow; profile it again on a quiet machine with `python main.py profile`",
                    where, contention.other_cores, contention.spare_cores)


def _kernel_cells(grid: ProfileGrid) -> tuple[list[tuple], int]:
    """The cells of the kernels' terms (attention over lengths and densities, selection over lengths, and the
    packed streams that decide the selection scope and an attention call's fixed cost), and the scope's length."""
    scope_tokens = grid.lengths[-2] if len(grid.lengths) > 2 else grid.lengths[-1]
    cells = (
        [("attention", n, rho) for n in grid.lengths for rho in grid.densities]
        + [("selection", n, 1) for n in grid.lengths]
        + [("selection", scope_tokens, SCOPE_DOCS), ("selection", scope_tokens // SCOPE_DOCS, 1)]
        + [("attention", SCOPE_DOCS * grid.lengths[0], 1.0, SCOPE_DOCS)]
    )
    return list(dict.fromkeys(cells)), scope_tokens  # the scope cells can repeat grid cells


def _measure(
    cells: list[tuple],
    bench: _KernelBench,
    workloads: dict[str, Callable[[int, object], Callable[[], object]]],
    grid: ProfileGrid,
    device: torch.device,
    clock: Clock,
    progress: bool,
    seed: int,
) -> tuple[dict[tuple, float], float | None]:
    """Each cell's fastest time over ``grid.passes`` sweeps in different orders, with a progress bar, and how far
    a cell's sweeps strayed from each other (the median over cells of |log(slowest / fastest)|; None with one
    sweep): how far a measured time can be from the table's for no other reason. Kernel cells are timed on
    ``bench``, the others by ``workloads[part](n, extra)``. A whole-model step that runs out of memory is timed as
    infinite (training may fit only with activation checkpointing)."""
    shuffle = np.random.default_rng([seed, 3])
    sweeps = [cells] + [[cells[i] for i in shuffle.permutation(len(cells))] for _ in range(grid.passes - 1)]
    samples: dict[tuple, list[float]] = {}
    columns = (TextColumn("profiling {task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with LoggedProgress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task("", total=len(cells) * grid.passes)
        for cell in (cell for sweep in sweeps for cell in sweep):
            part, n, extra, *docs = cell
            bar.update(task, description=f"{part} {n}" + (f" @ {extra:g}" if part == "attention" else ""))
            if part == "attention":
                workload = bench.attention(n, extra, *docs)
            elif part == "selection":
                workload = bench.selection(n, extra)
            else:
                workload = workloads[part](n, extra)
            try:
                seconds = measure_seconds(workload, device=device, repeats=grid.repeats, budget=grid.cell_seconds,
                                          clock=clock)
            except torch.OutOfMemoryError:
                if part != "model":
                    raise
                log.warning("whole-model step %d ran out of memory; left out of the fit", n)
                seconds = np.inf
            samples.setdefault(cell, []).append(seconds)
            bar.advance(task)
    spreads = [np.log(max(t) / min(t)) for t in samples.values() if len(t) > 1 and np.isfinite(t).all()]
    return {cell: min(t) for cell, t in samples.items()}, float(np.median(spreads)) if spreads else None


def _table(
    times: dict[tuple, float],
    grid: ProfileGrid,
    bench: _KernelBench,
    scope_tokens: int,
    clock: Clock,
    token_terms: tuple[float, float, float, float],
    notes: dict,
) -> LatencyTable:
    """A table from the kernel cells' timings (by ``bench``: its model shape, device, dtype and kernel settings)
    and the token terms (seconds per token of a layer and of the head, fixed seconds per layer and per
    micro-batch); the selection scope by comparison of packed and single streams."""
    token_layer, token_head, layer_overhead, model_overhead = token_terms
    packed = times[("selection", scope_tokens, SCOPE_DOCS)]
    one_doc = times[("selection", scope_tokens, 1)]
    per_doc = SCOPE_DOCS * times[("selection", scope_tokens // SCOPE_DOCS, 1)]
    scope = "stream" if abs(np.log(packed / one_doc)) <= abs(np.log(packed / per_doc)) else "document"
    # One attention call per layer serves every document of a stream, so its fixed cost (what packing
    # SCOPE_DOCS short documents into one call saves over as many calls) is per layer, not per document.
    short = grid.lengths[0]
    attention = np.array([[times[("attention", n, rho)] for rho in grid.densities] for n in grid.lengths])
    saved = SCOPE_DOCS * times[("attention", short, 1.0)] - times[("attention", SCOPE_DOCS * short, 1.0, SCOPE_DOCS)]
    call = min(max(saved / (SCOPE_DOCS - 1), 0.0), 0.9 * attention.min())  # every document still costs time
    kernels = bench.kernels
    meta = TableMeta(
        dims=bench.shape,
        block_size=kernels.block_size,
        stride=kernels.stride,
        device=device_name(kernels.device),
        dtype=_name(kernels.dtype),
        versions=library_versions(),
        source="profile",
        notes={"grid": grid.__dict__, "clock": clock, "selection_packed_vs_single": packed / one_doc,
               "attention_call_seconds": float(call), **notes},
        selection=kernels.selection,
    )
    return LatencyTable(
        meta=meta,
        lengths=np.asarray(grid.lengths, dtype=np.float64),
        densities=np.asarray(grid.densities, dtype=np.float64),
        attention=attention - call,
        selection=[times[("selection", n, 1)] for n in grid.lengths],
        token_layer=token_layer,
        token_head=token_head,
        layer_overhead=layer_overhead + call,
        model_overhead=model_overhead,
        selection_scope=scope,
    )


def _fitted_to_steps(table: LatencyTable, steps: list[tuple[list[int], float, float]]) -> LatencyTable:
    """The table with its terms scaled to fit the whole-model steps; the scales and the steps' median
    absolute percentage error before and after go into its notes."""
    parts = LatencyModel(table)
    scales = parts.fit_scales(steps)
    fitted = LatencyModel(table.scaled(scales))

    def median_error(model: LatencyModel) -> float:
        return float(np.median([abs(model.predict(n, d) / t - 1) for n, d, t in steps]))

    notes = {**table.meta.notes, "model_step_scales": dict(zip(TERMS, scales.tolist())),
             "model_step_error_parts": median_error(parts), "model_step_error_fitted": median_error(fitted)}
    return replace(fitted.table, meta=replace(table.meta, notes=notes))


def _line(seconds: list[float], counts: np.ndarray) -> tuple[float, float]:
    """(seconds per token, fixed seconds) of a least-squares line through the timings, both kept >= 0."""
    y = np.asarray(seconds)
    slope = max(float(np.polyfit(counts, y, 1)[0]), 0.0)
    return slope, max(float(np.mean(y - slope * counts)), 0.0)


def latency_model_for_run(
    path: str | Path,
    config: PretrainedConfig,
    kernels: KernelSettings,
    *,
    profile: bool = True,
    max_length: int = 8192,
    progress: bool = True,
) -> LatencyModel:
    """The latency model a training run with ``kernels`` starts from; never raises for a bad table.

    Uses the table at ``path`` when it fits the model and kernels, was measured on this device in this
    dtype and reaches documents of ``max_length`` tokens; otherwise runs the quick profile up to ``max_length``
    and saves it to ``path`` (``profile=True``), or, with profiling off, takes a fitting table from another
    device or of shorter lengths (extrapolated), or else the analytic prior. Online calibration corrects any
    of them from measured times.
    """
    here = device_name(kernels.device)
    dims = ModelDims.from_hf_config(config)
    matched = dict(block_size=kernels.block_size, stride=kernels.stride, selection=kernels.selection)
    model = LatencyModel.load_or_none(path, dims, **matched)
    unfit = None if model is None else _unfit(model, here, _name(kernels.dtype), max_length)
    if model is not None and (unfit is None or not profile):
        if unfit is not None:
            log.warning("latency table %s %s: using it, online calibration will correct it", path, unfit)
        warn_if_busy(model, path)
        return model
    if profile:
        log.warning("%sprofiling the latency table for %s into %s (quick grid)",
                    "" if unfit is None else f"latency table {path} {unfit}: ", here, path)
        return profile_hardware(config, kernels, quick=True, max_length=max_length, progress=progress, output=path)
    log.warning("no usable latency table at %s and profiling is off: using the analytic prior", path)
    return analytic_prior(config, kernels)


def analytic_prior(config: PretrainedConfig, kernels: KernelSettings) -> LatencyModel:
    """The analytic FLOP prior at a throughput typical of ``kernels``' device and dtype, so that a run without a
    table predicts accelerator times on the order of the real ones before calibration corrects them."""
    half = kernels.dtype in (torch.float16, torch.bfloat16)
    throughput = 5e10 if kernels.device.type == "cpu" else (2e14 if half else 4e13)
    return LatencyModel.analytic(
        ModelDims.from_hf_config(config), flops_per_second=throughput, device=device_name(kernels.device),
        dtype=_name(kernels.dtype), block_size=kernels.block_size, stride=kernels.stride, selection=kernels.selection,
    )


def _unfit(model: LatencyModel, device: str, dtype: str, max_length: int) -> str | None:
    """Why a table that fits the model and kernels does not fit this run's hardware, or None."""
    meta = model.table.meta
    if (meta.device, meta.dtype) != (device, dtype):
        return f"was profiled on {meta.device!r} in {meta.dtype}, this run is on {device!r} in {dtype}"
    if model.table.lengths[-1] < ProfileGrid.quick(max_length).lengths[-1]:
        return f"stops at documents of {int(model.table.lengths[-1])} tokens, this run needs {max_length}"
    return None


def training_dtype(precision: object, device: torch.device | str) -> torch.dtype:
    """The dtype attention runs in under ``trainer.precision`` on ``device`` (half precisions only on
    accelerators: the CPU runs fp32), which a latency table must be measured in."""
    precision = str(precision)
    if torch.device(device).type == "cpu":
        return torch.float32
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
