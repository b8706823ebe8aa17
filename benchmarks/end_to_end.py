"""SparseBalance against its baselines in real multi-process training (issue 7).

Every variant is a real ``python main.py fit`` run of the demo configuration (2 FSDP2 ranks on the CPU here;
``--devices``/``--accelerator`` for GPUs), with the same model, data, seed and number of steps:

    dense            dense attention, token first-fit packing
    static           static sparse attention, first-fit packing (the baseline)
    sab              static sparse, sparsity-aware batching
    dst              sparse with dynamic sparsity tuning, first-fit packing
    sparsebalance    SAB + DST

Static variants run the DST callback with p = 0, so it only measures: every variant logs the same
per-rank attention times (collective-free), from which measured imbalance and balance efficiency come.
All variants start from ``--init`` (a Hugging Face directory, e.g. ``main.py export`` of a demo checkpoint
trained until its attention is sharp) or from random initialisation (``--init none``); the regime line
gives the baseline's mean density and recall at the base budget and its predicted
whole-step imbalance across ranks (the most that any balancing can gain), how many of its steps are
imbalanced, and the share of the step its slowest rank spends in attention. Per variant: median step
time after ``--warmup`` steps, global tokens per second (and its ratio to the baseline: the speed-up per
token), measured imbalance, balance efficiency, final training loss (mean of the last 5 steps) and
validation loss, mean exact recall (sampled rows). Ratios are
against the static baseline of the same invocation. Writes ``results.json``, ``results.md`` and PNG plots
to ``--out``. Timings on a shared machine drift: ``--rounds`` repeats the whole set of variants in turn.

    python benchmarks/end_to_end.py --init outputs/sharp/hf --steps 60 --out outputs/e2e_sharp
    python benchmarks/end_to_end.py --init outputs/sharp/hf --epoch-documents 300 --out outputs/e2e_epoch
    python benchmarks/end_to_end.py --init none --steps 30 --out outputs/e2e_random
    python benchmarks/end_to_end.py --init outputs/sharp/hf --max-tokens 8192 --out outputs/e2e_8k   # longer contexts

``--ranks N`` emulates N data-parallel ranks in this one process instead (``sparsebalance_pl.emulation``): the
real planner plans for N ranks, each rank's micro-batch runs forward and backward alone with its own DST budget
(one controller for all), gradients add up under the global-token normalisation and one optimiser step follows.
A step's time is its slowest rank's measured compute plus the measured optimiser time; the collectives are left
out and estimated apart (a ring all-reduce of the gradients at ``--bandwidth-gbps``). The variants' steps take
turns, so a drift in the machine's speed reaches them all. Then ``results.json`` holds
``{"variants": {name: {"steps": [{"rank_s", "step_s", "tokens", "rounds"}], "total_s", "tokens", "val_loss",
"recall", ...}}, "regime": {...}}`` (``rounds``: what the cost model learned from each micro-batch round, which
``benchmarks/simulate.py check`` replays; the regime records how many cores other processes used on this
machine's CPUs while the steps were timed, ``cost.contention``):

    python benchmarks/end_to_end.py --ranks 8 --config configs/demo.yaml --config configs/narrow16k.yaml \
        --epoch-documents 400 --out outputs/e2e_emulated_8

A tuning variant may carry DST settings of its own (``VARIANT_SETTINGS``), so that several settings compare in
one run on the same machine state: ``--variants static sparsebalance sparsebalance:anchor=adaptive``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from sparsebalance_pl.balance import balance_efficiency, imbalance  # noqa: E402
from sparsebalance_pl.cost.contention import CpuContention, measure_contention  # noqa: E402
from sparsebalance_pl.progress import LoggedProgress  # noqa: E402
from variant_spec import parse_variant  # noqa: E402

# name: (attention backend, batching, DST p: 0 measures only, None tunes with --p)
VARIANTS = {
    "dense": ("dense", "first_fit", 0.0),
    "static": ("sparse", "first_fit", 0.0),
    "sab": ("sparse", "sab", 0.0),
    "dst": ("sparse", "first_fit", None),
    "sparsebalance": ("sparse", "sab", None),
}
BASELINE = "static"
#: DST settings a tuning variant may set for itself (``sparsebalance:anchor=adaptive,recall_tolerance=0.001``), in
#: place of the command line's, so that several settings compare within one run, on the same machine state
VARIANT_SETTINGS = ("anchor", "p", "recall_tolerance")
IMBALANCED = 1.05  # a step whose predicted max / mean across ranks exceeds this counts as imbalanced


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
                             "thread times a micro-batch somewhat more steadily on a shared machine (docs/RESULTS.md, "
                             "emulated ranks, sixth pass)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --ranks: time each rank's micro-batch as the median of this many runs (the extra "
                             "runs' gradients dropped): identical work strays by 0.07-0.15 on a shared CPU "
                             "(benchmarks/timing_noise.py), which a balanced step pays as its slowest rank's excess; "
                             "results.json keeps every run's time, and the total a single run gives")
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
    args.argv = list(sys.argv[1:] if argv is None else argv)  # kept with emulated results, for simulate.py
    args.config = args.config or [ROOT / "configs" / "demo.yaml"]
    if args.ranks is not None and args.ranks < 1:
        parser.error(f"--ranks {args.ranks} must be at least 1")
    if args.frozen and args.ranks is None:
        parser.error("--frozen needs --ranks")
    if args.threads is not None and (args.threads < 1 or args.ranks is None):
        parser.error(f"--threads {args.threads} needs --ranks and must be at least 1")
    if args.repeats < 1 or (args.repeats > 1 and args.ranks is None):
        parser.error(f"--repeats {args.repeats} needs --ranks and must be at least 1")
    if args.calibrate_steps < 0 or (args.calibrate_steps and args.ranks is None):
        parser.error(f"--calibrate-steps {args.calibrate_steps} needs --ranks and must be >= 0")
    if args.ranks is not None and args.report_only:
        parser.error("--report-only re-reads multi-process runs; emulated runs (--ranks) keep no logs to re-read")
    if args.epoch_documents is None and args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    check_variants(parser, args)
    return args


def check_variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse every variant spec of ``args.variants`` once into ``args.dst_settings`` (spec: ``dst_settings``);
    stop with one line on a spec that cannot run, or on one named twice."""
    if len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants {' '.join(args.variants)} names a variant twice")
    args.dst_settings = {}
    for spec in args.variants:
        try:
            args.dst_settings[spec] = dst_settings(spec, args)
        except (SystemExit, ValueError) as err:
            parser.error(str(err))


