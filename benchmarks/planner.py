"""Simulate sparsity-aware batching on real document-length distributions and compare it with baselines.

For each distribution, rank count, per-rank capacity and cost model, our planner without deferral cuts
global batches from shuffled documents (epochs follow each other until ``--steps`` batches) and every
method splits exactly those batches over the ranks: the same documents per step for all, so the columns
compare partitions. Our planner cuts a batch short of the token budget when the capacity would keep it
from balancing (the documents left out open the next batch), which the ``fill`` column shows as mean
tokens per batch over the budget; the baselines get the same shorter batches. Our planner with deferral
cuts its own batches from the same stream (outliers move to later steps by design; its own fill is shown).
Every method is scored with the same evaluation cost model: balance efficiency (sum over steps of mean
rank time / sum of max), largest tokens on a rank over the capacity (> 1 overflows memory:
the baselines ignore the capacity), and planning time per global batch.

Cost models: ``sparsebalance_pl.latency.LatencyModel.analytic`` for Qwen2.5-0.5B (block 64, stride 16)
at density 1 ("dense") or at the length prior of ``DensityEstimator`` ("sparse"). The planner is given
the same cost model it is scored with. The document lengths are the WLB-LLM and ProLong samples of
``--data`` (``doclens_*.json``):

    python benchmarks/planner.py [--data ../shared/data] [--steps 200] [--window 32]
    python benchmarks/planner.py --steps 20 --ranks 8 --capacities 65536   # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from sparsebalance_pl.cost.density import DensityEstimator
from sparsebalance_pl.datamodules.partition import karmarkar_karp, partition
from sparsebalance_pl.balance import balance_efficiency
from sparsebalance_pl.datamodules.planner import GlobalBatch, PlannerConfig, plan_epoch
from sparsebalance_pl.latency import LatencyModel

QWEN25_05B = {
    "num_layers": 24,
    "hidden_size": 896,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "head_dim": 64,
}
CostFn = Callable[[np.ndarray], np.ndarray]
Method = Callable[[np.ndarray, int, int], list[list[int]]]


def cost_models() -> dict[str, CostFn]:
    latency = LatencyModel.analytic(QWEN25_05B, block_size=64, stride=16)
    density = DensityEstimator(block_size=64)
    return {
        "dense": lambda n: latency.doc_costs(n, 1.0),
        "sparse": lambda n: latency.doc_costs(n, density(n)),
    }


def round_robin(tokens: np.ndarray, ranks: int, capacity: int) -> list[list[int]]:
    return [list(range(r, tokens.size, ranks)) for r in range(ranks)]


def token_first_fit(tokens: np.ndarray, ranks: int, capacity: int) -> list[list[int]]:
    """Each document onto the first rank with room, else onto the rank with the fewest tokens (overflow)."""
    used = np.zeros(ranks)
    parts: list[list[int]] = [[] for _ in range(ranks)]
    for i, t in enumerate(tokens.tolist()):
        fits = np.flatnonzero(used + t <= capacity)
        r = int(fits[0]) if fits.size else int(np.argmin(used))
        parts[r].append(i)
        used[r] += t
    return parts


def verl_kk(tokens: np.ndarray, ranks: int, capacity: int) -> list[list[int]]:
    """Karmarkar-Karp on verl's fixed cost for a dense 7B model, blind to the capacity."""
    n = tokens.astype(np.float64)
    return karmarkar_karp(24576.0 * n + n * n, ranks)


def segment_batches(lengths: np.ndarray, cost: CostFn, config: PlannerConfig, steps: int) -> Iterator[GlobalBatch]:
    """Global batches of consecutive epochs, up to ``steps``."""
    epochs = (plan_epoch(lengths, cost, config, epoch) for epoch in itertools.count())
    return itertools.islice(itertools.chain.from_iterable(epochs), steps)


def batch_tokens(batch: GlobalBatch) -> np.ndarray:
    """Segment lengths of a global batch in arrival order (documents are shuffled, so by document index)."""
    segments = sorted(s for rank in batch.micro_batches for micro in rank for s in micro)
    return np.array([stop - start for _, start, stop in segments], dtype=np.int64)


class Score:
    """Accumulates balance efficiency, worst tokens over capacity and planning time."""

    def __init__(self) -> None:
        self.steps: list[np.ndarray] = []
        self.seconds = self.overflow = 0.0
        self.batches = 0

    def add(self, rank_costs: np.ndarray, rank_tokens: np.ndarray, capacity: int, seconds: float) -> None:
        self.steps.append(rank_costs)
        self.overflow = max(self.overflow, rank_tokens.max() / capacity)
        self.seconds += seconds
        self.batches += 1

    def cell(self) -> str:
        return f"{balance_efficiency(self.steps):.4f} {self.overflow:4.2f}x {1e3 * self.seconds / self.batches:5.1f}ms"


