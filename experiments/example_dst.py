"""DST in a project of its own (examples/tiny_gpt.py): does it help, and does it ever do harm?

Runs the worked example on 2 CPU ranks with DST (p = 0.1) and without (p = 0), from the analytic prior and
from a table ``profile_module`` measured for it, for ``--rounds`` rounds, variants alternated. Every run plans
its epoch before it has measured anything, so step s holds the same documents in every run and the runs can
be compared step by step. Printed per variant: mean measured attention imbalance, its ratio to p = 0, the
largest step-to-step move of DST's anchor on the same documents (``dst/anchor_drift``: what learning moved it)
and with the change of documents between steps (the raw anchor), and how many steps DST made worse than p = 0
by more than the noise (the largest difference between two p = 0 rounds on the same step), and how many cores
other work took on the machine's CPUs while the variant ran (``cost.contention``: timings beside other work are
not the example's own). Last, per start, in how many rounds DST cut the mean imbalance against p = 0 of the same
round by at least ``TARGET_CUT`` and by more than p = 0 itself varied between rounds.

    python experiments/example_dst.py --steps 20 --rounds 3 --out outputs/example_dst
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import numpy as np

from sparsebalance_pl.cost.contention import measure_contention

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_gpt.py"

RANKS = 2
#: The least cut of the mean measured imbalance against p = 0 that counts as DST helping.
TARGET_CUT = 0.05


def run(out: Path, steps: int, p: float, table: Path | None) -> dict[str, np.ndarray]:
    """The example's logged series, and ``other_cores``: the cores other work took while it ran."""
    command = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--p", str(p), "--out", str(out),
               "--devices", str(RANKS)]
    if table is not None:
        command += ["--latency-table", str(table)]
    with measure_contention(cores_used=RANKS, own_children=True) as contention:
        subprocess.run(command, check=True, capture_output=True, text=True, cwd=out.parent)
    rows = list(csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")))
    series = {}
    for key in ("dst/measured_imbalance", "dst/anchor_s", "dst/anchor_drift", "dst/prediction_error"):
        series[key] = np.array([float(r[key]) for r in rows if r.get(key)])
    series["other_cores"] = np.array([np.nan if contention.other_cores is None else contention.other_cores])
    return series


def _largest_factor(ratios: np.ndarray) -> float:
    """The largest move a series of ratios makes, either way (0.5 and 2 both count as 2x)."""
    return float(np.max(np.maximum(ratios, 1.0 / ratios)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="at least 2: the noise is how two p = 0 rounds differ")
    parser.add_argument("--out", type=Path, default=Path("outputs/example_dst"))
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds} must be at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    table = (args.out / "tiny_gpt_latency.json").resolve()
    starts = {"analytic": None, "profiled": table}
    if not table.exists():  # profiled once, outside the timed runs
        run((args.out / "profile_run").resolve(), 1, 0.0, table)
    results: dict[tuple[str, float], list[dict[str, np.ndarray]]] = {}
    for r in range(args.rounds):
        for start, path in starts.items():
            for p in (0.1, 0.0):
                out = (args.out / f"{start}-p{p}-round{r}").resolve()
                results.setdefault((start, p), []).append(run(out, args.steps, p, path))
                last = results[(start, p)][-1]
                print(f"round {r} {start} p={p}: mean imbalance {last['dst/measured_imbalance'].mean():.3f}, "
                      f"other work {last['other_cores'][0]:.2f} cores", flush=True)
    print("\n| start | p | mean measured imbalance (rounds) | vs p = 0 (rounds) | largest anchor move, same documents "
          "(with the workload's change) | steps worse than p = 0 by more than the noise | final prediction error | "
          "other work, cores (mean, max) |")
    print("|---|---|---|---|---|---|---|---|")
    for start in starts:
        static = np.array([s["dst/measured_imbalance"] for s in results[(start, 0.0)]])
        noise = max(np.abs(a - b).max() for i, a in enumerate(static) for b in static[i + 1:])
        for p in (0.1, 0.0):
            runs = results[(start, p)]
            measured = np.array([s["dst/measured_imbalance"] for s in runs])
            move = max(_largest_factor(s["dst/anchor_s"][1:] / s["dst/anchor_s"][:-1]) for s in runs)
            drift = max(_largest_factor(s["dst/anchor_drift"]) for s in runs)
            worse = int((measured.mean(0) - static.mean(0) > noise).sum()) if p > 0 else 0
            per_round = " / ".join(f"{m:.3f}" for m in measured.mean(1))
            gains = " / ".join(f"{g:.3f}" for g in static.mean(1) / measured.mean(1))
            error = np.mean([s["dst/prediction_error"][-1] for s in runs])
            others = np.array([s["other_cores"][0] for s in runs])
            print(f"| {start} | {p} | {measured.mean():.3f} ({per_round}) | {static.mean() / measured.mean():.3f}x "
                  f"({gains}) | {drift:.2f}x ({move:.2f}x) | {worse} of {measured.shape[1]} (noise {noise:.3f}) "
                  f"| {error:.3f} | {np.nanmean(others):.2f}, {np.nanmax(others):.2f} |")
    for start in starts:
        static = np.array([s["dst/measured_imbalance"].mean() for s in results[(start, 0.0)]])
        tuned = np.array([s["dst/measured_imbalance"].mean() for s in results[(start, 0.1)]])
        spread = static.max() - static.min()
        cut = 1.0 - tuned / static
        held = int(((cut >= TARGET_CUT) & (static - tuned > spread)).sum())
        print(f"{start}: DST cut the mean imbalance by {' / '.join(f'{100 * c:.1f}%' for c in cut)} against p = 0 in "
              f"the same rounds; p = 0 varied by {spread:.3f} between rounds; at least {100 * TARGET_CUT:.0f}% and "
              f"beyond that spread in {held} of {len(cut)} rounds")


if __name__ == "__main__":
    main()