def variant_kind(name: str) -> str:
    """Which of ``VARIANTS`` a variant spec runs (``sparsebalance`` for ``sparsebalance:anchor=adaptive``)."""
    return name.partition(":")[0]


def dst_settings(name: str, args: argparse.Namespace) -> dict:
    """The DST callback's settings for variant spec ``name``: its own (``VARIANT_SETTINGS``), else the command
    line's; p = 0 for the variants that only measure. A spec that cannot run raises one line naming it."""
    from sparsebalance_pl.dst import check_settings

    kind = variant_kind(name)
    if kind not in VARIANTS:
        raise ValueError(f"--variants {name!r}: unknown variant {kind!r}; allowed: {', '.join(VARIANTS)}")
    _, own = parse_variant(name, "--variants")
    fixed_p = VARIANTS[kind][2]
    if own and fixed_p is not None:
        raise ValueError(f"--variants {name!r}: {kind} does not tune, so it takes no settings")
    unknown = set(own) - set(VARIANT_SETTINGS)
    if unknown:
        raise ValueError(f"--variants {name!r}: unknown setting {sorted(unknown)[0]!r}; allowed: "
                         f"{', '.join(VARIANT_SETTINGS)}")
    settings = {"anchor": args.anchor, "p": args.p, "recall_tolerance": args.recall_tolerance, **own}
    if fixed_p is not None:
        settings["p"] = fixed_p
    check_settings(f"--variants {name!r}: DST", settings["anchor"], float(settings["p"]), 0.0,
                   float(settings["recall_tolerance"]))
    return settings


