"""A cluster SIMULATION of SparseBalance over many data-parallel ranks: predicted times, nothing measured.

The real planner (``SparsityAwareSampler``: SAB, or first-fit for the baselines) plans one epoch of documents
for N ranks and the real DST controller picks every rank's budget at every step, exactly as in training; then
each rank's time is what the cost model predicts for its documents at its budget, and a step lasts as long
as its slowest rank (collectives and the optimiser left out, as in the emulation). A rank's time strays from
its prediction by a log-normal factor (``rank_noise``): a balanced step lasts as long as the rank the cost
model under-predicted most, which exact predictions would hide. No model runs, so 64 ranks at 128K tokens take
seconds. What it cannot show: a cost model wrong in a systematic way, and no online correction of the table
(the predictions stay those of the starting table and densities; only the cost model's error, which sets how
far DST trusts them, settles to the ranks' noise as in a run).

Cluster runs (``cluster``): lengths drawn from the WLB-LLM and ProLong distributions (../shared/data, built in),
scaled so that their 99th percentile lands on ``--max-tokens``; Qwen2.5-0.5B dimensions; latency from a table
(``--latency``, e.g. one profiled on a GPU by ``main.py profile``) or, without one, the analytic model fitted to
the H100 figures in docs/RESULTS.md (``h100_latency``: our Triton kernel's per-tile time and cuDNN-era
per-token time, both measured 2026-11-22); densities from the length law of ``DensityEstimator`` scaled so that
a ``--density-at``-token document has density ``--density`` (default: the real SmolLM2's 0.27 at 4,096 tokens
and tau 0.9, docs/RESULTS.md)::

    python benchmarks/simulate.py cluster --ranks 8 32 64 --max-tokens 32768 131072 --out outputs/simulate

The check against measurement (``check``): the planner and controller set up exactly as an emulated run of
``benchmarks/end_to_end.py --ranks N`` sets them up before its first step (its own arguments, kept in its
``results.json``, and the state its cost model and DST controller started the epoch with), their predicted
epoch time per variant beside the times that run measured; the rank noise is the spread of that run's own
calibration steps' times around their predictions. Each variant is predicted a second time after its cost model
learned every micro-batch the other variants measured (``fit_on_others``): a calibration on many steps that never
saw the variant predicted::

    python benchmarks/simulate.py check --emulated outputs/e2e_emulated_8
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))
from sparsebalance_pl.balance import balance_efficiency  # noqa: E402
from sparsebalance_pl.dst import DSTController  # noqa: E402
from sparsebalance_pl.cost import CostModel, DensityEstimator  # noqa: E402
from sparsebalance_pl.latency import LatencyModel  # noqa: E402
from sparsebalance_pl.datamodules.sampler import BatchingConfig, EpochPlan, PaddingItem, SparsityAwareSampler  # noqa: E402
from sparsebalance_pl.datamodules.synthetic import LengthPrior  # noqa: E402
from sparsebalance_pl.kernels.selection import LayerBudget  # noqa: E402
from sparsebalance_pl.model import PRESETS  # noqa: E402

import end_to_end  # noqa: E402
from end_to_end import BASELINE, VARIANTS, variant_kind  # noqa: E402  (the measured benchmark's)

# Measured on an H100 (docs/RESULTS.md, 2026-11-22, bf16, Qwen2.5-0.5B attention shape): our Triton attention's
# forward + backward per layer at full density on one 131,072-token document, its selection on the same, and
# the whole model's forward + backward on one 32,768-token document with dense (cuDNN) attention.
H100_ATTENTION_128K_S = 0.4684
H100_SELECTION_128K_S = 0.0202
H100_MODEL_32K_S = 0.8153
H100_CUDNN_ATTENTION_128K_S = 0.2540


def h100_latency(dims, attention_128k_s: float = H100_ATTENTION_128K_S) -> LatencyModel:
    """The analytic latency model with its throughputs fitted to the H100 figures above: the per-token terms
    to the whole-model step less its cuDNN attention, attention to ``attention_128k_s`` at full density (our
    kernel's; cuDNN's for dense attention), selection to its measured time. Linear in kept tiles: the
    kernel's fixed costs at short lengths are not in it."""
    flops = LatencyModel.analytic(dims, block_size=64, stride=16, flops_per_second=1.0, attention_efficiency=1.0)
    table = flops.table  # FLOP counts (seconds at 1 FLOP/s), the fixed overheads in seconds
    per_token = (H100_MODEL_32K_S - dims.num_layers * H100_CUDNN_ATTENTION_128K_S / 16) / 32768  # quadratic
    token_flops = table.token_layer * dims.num_layers + table.token_head
    attention_flops = np.interp(131072, table.lengths, table.attention[:, -1])
    selection_flops = np.interp(131072, table.lengths, table.selection)
    scales = [per_token / token_flops, attention_128k_s / attention_flops,
              H100_SELECTION_128K_S / selection_flops, 1.0]
    meta = replace(table.meta, device="H100 (analytic, fitted to docs/RESULTS.md)", dtype="bfloat16")
    return LatencyModel(replace(table.scaled(scales), meta=meta))


