"""Every step of an emulated run (``benchmarks/end_to_end.py --ranks N --out DIR``), read off its results.json:
the step's time and its ranks' spread, token-weighted exact recall, and what DST's moves did there.

Per step: the slowest and the mean rank's seconds, the step's recall, and the ranks DST cut and raised (a rank
counts as moved where its mean density differs from its base budget's by ``MIN_MOVE`` or more), each group with
its mean density against the base budget's, its mean exact recall (and the base budget's, where the run
measured it on the same rows: the price of the group's move is their difference per unit of ``log_move``, the
unit the adaptive anchor prices in) and its estimated recall against the base budget's. Packs of one document of
the run's longest length, at their base budget, are summed up per variant too, with what the price probes measured
on them where the run had them, and the recall prices by length the variant's epoch started from (its
``calibrated_state.json``)::

    python experiments/emulated_steps.py outputs/e2e_32f_probes

``--replay VARIANT STEP`` replays DST's decision of one step against what it did: the variant's controller and
cost model are rebuilt from the state its epoch started with, taught the variant's own earlier steps in order
(as the run taught them, but for the optimiser's time, which DST does not read), and asked for that step's
budgets; per rank the planned density (rho0 to the target, ``rank_budget``'s) beside the measured one (base
budget to the budget used), the price the adaptive anchor's recall model used beside the one the move cost on the
same rows, the cost model's predicted attention seconds at the density used beside the measured ones and the
rank's whole measured seconds; then the step's predicted and measured change of recall, and per group of ranks
(cut, raised, unmoved) the medians of measured over predicted attention time and of measured over planned
move::

    python experiments/emulated_steps.py outputs/e2e_32f_bylength --replay sparsebalance 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from sparsebalance_pl.comparison import calibrated_state, load_results, prepare_variant
from sparsebalance_pl.cost.recall import RecallPrices, length_class, log_move
from sparsebalance_pl.variants import merged_configs

#: As the adaptive anchor's prices (``RecallPrices.MIN_MOVE``): smaller differences are rounding of kept tiles.
MIN_MOVE = 1e-3


def _mean(values) -> float:
    return statistics.fmean(values) if values else float("nan")


def _per_move(recall: float, move: float) -> float:
    return recall / move if move else float("nan")


def _density(report: dict, key: str = "density") -> float:
    return _mean(report[key])


def _moved(report: dict) -> float:
    """Mean density minus the base budget's; 0 for a report without base figures (a run before they existed)."""
    return _density(report) - _density(report, "base_density") if report.get("base_density") else 0.0


def _kind(report: dict) -> str:
    """Whether DST cut, raised or left the report's rank (``MIN_MOVE``)."""
    moved = _moved(report)
    return "cut" if moved <= -MIN_MOVE else "raised" if moved >= MIN_MOVE else "unmoved"


def group(reports: list[dict]) -> dict:
    """Count, mean density, base density, exact recall, base exact recall (None where not measured) and the
    exact price (per unit of ``log_move``, as the adaptive anchor's) of a group of ranks' reports."""
    base_recall = [r["base_recall"] for r in reports if r.get("base_recall") is not None]
    probes = [(_density(r, "base_density"), r["probe_moves"]) for r in reports if r.get("probe_moves")]
    summary = {"ranks": len(reports), "density": _mean([_density(r) for r in reports]),
               "base_density": _mean([_density(r, "base_density") for r in reports if r.get("base_density")]),
               "recall": _mean([r["recall"] for r in reports]), "base_recall": None, "price": None,
               "estimated_recall": _mean([_density(r, "estimated_recall") for r in reports]),
               "base_estimated_recall": _mean([_density(r, "base_estimated_recall") for r in reports
                                               if r.get("base_estimated_recall")]),
               # the price probes' (cut, raise) exact recall per unit of log_move, over the group's ranks (NaN
               # where the probes could not move: a raise at full density)
               "probe_prices": [_per_move(sum(m[i][1] for _, m in probes),
                                          sum(log_move(b, b + m[i][0]) for b, m in probes))
                                for i in (0, 1)] if probes else None}
    if reports and len(base_recall) == len(reports):
        summary["base_recall"] = _mean(base_recall)
        moved = summary["density"] - summary["base_density"]
        if abs(moved) >= MIN_MOVE:
            summary["price"] = (summary["recall"] - summary["base_recall"]) / log_move(summary["base_density"],
                                                                                       summary["density"])
    return summary