def run_folder(out: Path, name: str, round_index: int) -> Path:
    """Where a variant's run of one round keeps its configuration, logs and calibrated state, under ``out``."""
    return (out / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)}-round{round_index}").resolve()


def variant_config(base: dict, name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """The demo configuration changed only where the variant differs, plus per-step logging."""
    backend, batching, _ = VARIANTS[variant_kind(name)]
    cfg = json.loads(json.dumps(base))  # deep copy
    trainer = cfg["trainer"]
    trainer.update(
        max_steps=args.steps, log_every_n_steps=1, val_check_interval=args.steps, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=str(run_dir),
    )
    if args.max_tokens is not None:
        corpus = cfg["data"]["corpus"]
        corpus.update(max_doc_tokens=args.max_tokens, data_dir=f"{corpus['data_dir']}_{args.max_tokens}")
        cfg["data"]["batching"]["max_tokens"] = args.max_tokens
    if args.epoch_documents is not None:
        trainer.update(max_steps=-1, max_epochs=1, val_check_interval=1.0)
        corpus, k = cfg["data"]["corpus"], args.epoch_documents
        installed = corpus.get("source") == "installed"  # a real-text corpus: K of its files, a long one split
        folder = f"data/e2e_installed_{k}" if installed else f"data/e2e_{k}"
        corpus.update({"max_files" if installed else "num_documents": k,
                       "data_dir": folder + (f"_{args.max_tokens}" if args.max_tokens else "")})
    if args.devices is not None:
        trainer["devices"] = args.devices
    if args.accelerator is not None:
        trainer["accelerator"] = args.accelerator
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(run_dir), "name": "logs", "version": 0},
    }
    dst = {"class_path": "sparsebalance_pl.callbacks.DynamicSparsityTuning", "init_args": args.dst_settings[name]}
    trainer["callbacks"] = [{"class_path": "sparsebalance_pl.callbacks.DensityCalibration"}, dst]
    model = cfg["model"]
    model["attention"]["backend"] = backend
    model["attention"]["recall_rows"] = args.recall_rows if backend == "sparse" else 0
    if args.init != "none":
        model["model"] = {"pretrained_path": str(Path(args.init).resolve())}
    cfg["data"]["batching"]["method"] = batching
    return cfg


def run_variant(base: dict, name: str, args: argparse.Namespace, round_index: int) -> list[dict]:
    run_dir = run_folder(args.out, name, round_index)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(variant_config(base, name, args, run_dir), sort_keys=False))
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
    return {int(r["step"]): r[key] for r in rows if key in r and "step" in r}


def summarise(rows: list[dict], warmup: int) -> dict:
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


#: Where an emulated variant keeps the state its cost model and DST controller start the epoch with.
CALIBRATED_STATE = "calibrated_state.json"