def density_law(block_size: int, density: float, at_tokens: int, exponent: float = 0.5) -> DensityEstimator:
    """The estimator's length law, (dense_blocks / blocks) ** exponent, through ``density`` at ``at_tokens``."""
    blocks = at_tokens / block_size
    return DensityEstimator(block_size=block_size, dense_blocks=blocks * density ** (1.0 / exponent),
                            exponent=exponent)


def predicted_epoch(plan: EpochPlan, lengths: np.ndarray, controller: DSTController, noise: float = 0.0,
                    seed: int = 0) -> list[list[float]]:
    """Every step's predicted seconds per rank: each micro-batch round's budgets from ``controller`` as DST
    picks them in training, each rank's time the cost model's prediction at them. After each round the cost
    model's ``error`` learns the ranks' log-normal stray of spread ``noise`` (drawn, seeded), as a live run's
    learns its measured one: DST trusts its predictions as much as the run would by then (a model started with
    a few calibration steps' large error would otherwise hold DST back all epoch)."""
    rng, steps = np.random.default_rng(seed), []
    for step in plan:
        rank_s = np.zeros(len(step.micro_batches))
        for m in range(len(step.micro_batches[0])):
            rank_s += controller.plan([_lengths(rank[m], lengths) for rank in step.micro_batches]).predicted
            if noise > 0:
                controller.cost_model.track_error(np.abs(noise * rng.standard_normal(len(step.micro_batches))))
        steps.append(rank_s.tolist())
    return steps


#: The median of |z| for a standard normal z: a log-normal spread s has median |log| of 0.6745 s.
MEDIAN_ABS_NORMAL = 0.6745


def rank_noise(log_errors: Sequence[Sequence[float]]) -> float:
    """The log-normal spread of ranks' times around their predictions, from log(measured / predicted) per step
    and rank. Each step's errors are taken about their mean: an error all ranks of a step share moves the
    epoch's time, not its balance. A robust standard deviation (the median absolute deviation over
    ``MEDIAN_ABS_NORMAL``, corrected for the centring), so one descheduled rank does not set it."""
    deviations = [np.asarray(step, dtype=np.float64) - np.mean(step) for step in log_errors if len(step) > 1]
    if not deviations:
        return 0.0
    scaled = np.concatenate([d * math.sqrt(d.size / (d.size - 1)) for d in deviations])
    return float(np.median(np.abs(scaled - np.median(scaled)))) / MEDIAN_ABS_NORMAL


def rank_noise_of_error(error: float) -> float:
    """The log-normal spread whose median |log| is ``error`` (the cost model's ``error``)."""
    return error / MEDIAN_ABS_NORMAL


def expected_epoch_seconds(steps: list[list[float]], noise: float, draws: int = 2000, seed: int = 0) -> float:
    """The sum over steps of the slowest rank's time, in expectation when every rank's time is its prediction
    times an independent log-normal factor of spread ``noise`` (median 1)."""
    if noise <= 0:
        return sum(max(r) for r in steps)
    rng = np.random.default_rng(seed)
    return sum(float((np.asarray(r) * np.exp(noise * rng.standard_normal((draws, len(r))))).max(axis=1).mean())
               for r in steps)