def step_rows(variant: dict) -> list[dict]:
    rows = []
    for i, step in enumerate(variant["steps"]):
        records = [record for round_ in step["rounds"] for record in round_["records"]]
        tokens = [sum(record["lengths"]) for record in records]
        reports = [record["report"] for record in records]
        rows.append({
            "step": i, "step_s": step["step_s"], "max_s": max(step["rank_s"]), "mean_s": _mean(step["rank_s"]),
            "recall": sum(t * r["recall"] for t, r in zip(tokens, reports)) / sum(tokens),
            "longest": max(max(record["lengths"]) for record in records),
            "cut": group([r for r in reports if _kind(r) == "cut"]),
            "raised": group([r for r in reports if _kind(r) == "raised"]),
        })
    return rows


def longest_alone(variant: dict, longest: int) -> dict:
    """The packs of one document of ``longest`` tokens at their base budget, over the whole run."""
    return group([record["report"] for step in variant["steps"] for round_ in step["rounds"]
                  for record in round_["records"]
                  if record["lengths"] == [longest] and _kind(record["report"]) == "unmoved"])


def starting_prices(run: Path, name: str) -> RecallPrices:
    """The recall prices that the cost model held when the variant's epoch started; none measured where the run
    kept no such state."""
    state = calibrated_state(run, name)
    prices = RecallPrices()
    prices.load_state_dict(state["cost_model"].get("recall_prices", {}) if state else {})
    return prices


def replayed_decision(run: Path, name: str, step: int) -> dict:
    """DST's decision of the first micro-batch round of step ``step`` of variant ``name``, replayed (module
    docstring), beside what it did."""
    settings, variants, _ = load_results(run)
    state = calibrated_state(run, name)
    if name not in variants or state is None:
        raise SystemExit(f"{run} has no variant {name!r} with a calibrated state to replay from")
    records = variants[name]["steps"][step]["rounds"][0]["records"]
    if any(record["report"].get("base_recall") is None for record in records):
        raise SystemExit(f"step {step} of {name!r} did not measure the base budget's recall on the same rows")
    with tempfile.TemporaryDirectory() as scratch:  # the variant's configuration is written out again there
        controller = prepare_variant(merged_configs(settings.configs), name, replace(settings, out=scratch), 0,
                                     calibrated=state).controller
    cost = controller.cost_model
    cost.warmup_left = 0  # the run's process had warmed up in its calibration steps
    for earlier in variants[name]["steps"][:step]:
        for round_ in earlier["rounds"]:  # as the emulation: each round planned, run, then learned from
            controller.plan([record["lengths"] for record in round_["records"]])
            cost.replay(round_)
    lengths = [record["lengths"] for record in records]
    decision = controller.plan(lengths)
    views = controller.outlooks(lengths)
    prices = [cost.recall_prices.prices(ls) for ls in lengths]  # before the step teaches its own
    done = variants[name]["steps"][step]
    seconds = cost.replay(done["rounds"][0])
    ranks, predicted, measured, tokens = [], 0.0, 0.0, 0
    for r, (record, budget, view, (cut, raised)) in enumerate(zip(records, decision.ranks, views, prices)):
        report, n = record["report"], sum(record["lengths"])
        used, base_density = _density(report), _density(report, "base_density")
        planned = budget.density - view.density
        price = cut if planned < 0 else raised
        kind = _kind(report)
        recall = report["recall"] - report["base_recall"]
        ranks.append({"tokens": n, "class": length_class(record["lengths"]), "kind": kind, "rho0": view.density,
                      "target": budget.density, "base_density": base_density, "density": used, "price": price,
                      "measured_price": None if kind == "unmoved" else recall / log_move(base_density, used),
                      "predicted_s": float(seconds.predicted[r]), "measured_s": float(seconds.measured[r]),
                      "rank_s": done["rank_s"][r]})
        predicted += n * price * log_move(view.density, budget.density)
        measured += n * recall
        tokens += n
    return {"anchor": decision.anchor, "ranks": ranks, "predicted": predicted / tokens, "measured": measured / tokens,
            "groups": {kind: _replay_group([rank for rank in ranks if rank["kind"] == kind])
                       for kind in ("cut", "raised", "unmoved")}}


