"""Held-out accuracy of the latency model on the demo model, and how fast online calibration repairs a bad start.

Profile this machine (quick grid), then time forward+backward of the whole demo model (``ModelStep``: Hugging
Face Qwen2, sparse attention capped at the batch's density, chunked loss) on random micro-batches of 1-8
documents, 256-8192 tokens, density 0.05-1.0, and compare with ``predict``: 30 held-out batches give the median
and 90th-percentile absolute percentage error; 20 further batches are fed to ``observe`` starting from the
profiled table with every time doubled and from the analytic prior, and the held-out median error is printed
after each number of observed steps. Writes a PNG (predicted vs measured, error vs observed steps) and a JSON of
all figures to ``--out``.

Timings on a shared CPU are noisy: each batch is timed in several passes over all batches (so a busy period is
spread over batches instead of hitting one) and the fastest pass counts, as in the profiler. With other jobs
loading the machine even that drifts, so by default (one torch thread) the profile and the steps are timed in
process CPU time (``--clock cpu``: the wall time the step would take on an idle machine); the wall-clock times
are recorded beside them and their ratio printed as the machine's contention.

    python benchmarks/latency.py [--clock cpu|wall] [--threads 1] [--passes 2] [--table t.json] [--out dir]
    python benchmarks/latency.py --quick --out outputs/latency_quick   # 2,048 tokens at most, few batches
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparsebalance_pl.cost.profiler import (  # noqa: E402
    KernelSettings,
    ModelStep,
    check_clock,
    device_name,
    profile_hardware,
    random_micro_batches,
    timed,
)
from sparsebalance_pl.latency import LatencyModel  # noqa: E402
from sparsebalance_pl.model import ModelConfig  # noqa: E402

KERNELS = KernelSettings(device="cpu", block_size=64, stride=16)
CALIBRATION_CHECKPOINTS = (0, 1, 2, 3, 5, 10, 15, 20)


class DemoStep:
    """Forward+backward of the demo model on one packed micro-batch at a given density cap, timed."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.config = ModelConfig(preset="demo").hf_config()
        self.step = ModelStep(self.config, KERNELS)
        self.dims = self.step.dims

    def __call__(self, lengths: list[int], density: float) -> tuple[float, float]:
        """(wall, CPU) seconds of forward+backward."""
        return timed(self.step.workload(lengths, density), torch.device("cpu"))


def measure(step: DemoStep, batches, passes: int, rng: np.random.Generator) -> np.ndarray:
    """[batches, 2] fastest (wall, CPU) seconds over ``passes`` passes, each over all batches in a fresh order."""
    step(*batches[0])  # warm-up
    best = np.full((len(batches), 2), np.inf)
    for p in range(passes):
        for i in rng.permutation(len(batches)):
            best[i] = np.minimum(best[i], step(*batches[i]))
        print(f"  pass {p + 1}/{passes} done", flush=True)
    return best


def errors(model: LatencyModel, batches, measured: np.ndarray) -> np.ndarray:
    predicted = np.array([model.predict(n, d) for n, d in batches])
    return np.abs(predicted / measured - 1)


def calibration_curve(model: LatencyModel, calib, calib_times, held_out, held_times) -> list[float]:
    """Held-out median error after each number of observed steps in ``CALIBRATION_CHECKPOINTS``."""
    curve = []
    for step in range(max(CALIBRATION_CHECKPOINTS) + 1):
        if step in CALIBRATION_CHECKPOINTS:
            curve.append(float(np.median(errors(model, held_out, held_times))))
        if step < len(calib):
            model.observe(*calib[step], calib_times[step])
    return curve