def summary(steps: list[list[float]], tokens: int, noise: float = 0.0) -> dict:
    """An epoch of predicted per-rank step times summed up as the emulated benchmark sums its measured ones:
    ``total_s`` with the ranks' times strayed by ``noise`` (``expected_epoch_seconds``), ``exact_s`` without."""
    total = expected_epoch_seconds(steps, noise)
    return {
        "steps": len(steps),
        "total_s": total,
        "exact_s": expected_epoch_seconds(steps, 0.0),
        "rank_noise": noise,
        "tokens": tokens,
        "tokens_per_s": tokens / total,
        "removable_imbalance": total / sum(statistics.fmean(r) for r in steps),
        "balance_efficiency": balance_efficiency(steps),
    }


def _lengths(micro_batch: list, lengths: np.ndarray) -> list[int]:
    """Token counts of a planned micro-batch's documents, padding included (the ranks compute it)."""
    return [int(lengths[item.index if isinstance(item, PaddingItem) else item]) for item in micro_batch]


def plan_tokens(plan: EpochPlan, lengths: np.ndarray) -> int:
    return sum(sum(_lengths(mb, lengths)) for step in plan for rank in step.micro_batches for mb in rank)


def simulate_cluster(args: argparse.Namespace) -> dict:
    dims = PRESETS[args.preset].dims

    def latency_of(attention: str) -> LatencyModel:
        if args.latency:
            return LatencyModel.from_file(args.latency, dims, block_size=64, stride=16)
        return h100_latency(dims, H100_CUDNN_ATTENTION_128K_S if attention == "dense" else H100_ATTENTION_128K_S)

    rows = []
    for data in args.data:
        prior = LengthPrior.load(data)
        for max_tokens in args.max_tokens:
            lengths = prior.sample(args.documents, np.random.default_rng(args.seed), max_tokens)
            for ranks in args.ranks:
                results = {}
                for name in args.variants:
                    attention, batching, _ = VARIANTS[variant_kind(name)]
                    density = density_law(64, args.density, args.density_at) if attention == "sparse" else None
                    cost = CostModel(latency_of(attention), density)
                    cost.error = args.prediction_error
                    budgets = [LayerBudget(tau=args.tau)] * dims.num_layers
                    controller = DSTController(cost, budgets, **args.dst_settings[name])
                    config = BatchingConfig(method=batching, max_tokens=max_tokens,
                                            defer_window=args.defer_window if batching == "sab" else 0)
                    plan = SparsityAwareSampler(lengths, config, cost_model=cost, seed=args.seed,
                                                num_replicas=ranks, rank=0).plan()
                    noise = rank_noise_of_error(args.prediction_error)
                    results[name] = summary(predicted_epoch(plan, lengths, controller, noise, args.seed),
                                            plan_tokens(plan, lengths), noise=noise)
                rows.append({"data": data, "max_tokens": max_tokens, "ranks": ranks, "variants": results})
                print(row_line(rows[-1]), flush=True)
    return {"kind": "cluster simulation", "latency": args.latency or "h100_latency", "rows": rows}


def row_line(row: dict) -> str:
    base = row["variants"].get(BASELINE)
    cells = []
    for name, r in row["variants"].items():
        speedup = base["total_s"] / r["total_s"] if base else float("nan")
        cells.append(f"{name} {r['total_s']:.1f} s ({speedup:.2f}x)")
    bound = f", baseline's removable imbalance {base['removable_imbalance']:.3f}" if base else ""
    return f"{row['data']} {row['max_tokens']} tokens, {row['ranks']} ranks{bound}: " + "; ".join(cells)


