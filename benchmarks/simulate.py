"""A cluster SIMULATION of SparseBalance over many data-parallel ranks: predicted times, nothing measured.

The real planner and DST controller plan one epoch for N ranks and pick every rank's budget at every step, and
each rank's time is the cost model's prediction, strayed by a log-normal factor (``sparsebalance_pl.simulation``
says how and what it cannot show). No model runs, so it reaches 64 ranks at 128K tokens.

Cluster runs (``cluster``): lengths drawn from the WLB-LLM and ProLong distributions (built in), scaled so that
their 99th percentile lands on ``--max-tokens``; Qwen2.5-0.5B dimensions; latency from a table (``--latency``,
e.g. one profiled on a GPU by ``main.py profile``) or, without one, the analytic model fitted to measured H100
times (``simulation.h100_latency``); densities from the length law of ``DensityEstimator`` scaled so that a
``--density-at``-token document has density ``--density`` (default: about what SmolLM2-135M keeps at 4,096 tokens
and tau 0.9, docs/results/smollm2-selection_cpu_2026-11-26.md)::

    python benchmarks/simulate.py cluster --ranks 8 32 64 --max-tokens 32768 131072 --out outputs/simulate
    python benchmarks/simulate.py cluster --ranks 8 --max-tokens 32768 --data wlbllm --documents 400 \
        --out outputs/simulate_quick                                    # a smoke run, seconds

The check against measurement (``check``): the planner and controller set up exactly as an emulated run of
``benchmarks/end_to_end.py --ranks N`` set them up before its first step (the settings kept in its
``results.json``, and the state its cost model and DST controller started the epoch with), their predicted
epoch time per variant beside the times that run measured; the rank noise is the spread of that run's own
calibration steps' times around their predictions. Each variant is predicted a second time after its cost model
learned every micro-batch the other variants measured: a calibration on many steps that never saw the variant
predicted::

    python benchmarks/simulate.py check --emulated outputs/e2e_emulated_8
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from sparsebalance_pl.datamodules.synthetic import LengthPrior
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.latency import LatencyModel
from sparsebalance_pl.model import PRESETS
from sparsebalance_pl.simulation import check_against_emulation, density_law, h100_latency, simulate_variant
from sparsebalance_pl.variants import BASELINE, VARIANTS, dst_settings, variant_kind


def simulate_cluster(args: argparse.Namespace) -> dict:
    """Every variant at every (distribution, length, rank count) of the command line, a line printed per cell."""
    dims = PRESETS[args.preset].dims

    def latency_of(attention: str) -> LatencyModel:
        if args.latency:
            return LatencyModel.from_file(args.latency, dims, block_size=64, stride=16)
        return h100_latency(dims, dense=attention == "dense")

    rows = []
    for data in args.data:
        prior = LengthPrior.load(data)
        for max_tokens in args.max_tokens:
            lengths = prior.sample(args.documents, np.random.default_rng(args.seed), max_tokens)
            for ranks in args.ranks:
                results = {}
                for name in args.variants:
                    attention = VARIANTS[variant_kind(name)][0]
                    density = density_law(64, args.density, args.density_at) if attention == "sparse" else None
                    results[name] = simulate_variant(
                        lengths, name, args.dst_settings[name], latency_of(attention), density,
                        num_layers=dims.num_layers, tau=args.tau, ranks=ranks, max_tokens=max_tokens,
                        defer_window=args.defer_window, prediction_error=args.prediction_error, seed=args.seed)
                rows.append({"data": data, "max_tokens": max_tokens, "ranks": ranks, "variants": results})
                print(row_line(rows[-1]), flush=True)
    return {"kind": "cluster simulation", "latency": str(args.latency or "h100_latency"), "rows": rows}


def row_line(row: dict) -> str:
    """One cell's epoch times and speed-ups, as it finishes."""
    base = row["variants"].get(BASELINE)
    cells = []
    for name, r in row["variants"].items():
        speedup = base["total_s"] / r["total_s"] if base else float("nan")
        cells.append(f"{name} {r['total_s']:.1f} s ({speedup:.2f}x)")
    bound = f", baseline's removable imbalance {base['removable_imbalance']:.3f}" if base else ""
    return f"{row['data']} {row['max_tokens']} tokens, {row['ranks']} ranks{bound}: " + "; ".join(cells)


def cluster_table(result: dict) -> str:
    """The cluster runs as one markdown table."""
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


def check_table(result: dict) -> str:
    """The check's predicted and measured times per variant, as a markdown table."""
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
                             "and by which each simulated rank's time strays from its prediction (default: about a "
                             "calibrated cost model's)")
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
        if len(set(args.variants)) != len(args.variants):
            parser.error(f"--variants {' '.join(args.variants)} names a variant twice")
        try:
            args.dst_settings = {v: dst_settings(v, args.anchor, args.p, args.recall_tolerance) for v in args.variants}
        except ConfigError as err:
            parser.error(str(err))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "cluster":
        result = simulate_cluster(args)
        table = cluster_table(result)
    else:
        try:
            result = check_against_emulation(args.emulated, args.out / "setup", args.variants)
        except ConfigError as err:
            raise SystemExit(f"error: {err}") from None
        for name, row in result["rows"].items():
            print(f"  {name}: predicted {row['predicted_s']:.1f} s, measured {row['measured_s']:.1f} s "
                  f"({row['error']:+.1%}; fitted on the other variants: {row.get('held_out_error', math.nan):+.1%})")
        table = check_table(result)
    print(table)
    (args.out / f"{args.mode}.md").write_text(table)
    (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
