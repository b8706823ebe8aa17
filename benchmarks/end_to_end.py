"""SparseBalance against its baselines, every variant training the same model on the same data.

Every variant is the demo configuration (or ``--config``'s) changed only in how the documents are batched and
whether DST moves the budgets (``sparsebalance_pl.variants``), with the same model, data, seed and number of steps:

    dense            dense attention, token first-fit packing
    static           static sparse attention, first-fit packing (the baseline)
    sab              static sparse, sparsity-aware batching
    dst              sparse with dynamic sparsity tuning, first-fit packing
    sparsebalance    SAB + DST

By default each variant is a real ``python main.py fit`` run (2 FSDP2 ranks on the CPU; ``--devices`` and
``--accelerator`` for GPUs). Static variants run the DST callback with p = 0, so it only measures: every variant
logs the same per-rank attention times (collective-free), from which measured imbalance and balance efficiency
come. All variants start from ``--init`` (a Hugging Face directory, e.g. ``main.py export`` of a demo checkpoint
trained until its attention is sharp by configs/experiments/sharp.yaml) or from random initialisation
(``--init none``); the regime line gives the baseline's mean density and recall at the base budget, its
predicted whole-step imbalance across ranks (the most any balancing can gain), how many of its steps are
imbalanced, and the share of the step its slowest rank spends in attention. Per variant: median step time after
``--warmup`` steps, global tokens per second (and its ratio to the baseline: the speed-up per token), measured
imbalance, balance efficiency, final training loss (mean of the last 5 steps) and validation loss, mean exact
recall (sampled rows). Ratios are against the static baseline of the same invocation. Writes ``results.json``,
``table.md`` and PNG plots to ``--out``. Timings on a shared machine drift: ``--rounds`` repeats the whole set
of variants in turn.

    python benchmarks/end_to_end.py --init outputs/sharp/hf --steps 60 --out outputs/e2e_sharp
    python benchmarks/end_to_end.py --init outputs/sharp/hf --epoch-documents 300 --out outputs/e2e_epoch
    python benchmarks/end_to_end.py --init none --steps 30 --out outputs/e2e_random

``--ranks N`` emulates N data-parallel ranks in this one process instead (``sparsebalance_pl.comparison`` over
``sparsebalance_pl.emulation``): the real planner plans for N ranks, each rank's micro-batch runs forward and
backward alone with its own DST budget (one controller for all), gradients add up under the global-token
normalisation and one optimiser step follows. A step's time is its slowest rank's measured compute plus the
measured optimiser time; the collectives are left out and estimated apart (a ring all-reduce of the gradients at
``--bandwidth-gbps``). The variants' steps take turns, so a drift in the machine's speed reaches them all. Then
``results.json`` holds every step's per-rank seconds and what the cost model learned from each micro-batch round,
with the settings that set each variant up again (``benchmarks/simulate.py check`` predicts the same plans):

    python benchmarks/end_to_end.py --ranks 8 --config configs/demo.yaml \
        --config configs/experiments/narrow16k.yaml --epoch-documents 400 --out outputs/e2e_emulated_8
    python benchmarks/end_to_end.py --ranks 2 --epoch-documents 40 --max-tokens 1024 --warmup 1 \
        --variants static sparsebalance --out outputs/e2e_quick            # a smoke run

A tuning variant may carry DST settings of its own, so that several settings compare in one run on the same
machine state: ``--variants static sparsebalance sparsebalance:anchor=adaptive``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from sparsebalance_pl.balance import balance_efficiency, imbalance  # noqa: E402
from sparsebalance_pl.comparison import emulate_variants, regime, save_results  # noqa: E402
from sparsebalance_pl.errors import ConfigError  # noqa: E402
from sparsebalance_pl.variants import (  # noqa: E402
    BASELINE, VARIANT_SETTINGS, VARIANTS, ComparisonSettings, merged_configs, run_folder, variant_config,
)

ROOT = Path(__file__).resolve().parents[1]
IMBALANCED = 1.05  # a step whose predicted max / mean across ranks exceeds this counts as imbalanced
SETTINGS = ("init", "steps", "epoch_documents", "max_tokens", "warmup", "p", "anchor", "recall_tolerance",
            "recall_rows", "devices", "accelerator", "ranks", "calibrate_steps", "frozen", "repeats",
            "bandwidth_gbps")
"""The arguments that make up the comparison's ``ComparisonSettings``, besides its configurations and variants."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, action="append", help="configuration files, stacked in order as "
                        "`main.py fit --config a --config b` does (default: configs/demo.yaml)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="emulate this many data-parallel ranks in one process (see above)")
    parser.add_argument("--calibrate-steps", type=int, default=0,
                        help="with --ranks: steps of another epoch's documents run first without updating the "
                             "weights, so the cost model and DST start the measured epoch calibrated, as in the "
                             "middle of a long run; the epoch is planned after them")
    parser.add_argument("--frozen", action="store_true",
                        help="with --ranks: the epoch's steps leave the weights as they are (no optimiser step, whose "
                             "time then counts as zero), so every variant attends with the same model and its "
                             "speed and recall are the planner's and DST's alone; in a training epoch the "
                             "batches' order also changes how fast attention sharpens. Validation loss then stays "
                             "the initial model's")
    parser.add_argument("--threads", type=int, default=None,
                        help="with --ranks: the process's intra-op threads (default: torch's, one per core); one "
                             "thread times a micro-batch more steadily on a shared machine")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --ranks: time each rank's micro-batch as the median of this many runs (the extra "
                             "runs' gradients dropped): identical work strays on a shared CPU "
                             "(experiments/timing_noise.py measures by how much), which a balanced step pays as its "
                             "slowest rank's excess; results.json keeps every run's time, and the total a single "
                             "run gives")
    parser.add_argument("--bandwidth-gbps", type=float, default=50.0,
                        help="per-rank link bandwidth for the emulation's all-reduce estimate (GB/s)")
    parser.add_argument("--init", default="none", help="Hugging Face model directory, or 'none' for random init")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--epoch-documents", type=int, default=None,
                        help="instead of --steps: one whole epoch over a corpus of this many documents (files of a "
                             "'source: installed' corpus, which splits a long one), so every variant trains on "
                             "exactly the same documents and the speed-up is of the epoch time")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of step-time medians")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="longest document and micro-batch in tokens (default: the configuration's); the corpus "
                             "is built for it under its own folder")
    parser.add_argument("--p", type=float, default=0.1, help="DST bound around the base budget")
    parser.add_argument("--anchor", default="mean")
    parser.add_argument("--recall-tolerance", type=float, default=0.02,
                        help="the adaptive anchor's allowance for predicted loss of token-weighted recall")
    parser.add_argument("--recall-rows", type=int, default=64)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="NAME[:key=value,...]",
                        help=f"variants to run, of {', '.join(VARIANTS)}; a tuning variant (dst, sparsebalance) may "
                             f"set its own {', '.join(VARIANT_SETTINGS)}, e.g. "
                             "sparsebalance:anchor=adaptive,recall_tolerance=0.001 beside plain sparsebalance")
    parser.add_argument("--devices", type=int, default=None, help="default: the configuration's")
    parser.add_argument("--accelerator", default=None, help="default: the configuration's")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per variant run")
    parser.add_argument("--out", type=Path, default=Path("outputs/e2e"))
    parser.add_argument("--report-only", action="store_true", help="re-read the runs already in --out, run nothing")
    args = parser.parse_args(argv)
    args.config = args.config or [ROOT / "configs" / "demo.yaml"]
    if args.threads is not None and (args.threads < 1 or args.ranks is None):
        parser.error(f"--threads {args.threads} needs --ranks and must be at least 1")
    if args.ranks is not None and args.report_only:
        parser.error("--report-only re-reads multi-process runs; emulated runs (--ranks) keep no logs to re-read")
    try:
        args.settings = ComparisonSettings(configs=args.config, variants=args.variants, out=args.out,
                                           **{name: getattr(args, name) for name in SETTINGS})
    except ConfigError as err:
        parser.error(str(err))
    return args