def run_row(
    lengths: np.ndarray, cost: CostFn, ranks: int, capacity: int, steps: int, window: int
) -> tuple[list[Score], list[float], tuple[int, int]]:
    """Scores of the baselines, ours and ours with deferral, the mean fill of our two batch streams, and on
    how many steps Karmarkar-Karp on the evaluation cost left a lighter slowest rank than ours (all, and
    those where it also stayed within the capacity)."""
    methods: list[Method] = [round_robin, token_first_fit, verl_kk, lambda t, r, c: karmarkar_karp(cost(t), r)]
    scores = [Score() for _ in range(len(methods) + 2)]
    fills: list[list[float]] = [[], []]
    kk_lighter = [0, 0]
    config = PlannerConfig(world_size=ranks, tokens_per_rank=capacity, oversize="split")
    start = time.perf_counter()
    for batch in segment_batches(lengths, cost, config, steps):
        ours_seconds = time.perf_counter() - start
        scores[-2].add(batch.costs[0], batch.tokens[0], capacity, ours_seconds)
        fills[0].append(batch.tokens.sum() / config.budget)
        tokens = batch_tokens(batch)
        costs = cost(tokens.astype(np.float64))
        for method, score in zip(methods, scores):
            tic = time.perf_counter()
            parts = method(tokens, ranks, capacity)
            elapsed = time.perf_counter() - tic
            rank_costs = np.array([costs[p].sum() for p in parts])
            rank_tokens = np.array([tokens[p].sum() for p in parts])
            score.add(rank_costs, rank_tokens, capacity, elapsed)
        if rank_costs.max() < batch.costs[0].max() * (1 - 1e-12):  # the last method: KK on the evaluation cost
            kk_lighter[0] += 1
            kk_lighter[1] += int(rank_tokens.max() <= capacity)
        start = time.perf_counter()
    deferring = PlannerConfig(world_size=ranks, tokens_per_rank=capacity, oversize="split", defer_window=window)
    start = time.perf_counter()
    for batch in segment_batches(lengths, cost, deferring, steps):
        scores[-1].add(batch.costs[0], batch.tokens[0], capacity, time.perf_counter() - start)
        fills[1].append(batch.tokens.sum() / deferring.budget)
        start = time.perf_counter()
    return scores, [float(np.mean(f)) for f in fills], (kk_lighter[0], kk_lighter[1])


def time_large_batch(lengths: np.ndarray, models: dict[str, CostFn], docs: int = 8192, ranks: int = 64) -> list[str]:
    """Median time (of 5) to partition, and to plan (planner step: cut, partition, rebalance), one global
    batch of ``docs`` documents filled to 99% of ``ranks`` ranks' capacity, for each cost model."""
    sample = np.random.default_rng(0).choice(lengths, docs).astype(np.int64)
    capacity = int(np.ceil(max(sample.sum() / ranks / 0.99, sample.max())))
    config = PlannerConfig(world_size=ranks, tokens_per_rank=capacity)
    lines = []
    for name, cost in models.items():
        costs = cost(sample.astype(np.float64))
        partition_s, plan_s = [], []
        for _ in range(5):
            tic = time.perf_counter()
            parts = partition(costs, ranks, tokens=sample, capacity=capacity)
            partition_s.append(time.perf_counter() - tic)
            tic = time.perf_counter()
            batch = next(plan_epoch(sample, cost, config, 0))
            plan_s.append(time.perf_counter() - tic)
        slowest, mean = max(costs[p].sum() for p in parts), costs.sum() / ranks
        planned = sum(len(micro) for rank in batch.micro_batches for micro in rank)
        lines.append(
            f"{docs} documents over {ranks} ranks (capacity {capacity}, 99% full), {name}: partition median "
            f"{1e3 * np.median(partition_s):.1f} ms (max/mean {slowest / mean:.4f}, bound "
            f"{max(mean, costs.max()) / mean:.4f}); planner step median {1e3 * np.median(plan_s):.1f} ms "
            f"({planned} documents kept in the batch, max/mean {batch.imbalance:.4f})"
        )
    tic = time.perf_counter()
    karmarkar_karp(models["dense"](sample.astype(np.float64)), ranks)
    kk_ms = 1e3 * (time.perf_counter() - tic)
    lines.append(f"Karmarkar-Karp (pure Python, no capacity) on the same batch: {kk_ms:.0f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    repo = Path(__file__).resolve().parent.parent
    parser.add_argument("--data", type=Path, default=repo / ".." / "shared" / "data", help="folder of doclens_*.json")
    parser.add_argument("--steps", type=int, default=200, help="global batches per row")
    parser.add_argument("--window", type=int, default=32, help="deferral window k, in steps")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--capacities", type=int, nargs="+", default=[65536, 131072])
    args = parser.parse_args()

    models = cost_models()
    names = ["round-robin", "token-first-fit", "kk-verl-cost", "kk-eval-cost", "ours", f"ours+defer{args.window}"]
    print("cell = balance efficiency, max tokens per rank / capacity, planning time per global batch;")
    print("fill = mean tokens per global batch / budget, of our batches (all but the last column) and ours+defer")
    print("kk<ours = steps where kk-eval-cost's slowest rank is lighter than ours (of which within the capacity)")
    print(f"{'data':8} {'ranks':>5} {'cap':>6} {'cost':6} " + " ".join(f"{n:>25}" for n in names) + "        fill  kk<ours")
    for source in ("wlbllm", "prolong"):
        lengths = np.asarray(json.loads((args.data / f"doclens_{source}.json").read_text()), dtype=np.int64)
        for ranks, capacity, (model, cost) in itertools.product(args.ranks, args.capacities, models.items()):
            scores, fills, (lighter, fitting) = run_row(lengths, cost, ranks, capacity, args.steps, args.window)
            head = f"{source:8} {ranks:5d} {capacity // 1024:5d}K {model:6}"
            cells = " ".join(f"{s.cell():>25}" for s in scores)
            print(f"{head} {cells} {fills[0]:.3f}/{fills[1]:.3f} {lighter:4d} ({fitting})", flush=True)
    wlb = np.asarray(json.loads((args.data / "doclens_wlbllm.json").read_text()), dtype=np.int64)
    print("\n".join(time_large_batch(wlb, models)))


if __name__ == "__main__":
    main()