def cluster_table(result: dict) -> str:
    names = list(result["rows"][0]["variants"])
    lines = [
        f"SIMULATION (predicted, not measured); latency: {result['latency']}. Epoch time per variant, "
        f"speed-up against `{BASELINE}` (static sparse, first-fit) in brackets; bound = the baseline's removable "
        "imbalance (the most any balancing can gain; with rank noise, part of it no plan can remove).",
        "",
        "| data | tokens | ranks | bound | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for row in result["rows"]:
        base = row["variants"][BASELINE]
        cells = [f"{r['total_s']:.1f} s ({base['total_s'] / r['total_s']:.2f}x)" for r in row["variants"].values()]
        lines.append(f"| {row['data']} | {row['max_tokens']} | {row['ranks']} | {base['removable_imbalance']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_against_emulation(args: argparse.Namespace) -> dict:
    """Predicted epoch times of the emulated run's own plans, from the cost model and controller it started the
    epoch with, its ranks straying as much as they did around the predictions of the calibration steps."""
    emulated = json.loads((args.emulated / "results.json").read_text())
    measured = emulated["variants"]
    if "argv" not in emulated:
        raise SystemExit(f"{args.emulated}/results.json does not keep the arguments it was run with")
    e2e_args = end_to_end.parse_args([*emulated["argv"], "--out", str(args.out / "setup")])  # the last --out wins
    base = end_to_end.merged_configs(e2e_args.config)
    names = [v for v in measured if args.variants is None or v in args.variants]
    states = {}
    for name in names:
        path = end_to_end.run_folder(args.emulated, name, 0) / end_to_end.CALIBRATED_STATE
        if not path.is_file():
            raise SystemExit(f"{path} is missing: the emulated run predates the calibrated state; run it again")
        states[name] = json.loads(path.read_text())
    # one machine, one model: every variant's calibration steps measure the same spread
    noise = rank_noise([step for state in states.values() for step in state["residuals"]])
    rows = {}
    for name in names:
        _, data, _, controller, plan = end_to_end.prepare_emulated(base, name, e2e_args, 0, calibrated=states[name])
        lengths = np.asarray(data.lengths("train"))
        tokens = plan_tokens(plan, lengths)

        def predict() -> dict:
            return summary(predicted_epoch(plan, lengths, controller, noise), tokens, noise)

        predicted = predict()
        got = measured[name]
        compute = sum(max(step["rank_s"]) for step in got["steps"])  # the emulation's step less its optimiser
        mean_ranks = [statistics.fmean(step["rank_s"]) for step in got["steps"]]
        # the ceiling of any planner for this work: every step's rank-seconds shared evenly, the ranks straying
        balanced = expected_epoch_seconds([[m] * len(s["rank_s"]) for m, s in zip(mean_ranks, got["steps"])], noise)
        rows[name] = {"predicted_s": predicted["total_s"], "exact_s": predicted["exact_s"],
                      "measured_s": compute, "error": predicted["total_s"] / compute - 1.0, "balanced_s": balanced,
                      "predicted_bound": predicted["removable_imbalance"],
                      "measured_bound": compute / sum(mean_ranks)}
        # planning moved the controller's shifts and the cost model's error: start over from the saved state
        controller.load_state_dict(states[name]["controller"])
        controller.cost_model.load_state_dict(states[name]["cost_model"])
        replayed = fit_on_others(controller.cost_model, measured, name)
        if replayed:
            held_out = predict()["total_s"]
            rows[name].update(held_out_s=held_out, held_out_error=held_out / compute - 1.0, replayed_rounds=replayed)
        print(f"  {name}: predicted {predicted['total_s']:.1f} s, measured {compute:.1f} s "
              f"({rows[name]['error']:+.1%}; fitted on the other variants: "
              f"{rows[name].get('held_out_error', math.nan):+.1%})", flush=True)
    if BASELINE in rows:  # the speed-up over the baseline that balancing each variant's own work would give
        for row in rows.values():
            row["noise_ceiling"] = rows[BASELINE]["measured_s"] / row["balanced_s"]
    return {"kind": "simulation checked against emulation", "emulated": str(args.emulated), "rank_noise": noise,
            "rows": rows}


def fit_on_others(cost_model: CostModel, measured: dict, name: str) -> int:
    """Teach ``cost_model`` every micro-batch round the other variants of the run measured, in the run's order:
    a calibration on many steps of several plans' batch shapes that never saw the variant it then predicts.
    Returns how many rounds it learned from (0 for a run that did not keep them)."""
    rounds = [r for other, got in measured.items() if other != name for step in got["steps"]
              for r in step.get("rounds", [])]
    cost_model.warmup_left = 0  # measured steps, warm already
    for step in rounds:
        cost_model.replay(step)
    return len(rounds)


def check_table(result: dict) -> str:
    lines = [
        f"Simulation against the emulated run {result['emulated']} (same configuration, documents, plans, and the "
        "cost model and DST controller it started the epoch with): predicted and measured compute time over the "
        "epoch (slowest rank per step, optimiser left out), and the removable imbalance each sees. Predicted: "
        f"each rank's time strays log-normally by {result['rank_noise']:.3f}, the spread of the ranks' times "
        "around their predictions in the variants' calibration steps; exact: every rank as predicted. Fitted on "
        "the others: the same prediction after the cost model learned every micro-batch the other variants "
        "measured in their epochs (never this variant's). Balanced: the variant's measured rank-seconds shared "
        "evenly in every step, the ranks straying as predicted (no planner can beat it in expectation); noise "
        f"ceiling: `{BASELINE}`'s measured time over that balanced time.",
        "",
        "| variant | exact s | predicted s | measured s | error | fitted on the others s | error | "
        "predicted bound | measured bound | balanced s | noise ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["rows"].items():
        held_out = (f"{r['held_out_s']:.1f} | {r['held_out_error']:+.1%}" if "held_out_s" in r else "- | -")
        lines.append(f"| {name} | {r['exact_s']:.1f} | {r['predicted_s']:.1f} "
                     f"| {r['measured_s']:.1f} | {r['error']:+.1%} | {held_out} | {r['predicted_bound']:.3f} "
                     f"| {r['measured_bound']:.3f} | {r['balanced_s']:.1f} | "
                     + (f"{r['noise_ceiling']:.3f}x |" if "noise_ceiling" in r else "- |"))
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("cluster", "check"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32768, 131072],
                        help="longest document and micro-batch")
    parser.add_argument("--data", nargs="+", default=["wlbllm", "prolong"], choices=LengthPrior.BUILTIN)
    parser.add_argument("--documents", type=int, default=4000, help="cluster: documents in the simulated epoch")
    parser.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--latency", type=Path, default=None, help="cluster: a profiled latency table (JSON)")
    parser.add_argument("--density", type=float, default=0.27, help="cluster: density at --density-at tokens")
    parser.add_argument("--density-at", type=int, default=4096)
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--defer-window", type=int, default=8, help="cluster: SAB's deferral window")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--anchor", default="mean")
    parser.add_argument("--prediction-error", type=float, default=0.06,
                        help="cluster: the cost model's error (median |log(measured / predicted)|) that DST assumes "
                             "and by which each simulated rank's time strays from its prediction (calibrated: the "
                             "worked example measured 0.06-0.09)")
    parser.add_argument("--recall-tolerance", type=float, default=0.02,
                        help="cluster: the adaptive anchor's allowance for predicted loss of token-weighted recall")
    parser.add_argument("--variants", nargs="+", default=None, metavar="NAME[:key=value,...]",
                        help="variants as end_to_end.py takes them (cluster default: all of "
                             f"{', '.join(VARIANTS)}; check default: every variant the emulated run measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulated", type=Path, help="check: the --out folder of an emulated end_to_end run")
    parser.add_argument("--out", type=Path, default=Path("outputs/simulate"))
    args = parser.parse_args(argv)
    if args.mode == "check" and args.emulated is None:
        parser.error("check needs --emulated, the --out folder of an emulated end_to_end.py run")
    if args.mode == "cluster":
        args.variants = args.variants or list(VARIANTS)
        end_to_end.check_variants(parser, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "cluster":
        result, table = simulate_cluster(args), None
        table = cluster_table(result)
    else:
        result = check_against_emulation(args)
        table = check_table(result)
    print(table)
    (args.out / f"{args.mode}.md").write_text(table)
    (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