def run_variant(base: dict, name: str, args: argparse.Namespace, round_index: int) -> list[dict]:
    """One variant as a real ``main.py fit`` process; the rows of its CSV log."""
    run_dir = run_folder(args.out, name, round_index)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(variant_config(base, name, args.settings, run_dir), sort_keys=False))
    started = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        result = subprocess.run(
            [sys.executable, str(ROOT / "main.py"), "fit", "--config", str(config_path)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
        )
    if result.returncode != 0:
        raise SystemExit(f"variant {name} failed (exit {result.returncode}); see {run_dir / 'stdout.log'}")
    print(f"  {name}: {time.perf_counter() - started:.0f} s", flush=True)
    return read_metrics(run_dir / "logs" / "version_0" / "metrics.csv")


def read_metrics(path: Path) -> list[dict]:
    """Rows of the CSV log with numbers parsed and empty cells dropped."""
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def per_step(rows: list[dict], key: str) -> dict[int, float]:
    """``key``'s value at each step that logged it."""
    return {int(r["step"]): r[key] for r in rows if key in r and "step" in r}


def summarise(rows: list[dict], warmup: int) -> dict:
    """A real run's figures, from its per-step log: the same keys as an emulated variant's summary, and the
    baseline's predicted whole-step imbalance (the regime line)."""
    step_s = per_step(rows, "train/step_s")
    timed = [t for s, t in step_s.items() if s >= warmup]
    ranks = sorted({int(k.split("/")[1][4:]) for r in rows for k in r if k.startswith("latency/rank")})
    rank_times = [per_step(rows, f"latency/rank{r}/measured_s") for r in ranks]
    steps = sorted(set.intersection(*(set(t) for t in rank_times))) if rank_times else []
    measured = [[t[s] for t in rank_times] for s in steps if s >= warmup]
    losses = [v for _, v in sorted(per_step(rows, "train/loss").items())]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    recalls = [v for r in range(len(rank_times)) for v in per_step(rows, f"dst/rank{r}/recall").values()]
    densities = [v for r in range(len(rank_times)) for v in per_step(rows, f"dst/rank{r}/density").values()]
    predicted = [v for s, v in per_step(rows, "dst/predicted_imbalance_base").items() if s >= warmup]
    attention_share = [max(t[s] for t in rank_times) / step_s[s] for s in steps if s >= warmup and s in step_s]

    def mean(values):
        return statistics.fmean(values) if values else math.nan

    return {
        "steps": len(step_s),
        "total_s": sum(step_s.values()),
        "step_s": statistics.median(timed),
        "tokens_per_s": statistics.median(v for s, v in per_step(rows, "train/tokens_per_s").items() if s >= warmup),
        "measured_imbalance": statistics.median(imbalance(m) for m in measured) if measured else math.nan,
        "balance_efficiency": balance_efficiency(measured) if measured else math.nan,
        "predicted_step_imbalance": statistics.median(predicted) if predicted else math.nan,
        "predicted_step_imbalance_mean": mean(predicted),
        "imbalanced_steps": sum(v > IMBALANCED for v in predicted),
        "timed_steps": len(predicted),
        "attention_share": statistics.median(attention_share) if attention_share else math.nan,
        "train_loss": mean(losses[-5:]),
        "val_loss": val[-1] if val else math.nan,
        "recall": mean(recalls),
        "density": mean(densities),
        "curves": {
            "step_s": sorted(step_s.items()),
            "imbalance": [(s, imbalance([t[s] for t in rank_times])) for s in steps],
            "loss": sorted(per_step(rows, "train/loss").items()),
        },
    }


def merge_rounds(summaries: list[dict]) -> dict:
    """One summary over all rounds of a variant: the median of the rounds' figures (counts stay whole), the rest
    (curves, steps) of the first round."""
    def median(key, value):
        if isinstance(value, int):
            return statistics.median_low(s[key] for s in summaries)
        return statistics.median(s[key] for s in summaries) if isinstance(value, float) else value

    return {key: median(key, value) for key, value in summaries[0].items()}


ATTENTION_TIME = ("the ranks' measured attention time, the part the collectives do not blur; SAB balances the whole "
                  "step's predicted time, so it may leave attention unbalanced")


def markdown_table(results: dict, regime_line: str, args: argparse.Namespace,
                   imbalance_of: str = ATTENTION_TIME) -> str:
    """The variants side by side, ratios against the baseline."""
    base = results.get(BASELINE)
    epoch = args.epoch_documents is not None
    length = f"One epoch over {args.epoch_documents} documents" if epoch else f"{args.steps} steps"
    if args.max_tokens is not None:
        length += f", documents and micro-batches of up to {args.max_tokens} tokens"
    speedup_of = "total" if epoch else "median"
    lines = [
        f"Regime: {regime_line}. {length}, median step time after {args.warmup} warm-up steps, "
        f"{args.rounds} round(s); speed-up of the {speedup_of} step time against `{BASELINE}` (static sparse, "
        "first-fit). Over an epoch every variant trains on the same documents, each once (first-fit pads the "
        "ranks its last step leaves empty with a loss-free shortest document); over a fixed number of steps "
        "the variants see different documents, and a planner that fills its batches less has shorter steps: the "
        f"tokens/s ratio against `{BASELINE}` is the speed-up per token. Imbalance (max / mean) and balance "
        f"efficiency are of {imbalance_of}.",
        "",
        "| variant | steps | total s | median step s | speed-up | tokens/s | tokens/s ratio | attn imbalance "
        "| attn balance eff. | train loss | val loss | recall | density |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def cell(value: float, digits: int) -> str:
        return "n/a" if math.isnan(value) else f"{value:.{digits}f}"  # dense attention reports no sparsity

    for name, r in results.items():
        key = "total_s" if epoch else "step_s"
        speedup = base[key] / r[key] if base else math.nan
        throughput = r["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        lines.append(
            f"| {name} | {r['steps']:.0f} | {r['total_s']:.1f} | {r['step_s']:.3f} | {speedup:.2f}x "
            f"| {r['tokens_per_s']:.0f} | {throughput:.2f}x "
            f"| {cell(r['measured_imbalance'], 3)} | {cell(r['balance_efficiency'], 3)} | {r['train_loss']:.4f} "
            f"| {cell(r['val_loss'], 4)} | {cell(r['recall'], 3)} | {cell(r['density'], 3)} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, out: Path, title: str, imbalance_of: str = "attention time") -> list[Path]:
    """Step time, imbalance and training loss per step of every variant, one PNG each."""
    panels = [
        ("step_s", "step time (s)", "Wall time per training step"),
        ("imbalance", f"max / mean of the ranks' {imbalance_of}", "Imbalance across ranks per step"),
        ("loss", "training loss (nats / token)", "Training loss"),
    ]
    paths = []
    for key, ylabel, heading in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            curve = r["curves"][key]
            if curve:
                ax.plot([s for s, _ in curve], [v for _, v in curve], label=name, lw=1.2)
        ax.set(xlabel="optimiser step", ylabel=ylabel, title=f"{heading} ({title})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base = merged_configs(args.config)
    rounds: dict[str, list] = {name: [] for name in args.variants}
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", flush=True)
        if args.ranks is not None:
            started = time.perf_counter()
            try:
                emulated = emulate_variants(base, args.settings, round_index)
            except ConfigError as err:
                raise SystemExit(f"error: {err}") from None
            counts = ", ".join(f"{name} {summary['steps']}" for name, summary in emulated.items())
            print(f"  {counts} steps of {args.ranks} ranks, interleaved, {time.perf_counter() - started:.0f} s",
                  flush=True)
            for name, summary in emulated.items():
                rounds[name].append(summary)
            continue
        for name in args.variants:
            if args.report_only:
                metrics = run_folder(args.out, name, round_index) / "logs" / "version_0" / "metrics.csv"
                rounds[name].append(summarise(read_metrics(metrics), args.warmup))
            else:
                rounds[name].append(summarise(run_variant(base, name, args, round_index), args.warmup))
    results = {name: merge_rounds(r) for name, r in rounds.items()}
    if args.ranks is not None:
        write_emulated(base, results, args)
        return
    reference = results.get(BASELINE) or next(iter(results.values()))
    init = "random initialisation" if args.init == "none" else f"from {args.init}"
    regime_line = (f"{init}; baseline mean density {reference['density']:.3f}, exact recall "
                   f"{reference['recall']:.3f} at tau {base['model']['attention']['tau']}; the baseline's predicted "
                   f"whole-step imbalance across ranks (max / mean, the most any balancing can remove) median "
                   f"{reference['predicted_step_imbalance']:.3f}, mean "
                   f"{reference['predicted_step_imbalance_mean']:.3f}, over {IMBALANCED} on "
                   f"{reference['imbalanced_steps']:.0f} of {reference['timed_steps']:.0f} timed steps; the slowest rank's attention is {reference['attention_share']:.0%} of the step "
                   "(median)")
    table = markdown_table(results, regime_line, args)
    print(table)
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "regime": regime_line, "results": results}, indent=1))
    for path in plot(results, args.out, init):
        print(f"wrote {path}")


def write_emulated(base: dict, results: dict, args: argparse.Namespace) -> None:
    """The emulated comparison's table, plots and ``results.json`` (``comparison.save_results``)."""
    run = regime(base, results, args.settings)
    text = (f"{args.ranks} emulated ranks (one process on {run['threads']} thread(s), ranks timed one after "
            f"another, the variants' steps in turn); context {run['max_tokens']} tokens over hidden "
            f"{run['hidden_size']}: attention/projection FLOPs {run['attention_to_projection_flops']:.1f}; "
            f"the baseline's attention is {run['baseline_attention_share_of_compute']:.0%} of its ranks' "
            f"compute, its removable imbalance {run['baseline_removable_imbalance']:.3f}; collectives not in the "
            f"times (estimated {run['collective_estimate_s']:.2f} s over the run at {args.bandwidth_gbps:g} GB/s); "
            f"cost model and DST calibrated by {args.calibrate_steps} steps without updates before the epoch"
            + (f"; each rank's time the median of {args.repeats} runs" if args.repeats > 1 else "")
            + f"; other work on its CPUs while timing: {run['other_cpu_cores']:.2f} cores "
              f"({run['spare_cpu_cores']} spare)"
            + ("; weights frozen through the epoch (no variant's steps update them)" if args.frozen else ""))
    table = markdown_table(results, text, args, imbalance_of="each rank's measured forward and backward")
    print(table)
    (args.out / "table.md").write_text(table)
    print(f"wrote {save_results(args.settings, results, run)}")
    for path in plot(results, args.out, f"{args.ranks} emulated ranks", imbalance_of="compute"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
