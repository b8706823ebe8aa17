"""Whole-model forward+backward time with dense against sparse attention, on one packed micro-batch.

Answers "is the model faster with the sparse kernels at this length?": the same SparseCausalLM (demo preset,
a named preset, or a trained model via ``--init``) and the same tokens, dense attention against sparse
attention at the given budgets (tau, optionally a density cap), variants alternated repetition by
repetition, medians and ratios to dense printed with the density each budget selected. Random tokens keep
the attention pattern of the model's weights: a randomly initialised model attends near-uniformly, a
trained one sharply, which is what decides the selected density.

    python benchmarks/model_step.py --lengths 4096                       # the demo's longest micro-batch
    python benchmarks/model_step.py --init outputs/sharp/hf --lengths 4096
    python benchmarks/model_step.py --preset qwen2.5-0.5b --lengths 32768 --dtype bf16   # on a GPU
    python benchmarks/model_step.py --init data/smollm2-135m --lengths 4096 --taus 0.9 \
        --attention "quality:block_size=32,estimate=sampled,stride=8,recall_probes=1,tau=0.85"

The spread column is the repetitions' standard deviation over their mean: how steadily this machine times the
same step (``--threads 1`` against the default on a shared CPU). The attention columns are the module's own timing
of its attention calls, selection included, forward and backward, and their share of the step: the rest of the
step is what no density can shorten.

``--attention NAME:field=value,...`` adds a sparse variant with those ``AttentionConfig`` fields (selection options,
block size, stride, tau), so the cost of a selection setting is timed beside the default's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.errors import ConfigError
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import SparseCausalLM
from sparsebalance_pl.variants import attempt, attention_variant

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--init", default=None, help="a Hugging Face model directory (overrides --preset)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096], help="document lengths of the batch")
    parser.add_argument("--taus", type=float, nargs="+", default=[0.9, 0.7])
    parser.add_argument("--max-densities", type=float, nargs="*", default=[], help="extra variants: tau 1 + cap")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention", nargs="*", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="extra sparse variants given by AttentionConfig fields")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    try:  # every variant checked before any model is built
        args.attention = [attention_variant(spec) for spec in args.attention]
    except ConfigError as err:
        parser.error(str(err))
    return args


def build(args: argparse.Namespace, attention: AttentionConfig) -> SparseCausalLM:
    torch.manual_seed(0)
    model = ModelConfig(pretrained_path=args.init) if args.init else ModelConfig(preset=args.preset)
    module = SparseCausalLM(model=model, attention=attention)
    module.configure_model()
    return module.to(device=args.device, dtype=DTYPES[args.dtype])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {"dense": AttentionConfig(backend="dense")}
    variants.update({f"sparse tau={t:g}": AttentionConfig(tau=t) for t in args.taus})
    variants.update({f"sparse cap={d:g}": AttentionConfig(tau=1.0, max_density=d) for d in args.max_densities})
    variants.update(args.attention)
    modules = {name: build(args, cfg) for name, cfg in variants.items()}
    vocab = next(iter(modules.values())).dims.vocab_size
    rng = np.random.default_rng(0)
    batch = collate_packed([{"tokens": rng.integers(0, vocab, n)} for n in args.lengths])
    batch = move_data_to_device(batch, args.device)
    cuda = torch.device(args.device).type == "cuda"

    def step(module: SparseCausalLM) -> tuple[float, float]:
        """Seconds of the step and of its attention calls, forward and backward (the module's own timer)."""
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, tokens = module(batch)
        (loss / tokens).backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        return seconds, module.sparse_attention.micro_batch.timer.seconds()

    times: dict[str, list[float]] = {name: [] for name in modules}
    attention: dict[str, list[float]] = {name: [] for name in modules}
    density: dict[str, float | None] = {}
    failed: dict[str, str] = {}  # variant -> why it did not run

    def figures() -> dict:
        base = statistics.median(times["dense"])
        out = {}
        for name, t in times.items():
            step_s, attention_s = statistics.median(t), statistics.median(attention[name])
            out[name] = {"density": 1.0 if density[name] is None else density[name], "ms": step_s * 1e3,
                         "of_dense": step_s / base, "attention_ms": attention_s * 1e3,
                         "attention_share": attention_s / step_s}
        return out

    def save(variants: dict) -> None:  # after every round: a run cut short by a time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"lengths": args.lengths, "dtype": args.dtype, "variants": variants,
                                                   "failed": failed}))

    for rep in range(args.reps + 1):  # the first round warms up (and compiles Triton kernels)
        for name, module in list(modules.items()):
            timed = attempt(name, failed, step, module)
            if timed is None:
                del modules[name], times[name], attention[name]
                continue
            if rep:
                times[name].append(timed[0])
                attention[name].append(timed[1])
            density[name] = module.sparse_attention.micro_batch.mean_density()
        if "dense" in failed:  # what every ratio needs: only the reasons are left to keep
            save({})
            raise SystemExit(f"dense failed: {failed['dense']}")
        save(figures() if rep else {})
    where = args.init or f"preset {args.preset}"
    print(f"{where}, documents {args.lengths}, {args.dtype} on {args.device}, threads {torch.get_num_threads()}, "
          f"median of {args.reps}")
    print(f"{'variant':<20}{'density':>9}{'ms':>10}{'/ dense':>9}{'spread':>8}{'attn ms':>10}{'attn share':>11}")
    for name, figure in figures().items():
        spread = statistics.pstdev(times[name]) / statistics.fmean(times[name])  # how steadily one step times
        print(f"{name:<20}{figure['density']:>9.3f}{figure['ms']:>10.1f}{figure['of_dense']:>9.3f}{spread:>8.3f}"
              f"{figure['attention_ms']:>10.1f}{figure['attention_share']:>11.3f}")
    for name, why in failed.items():
        print(f"{name:<20}  failed: {why}")
    if failed:
        raise SystemExit(f"{len(failed)} variant(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