def prepare_emulated(base: dict, name: str, args: argparse.Namespace, round_index: int, calibrated: dict | None = None):
    """A variant's model, data module, Trainer, DST controller and epoch plan for ``--ranks`` ranks, set up as a
    real run would be before its first step (``benchmarks/simulate.py`` predicts the same plan's times).

    The ``--calibrate-steps`` steps run here, and the cost model's and controller's state after them is written
    to ``CALIBRATED_STATE`` in the variant's folder with the ranks' times against their predictions in those
    steps after the first (``residuals``, per step and rank, log of measured over predicted); with ``calibrated``
    (such a file's contents) that state is loaded instead, so a prediction starts from what the measured epoch
    started from."""
    from sparsebalance_pl.dst import DSTController
    from sparsebalance_pl.emulation import EmulatedRanks, build, step_batches

    run_dir = run_folder(args.out, name, round_index)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(variant_config(base, name, args, run_dir), sort_keys=False))
    # a calibrated state brings its own latency table and density estimate: profiling this process's hardware
    # would be wasted, and would overwrite the table file the emulation used (a check run on other threads, say)
    module, data, trainer = build(["--config", str(config_path)]
                                  + (["--model.latency_profile=false"] if calibrated is not None else []))
    attention = module.sparse_attention
    if VARIANTS[variant_kind(name)][0] == "sparse" and calibrated is None:  # as DensityCalibration before an epoch
        module.calibrate_density(data.calibration_batches(min_length=attention.config.block_size))
    controller = DSTController(attention.cost_model, attention.base_budgets, **args.dst_settings[name])
    if calibrated is not None:
        attention.cost_model.load_state_dict(calibrated["cost_model"])
        controller.load_state_dict(calibrated["controller"])
    else:
        residuals: list[list[float]] = []
        if args.calibrate_steps:
            calibration = EmulatedRanks(module, args.ranks, 1, controller=controller, repeats=args.repeats)
            items = data.items("train")
            steps = data.train_plan(args.ranks, rank=0, epoch=1).plan()[: args.calibrate_steps]
            with LoggedProgress(transient=True) as bar:
                for i, step in enumerate(bar.track(steps, description=f"calibrating {name}")):
                    done = calibration.step(step_batches(items, step), update=False)
                    if i:  # the first step's predictions come from the uncalibrated table
                        residuals.append([math.log(m / q) for m, q in zip(done.rank_seconds, done.predicted_seconds)])
        state = {"cost_model": attention.cost_model.state_dict(), "controller": controller.state_dict(),
                 "residuals": residuals}
        (run_dir / CALIBRATED_STATE).write_text(json.dumps(state, default=lambda array: array.tolist()))
    plan = data.train_plan(args.ranks, rank=0).plan()
    plan = plan if args.epoch_documents is not None else plan[: args.steps]
    return module, data, trainer, controller, plan


class EmulatedRun(NamedTuple):
    """One variant's emulation under way: its model, data, epoch plan, ranks, packed items and steps done."""

    module: object
    data: object
    plan: list
    emulated: object
    items: object
    done: list