def plot(path: Path, held_out, held_times, predictions: dict[str, np.ndarray], curves: dict[str, list[float]],
         device: str, clock: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    for label, predicted in predictions.items():
        left.scatter(held_times, predicted, s=18, label=label, alpha=0.8)
    low, high = held_times.min() * 0.8, held_times.max() * 1.25
    left.plot([low, high], [low, high], "k--", lw=1, label="y = x")
    left.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
             xlabel=f"measured forward+backward time (s, {clock} clock)", ylabel="predicted time (s)",
             title=f"Demo model, {len(held_out)} held-out micro-batches")
    for axis in (left.xaxis, left.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    left.legend(fontsize=8)
    for label, curve in curves.items():
        right.plot(CALIBRATION_CHECKPOINTS, 100 * np.asarray(curve), marker="o", label=label)
    right.axhline(15, color="grey", ls=":", label="15% target")
    right.set(xlabel="observed steps", ylabel="held-out median abs. error (%)", yscale="log",
              title="Online calibration (observe)")
    right.legend(fontsize=8)
    fig.suptitle(f"Latency model on {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared CPU)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu needs --threads 1")
    parser.add_argument("--passes", type=int, default=2, help="timing passes over all batches")
    parser.add_argument("--held-out", type=int, default=30)
    parser.add_argument("--calibration", type=int, default=20)
    parser.add_argument("--table", type=Path, help="use this table instead of profiling now")
    parser.add_argument("--full-profile", action="store_true", help="profile the full grid instead of the quick one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8192, help="longest micro-batch timed and profiled")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 6 held-out and 5 calibration batches of up to 2,048 tokens, one pass")
    parser.add_argument("--out", type=Path, default=Path("outputs/latency"))
    args = parser.parse_args()
    if args.quick:
        args.held_out, args.calibration, args.passes, args.max_tokens = 6, 5, 1, 2048
    torch.set_num_threads(args.threads)
    check_clock(args.clock, "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    device = device_name("cpu")

    step = DemoStep(args.seed)
    if args.table:
        table = LatencyModel.from_file(args.table, step.dims, block_size=KERNELS.block_size, stride=KERNELS.stride,
                                       selection=KERNELS.selection)
        profile_s = 0.0
    else:
        start = time.perf_counter()
        table = profile_hardware(step.config, KERNELS, quick=not args.full_profile, max_length=args.max_tokens,
                                 output=args.out / "latency_table.json", clock=args.clock)
        profile_s = time.perf_counter() - start
        print(f"profile: {profile_s:.1f} s ({'full' if args.full_profile else 'quick'} grid)")

    held_out = random_micro_batches(args.held_out, rng, 256, args.max_tokens)
    calib = random_micro_batches(args.calibration, rng, 256, args.max_tokens)
    print(f"timing {len(held_out) + len(calib)} micro-batches x {args.passes} passes on {device}", flush=True)
    both = measure(step, held_out + calib, args.passes, rng)
    times = both[:, 0 if args.clock == "wall" else 1]
    contention = float(np.median(both[:, 0] / both[:, 1]))
    held_times, calib_times = times[: len(held_out)], times[len(held_out):]

    table_errors = errors(table, held_out, held_times)
    starts = {
        "profiled table": LatencyModel.from_state(table.state_dict()),
        "doubled table": LatencyModel(table.table.scaled(2.0)),
        "analytic prior": LatencyModel.analytic(step.dims, block_size=KERNELS.block_size, stride=KERNELS.stride,
                                                device=device, selection=KERNELS.selection),
    }
    curves = {name: calibration_curve(m, calib, calib_times, held_out, held_times) for name, m in starts.items()}
    results = {
        "device": device,
        "threads": args.threads,
        "clock": args.clock,
        "median_wall_over_cpu": contention,
        "profile_seconds": profile_s,
        "held_out_median_ape": float(np.median(table_errors)),
        "held_out_p90_ape": float(np.quantile(table_errors, 0.9)),
        "calibration_checkpoints": CALIBRATION_CHECKPOINTS,
        "calibration_median_ape": curves,
        "batches": [{"lengths": n, "density": d, "measured_s": float(t), "wall_s": float(w),
                     "predicted_s": table.predict(n, d)} for (n, d), t, w in zip(held_out, held_times, both[:, 0])],
        "calibration_batches": [{"lengths": n, "density": d, "measured_s": float(t)}
                                for (n, d), t in zip(calib, calib_times)],
    }
    (args.out / "latency_benchmark.json").write_text(json.dumps(results, indent=1))
    predictions = {
        "profiled table": np.array([table.predict(n, d) for n, d in held_out]),
        f"analytic prior + {len(calib)} observed steps": np.array([starts["analytic prior"].predict(n, d) for n, d in held_out]),
    }
    plot(args.out / "latency_predicted_vs_measured.png", held_out, held_times, predictions, curves, device, args.clock)

    print(f"clock: {args.clock}; contention (median wall / CPU time of a step): {contention:.2f}x")
    print(f"held-out ({len(held_out)} micro-batches, measured {held_times.min():.2f}-{held_times.max():.2f} s): "
          f"median APE {100 * results['held_out_median_ape']:.1f}%, p90 APE {100 * results['held_out_p90_ape']:.1f}%")
    print("held-out median APE after n observed steps:")
    print("  n:              " + " ".join(f"{n:>6d}" for n in CALIBRATION_CHECKPOINTS))
    for name, curve in curves.items():
        print(f"  {name:<15} " + " ".join(f"{100 * e:5.1f}%" for e in curve))
    print(f"wrote {args.out / 'latency_predicted_vs_measured.png'} and {args.out / 'latency_benchmark.json'}")


if __name__ == "__main__":
    main()
