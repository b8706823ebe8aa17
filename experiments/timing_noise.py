"""How far this machine's clock strays for the same work: one micro-batch on every emulated rank.

An emulated step lasts as long as its slowest rank's measured compute, so the spread of a rank's time for the
same work sets how far above its mean rank even a perfectly balanced step ends (the noise ceiling of
``benchmarks/simulate.py check``). The check infers the ranks' spread from their times against the cost model's
predictions, which holds the model's own error too. Here every emulated rank gets the same micro-batch, so
their times differ by the machine alone. Reported per micro-batch: the spread (``simulation.rank_noise``, the
same robust estimate as the check's), the lag-1 correlation of successive times (positive: slow spells,
not independent draws), and the expected slowest of N ranks over the median at that spread. With
``--median-of 3`` each timing is the median of three runs, as ``end_to_end.py --repeats 3`` times a rank.

    python experiments/timing_noise.py --config configs/demo.yaml --config configs/experiments/narrow16k.yaml \\
        --init outputs/sharp_narrow/hf --threads 1 --repeats 12 --out outputs/timing_noise
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml

from sparsebalance_pl.datamodules.packing import collate_packed, first_fit
from sparsebalance_pl.emulation import EmulatedRanks, build
from sparsebalance_pl.simulation import expected_epoch_seconds, rank_noise
from sparsebalance_pl.variants import merged_configs

RANK_COUNTS = (8, 16, 32)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, action="append", required=True,
                        help="configuration files, stacked in order as for main.py")
    parser.add_argument("--init", default="none", help="Hugging Face model directory, or 'none' for random init")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=12, help="timings of each micro-batch (emulated ranks)")
    parser.add_argument("--median-of", type=int, default=1,
                        help="each timing the median of this many runs, as `end_to_end.py --repeats` times a rank")
    parser.add_argument("--out", type=Path, default=Path("outputs/timing_noise"))
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats} must be at least 3")
    if args.median_of < 1:
        parser.error(f"--median-of {args.median_of} must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be at least 1")
    return args


def micro_batches(lengths: np.ndarray, max_tokens: int) -> dict[str, list[int]]:
    """Two kinds of work: the longest document alone, and documents from the middle of the length
    distribution packed up to ``max_tokens`` (document indices)."""
    order = np.argsort(-lengths, kind="stable")
    packed = first_fit(lengths, order[len(order) // 4:], max_tokens)[0]  # the first micro-batch first-fit packs
    return {"longest document": [int(order[0])], "middle documents packed": [int(i) for i in packed]}


def spread(seconds: list[float]) -> dict:
    """The summary of one micro-batch's times over the emulated ranks (module docstring)."""
    logs = np.log(seconds)
    noise = rank_noise([logs.tolist()])
    centred = logs - logs.mean()
    lag1 = float((centred[1:] * centred[:-1]).sum() / max((centred * centred).sum(), 1e-30))
    slowest = {n: expected_epoch_seconds([[1.0] * n], noise) for n in RANK_COUNTS}
    return {"median_s": float(np.median(seconds)), "spread": noise, "lag1_correlation": lag1,
            "max_over_median": max(seconds) / float(np.median(seconds)), "expected_slowest_over_median": slowest}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = merged_configs(args.config)
    if args.init != "none":
        config["model"]["model"] = {"pretrained_path": str(Path(args.init).resolve())}
    config["trainer"].update(logger=False, callbacks=[])
    args.out.mkdir(parents=True, exist_ok=True)
    config_path = args.out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    module, data, _ = build(["--config", str(config_path)])
    items = data.items("train")
    lengths = np.array([len(items[i]["tokens"]) for i in range(len(items))])
    ranks = EmulatedRanks(module, args.repeats, total_steps=1, repeats=args.median_of)
    results = {"threads": torch.get_num_threads(), "repeats": args.repeats, "median_of": args.median_of,
               "micro_batches": {}}
    for name, documents in micro_batches(lengths, data.batching.max_tokens).items():
        batch = collate_packed([items[i] for i in documents])
        ranks.warm_up(batch)
        seconds = ranks.step([[batch]] * args.repeats, update=False).rank_seconds
        results["micro_batches"][name] = {"lengths": lengths[documents].tolist(), "seconds": seconds,
                                          **spread(seconds)}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def table(results: dict) -> str:
    head = " | ".join(f"slowest of {n} / median" for n in RANK_COUNTS)
    lines = [f"| micro-batch | tokens | median s | spread | lag-1 corr. | max / median | {head} |",
             "|" + "---|" * (6 + len(RANK_COUNTS))]
    for name, r in results["micro_batches"].items():
        slowest = " | ".join(f"{r['expected_slowest_over_median'][n]:.3f}" for n in RANK_COUNTS)
        lines.append(f"| {name} | {sum(r['lengths'])} | {r['median_s']:.3f} | {r['spread']:.3f} | "
                     f"{r['lag1_correlation']:+.2f} | {r['max_over_median']:.3f} | {slowest} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