def _replay_group(ranks: list[dict]) -> dict:
    """Medians over a group of replayed ranks: measured over predicted attention seconds, and the measured move
    (relative to the base budget's density) over the planned one (relative to rho0)."""
    moves = [(r["density"] / r["base_density"] - 1) / planned for r in ranks
             if abs(planned := (r["target"] - r["rho0"]) / r["rho0"]) >= MIN_MOVE]
    return {"ranks": len(ranks),
            "time_ratio": statistics.median(r["measured_s"] / r["predicted_s"] for r in ranks) if ranks else None,
            "move_ratio": statistics.median(moves) if moves else None}


def _group_cell(g: dict) -> str:
    if not g["ranks"]:
        return "-"
    base = "" if g["price"] is None else f" (base {g['base_recall']:.4f}, price {g['price']:.3f})"
    return (f"{g['ranks']}: {g['base_density']:.3f} -> {g['density']:.3f}, recall {g['recall']:.4f}{base}, "
            f"estimated {g['base_estimated_recall']:.4f} -> {g['estimated_recall']:.4f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="an emulated run's --out folder (its results.json)")
    parser.add_argument("--replay", nargs=2, metavar=("VARIANT", "STEP"),
                        help="replay DST's decision of one step of one variant against what it did")
    args = parser.parse_args(argv)
    if args.replay:
        name, step = args.replay[0], int(args.replay[1])
        replay = replayed_decision(args.run, name, step)
        print(f"## {name}, step {step}, replayed: anchor {replay['anchor']:.3f} s\n\n"
              "| rank | tokens | length class | planned density | measured density | price used | measured price "
              "| attention s predicted / measured | rank s |\n|---|---|---|---|---|---|---|---|---|")
        for r, rank in enumerate(replay["ranks"]):
            measured = "-" if rank["measured_price"] is None else f"{rank['measured_price']:.3f}"
            print(f"| {r} | {rank['tokens']} | {rank['class']} | {rank['rho0']:.3f} -> {rank['target']:.3f} | "
                  f"{rank['base_density']:.3f} -> {rank['density']:.3f} | {rank['price']:.3f} | {measured} | "
                  f"{rank['predicted_s']:.2f} / {rank['measured_s']:.2f} | {rank['rank_s']:.2f} |")
        print(f"\nRecall change over the step's tokens: predicted {replay['predicted']:+.4f} (prices times planned "
              f"moves), measured {replay['measured']:+.4f} (on the same rows)")
        for kind, group in replay["groups"].items():
            if group["ranks"]:
                move = "" if group["move_ratio"] is None else (
                    f", measured over planned move (each relative to its base) {group['move_ratio']:.2f}")
                print(f"{kind} ranks: {group['ranks']}, median measured over predicted attention seconds "
                      f"{group['time_ratio']:.3f}{move}")
        return
    variants = json.loads((args.run / "results.json").read_text())["variants"]
    longest = max(max(record["lengths"]) for variant in variants.values() for step in variant["steps"]
                  for round_ in step["rounds"] for record in round_["records"])
    for name, variant in variants.items():
        print(f"## {name}\n\n| step | step s | slowest / mean rank | recall | longest | cut | raised |\n"
              "|---|---|---|---|---|---|---|")
        for row in step_rows(variant):
            print(f"| {row['step']} | {row['step_s']:.2f} | {row['max_s'] / row['mean_s']:.3f} | {row['recall']:.4f} "
                  f"| {row['longest']} | {_group_cell(row['cut'])} | {_group_cell(row['raised'])} |")
        alone = longest_alone(variant, longest)
        if alone["ranks"]:
            probes = "" if alone["probe_prices"] is None else (
                ", the price probes' exact recall per unit of log_move: cut {:.3f}, raise {:.3f}"
                .format(*alone["probe_prices"]))
            print(f"\nPacks of one {longest}-token document at the base budget: {alone['ranks']}, density "
                  f"{alone['density']:.3f}, exact recall {alone['recall']:.4f}, estimated "
                  f"{alone['estimated_recall']:.4f}{probes}")
        print(f"\nRank-seconds over the epoch (every rank's forward and backward): "
              f"{sum(sum(step['rank_s']) for step in variant['steps']):.1f}")
        prices = starting_prices(args.run, name)
        if evidence := prices.evidence():
            print(f"\nRecall prices per unit of log_move at the epoch's start (cut, raise; in brackets the units "
                  f"measured, against the pool's {prices.prior_weight:g}), by the pack's tile-weighted length: "
                  + "; ".join(f"2^{key} {cut:.3f} ({evidence[key][0]:.2f}), {raised:.3f} ({evidence[key][1]:.2f})"
                              for key, (cut, raised) in prices.by_class().items()))
        print()


if __name__ == "__main__":
    main()