def emulate_variants(base: dict, names: list[str], args: argparse.Namespace, round_index: int) -> dict[str, dict]:
    """Every variant over ``--ranks`` emulated ranks in this process, their epochs' steps interleaved (a step of
    each variant in turn): a shared machine's speed drifts over minutes (the same batches once took 40% longer
    in the last of four variants run one after another), and taking turns spreads the drift over all variants.
    All variants' models are held at once. Each summarised as ``summarise`` does a real run, plus every step's
    per-rank times (``steps``)."""
    from sparsebalance_pl.emulation import EmulatedRanks, step_batches

    runs: dict[str, EmulatedRun] = {}
    for name in names:
        module, data, trainer, controller, plan = prepare_emulated(base, name, args, round_index)
        emulated = EmulatedRanks(module, args.ranks, len(plan), controller=controller,
                                 gradient_clip=trainer.gradient_clip_val,
                                 gradient_clip_algorithm=trainer.gradient_clip_algorithm or "norm",
                                 repeats=args.repeats)
        items = data.items("train")
        emulated.warm_up(step_batches(items, plan[0])[0][0])
        runs[name] = EmulatedRun(module, data, plan, emulated, items, [])
    started = time.perf_counter()
    columns = (TextColumn("emulating {task.description:<24}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with LoggedProgress(*columns) as bar, measure_contention(torch.get_num_threads()) as contention:
        task = bar.add_task("", total=sum(len(run.plan) for run in runs.values()))
        for i in range(max(len(run.plan) for run in runs.values())):
            for name, run in runs.items():
                if i < len(run.plan):
                    bar.update(task, description=f"{name} step {i + 1}/{len(run.plan)}")
                    run.done.append(run.emulated.step(step_batches(run.items, run.plan[i]), update=not args.frozen))
                    bar.advance(task)
    print(f"  {', '.join(f'{name} {len(run.done)}' for name, run in runs.items())} steps of {args.ranks} ranks, "
          f"interleaved, {time.perf_counter() - started:.0f} s", flush=True)
    from sparsebalance_pl.emulation import validation_loss

    losses: dict[str, float] = {}  # frozen weights: every variant of a backend ends with the model it started from
    summaries = {}
    for name, run in runs.items():
        key = VARIANTS[variant_kind(name)][0] if args.frozen else name
        if key not in losses:
            losses[key] = validation_loss(run.module, run.data)
        summaries[name] = summarise_emulated(name, run, args, losses[key], contention)
    return summaries


def summarise_emulated(name: str, run: EmulatedRun, args: argparse.Namespace, val_loss: float,
                       contention: CpuContention) -> dict:
    """One variant's emulated epoch summed up, with its measured validation loss and the other work on the
    machine's CPUs while the variants were timed."""
    from sparsebalance_pl.emulation import allreduce_seconds

    module, done = run.module, run.done
    records = [record for step in done for observation in step.observations for record in observation.records]
    recalls = [(sum(r.lengths), r.report.recall) for r in records if r.report.recall is not None]
    rank_s = [step.rank_seconds for step in done]
    step_s = [step.seconds for step in done]
    if len(done) <= args.warmup:
        raise SystemExit(f"variant {name} ran {len(done)} steps: none is left after --warmup {args.warmup}")
    parameters = sum(p.numel() for p in module.parameters())
    return {
        "steps": len(done),
        "hidden_size": module.dims.hidden_size,
        "total_s": sum(step_s),
        "first_run_total_s": sum(step.first_run_seconds for step in done),
        "step_s": statistics.median(step_s[args.warmup:]),
        "tokens": sum(step.tokens for step in done),
        "tokens_per_s": sum(step.tokens for step in done) / sum(step_s),
        "measured_imbalance": statistics.median(imbalance(r) for r in rank_s[args.warmup:]),
        "balance_efficiency": balance_efficiency(rank_s),
        "removable_imbalance": sum(max(r) for r in rank_s) / sum(statistics.fmean(r) for r in rank_s),
        "attention_share_of_compute": sum(r.report.attention_seconds for r in records) / sum(map(sum, rank_s)),
        "collective_estimate_s": len(done) * allreduce_seconds(parameters, args.ranks, args.bandwidth_gbps),
        "train_loss": statistics.fmean(step.loss for step in done[-5:]),
        "val_loss": val_loss,
        "recall": sum(n * r for n, r in recalls) / sum(n for n, _ in recalls) if recalls else math.nan,
        "density": statistics.fmean(r.report.mean_density for r in records),
        "other_cpu_cores": math.nan if contention.other_cores is None else contention.other_cores,
        "spare_cpu_cores": contention.spare_cores,
        "curves": {
            "step_s": list(enumerate(step_s)),
            "imbalance": [(i, imbalance(r)) for i, r in enumerate(rank_s)],
            "loss": [(i, step.loss) for i, step in enumerate(done)],
        },
        "steps_detail": [{"rank_s": step.rank_seconds, "rank_draws": step.rank_draws, "step_s": step.seconds,
                          "tokens": step.tokens,
                          "rounds": [o.replay_dict() for o in step.observations]} for step in done],
    }


def emulated_regime(base: dict, results: dict, args: argparse.Namespace) -> dict:
    """What decides the gain: attention's share of a step (its FLOP ratio to the projections, and as measured)
    and how much imbalance the baseline leaves (the most balancing can remove)."""
    reference = results.get(BASELINE) or next(iter(results.values()))
    length = args.max_tokens or base["data"]["batching"]["max_tokens"]
    return {
        "ranks": args.ranks,
        "max_tokens": length,
        "hidden_size": reference["hidden_size"],
        "attention_to_projection_flops": length / (6 * reference["hidden_size"]),
        "baseline_attention_share_of_compute": reference["attention_share_of_compute"],
        "baseline_removable_imbalance": reference["removable_imbalance"],
        "baseline_density": reference["density"],
        "baseline_recall": reference["recall"],
        "collective_estimate_s": reference["collective_estimate_s"],
        "bandwidth_gbps": args.bandwidth_gbps,
        "calibration_steps": args.calibrate_steps,
        "timing_repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "other_cpu_cores": reference["other_cpu_cores"],
        "spare_cpu_cores": reference["spare_cpu_cores"],
        "frozen_weights": args.frozen,
        "collectives": "not in the step times; estimated apart as a ring all-reduce of fp32 gradients",
    }


def merged_configs(paths: list[Path]) -> dict:
    """The configuration files stacked in order, as ``--config a --config b`` does (mappings merge, the rest is
    replaced)."""
    def merge(into: dict, update: dict) -> dict:
        for key, value in update.items():
            into[key] = merge(dict(into.get(key) or {}), value) if isinstance(value, dict) else value
        return into

    merged: dict = {}
    for path in paths:
        merged = merge(merged, yaml.safe_load(path.read_text()) or {})
    return merged


ATTENTION_TIME = ("the ranks' measured attention time, the part the collectives do not blur; SAB balances the whole "
                  "step's predicted time, so it may leave attention unbalanced")


def markdown_table(results: dict, regime: str, args: argparse.Namespace, imbalance_of: str = ATTENTION_TIME) -> str:
    base = results.get(BASELINE)
    epoch = args.epoch_documents is not None
    length = f"One epoch over {args.epoch_documents} documents" if epoch else f"{args.steps} steps"
    if args.max_tokens is not None:
        length += f", documents and micro-batches of up to {args.max_tokens} tokens"
    speedup_of = "total" if epoch else "median"
    lines = [
        f"Regime: {regime}. {length}, median step time after {args.warmup} warm-up steps, "
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
            for name, summary in emulate_variants(base, args.variants, args, round_index).items():
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
    regime = (f"{init}; baseline mean density {reference['density']:.3f}, exact recall {reference['recall']:.3f} "
              f"at tau {base['model']['attention']['tau']}; the baseline's predicted whole-step imbalance across "
              f"ranks (max / mean, the most any balancing can remove) median "
              f"{reference['predicted_step_imbalance']:.3f}, mean {reference['predicted_step_imbalance_mean']:.3f}, "
              f"over {IMBALANCED} on {reference['imbalanced_steps']:.0f} of {reference['timed_steps']:.0f} timed "
              f"steps; the slowest rank's attention is {reference['attention_share']:.0%} of the step (median)")
    table = markdown_table(results, regime, args)
    print(table)
    (args.out / "results.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "regime": regime, "results": results}, indent=1))
    for path in plot(results, args.out, init):
        print(f"wrote {path}")


def write_emulated(base: dict, results: dict, args: argparse.Namespace) -> None:
    regime = emulated_regime(base, results, args)
    text = (f"{args.ranks} emulated ranks (one process on {regime['threads']} thread(s), ranks timed one after "
            f"another, the variants' steps in turn); context {regime['max_tokens']} tokens over hidden "
            f"{regime['hidden_size']}: attention/projection FLOPs {regime['attention_to_projection_flops']:.1f}; "
            f"the baseline's attention is {regime['baseline_attention_share_of_compute']:.0%} of its ranks' "
            f"compute, its removable imbalance {regime['baseline_removable_imbalance']:.3f}; collectives not in the "
            f"times (estimated {regime['collective_estimate_s']:.2f} s over the run at {args.bandwidth_gbps:g} GB/s); "
            f"cost model and DST calibrated by {args.calibrate_steps} steps without updates before the epoch"
            + (f"; each rank's time the median of {args.repeats} runs" if args.repeats > 1 else "")
            + f"; other work on its CPUs while timing: {regime['other_cpu_cores']:.2f} cores "
              f"({regime['spare_cpu_cores']} spare)"
            + ("; weights frozen through the epoch (no variant's steps update them)" if args.frozen else ""))
    table = markdown_table(results, text, args, imbalance_of="each rank's measured forward and backward")
    print(table)
    (args.out / "results.md").write_text(table)
    variants = {
        name: {**{k: v for k, v in r.items() if k not in ("curves", "steps_detail")}, "steps": r["steps_detail"]}
        for name, r in results.items()
    }
    (args.out / "results.json").write_text(json.dumps({"variants": variants, "regime": regime, "argv": args.argv},
                                                      indent=1))
    for path in plot(results, args.out, f"{args.ranks} emulated ranks", imbalance_of="compute"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
