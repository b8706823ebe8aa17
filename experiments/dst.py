"""Static budget against dynamic sparsity tuning: 2 FSDP2 ranks on the CPU, demo model, a straggler by construction.

Every step rank 0 trains on one long document and rank 1 on several short ones with the same total tokens,
so rank 0 is the straggler by construction: by default 8192 tokens against eight documents of 1024. With
the mean anchor the step cannot become shorter than the mean of the two ranks' times (the fast rank cannot
come up to meet the straggler once it keeps every block), so the speed-up is at most 2I / (I + 1) for a
whole-step ratio I between the ranks; at 4096 tokens a model with sharp attention leaves I near 1.3, too
little imbalance to show what DST does. Variants: the static budget (``p=0``: the callback only
measures) and DST with anchors min, mean, max, adaptive and p in 0.05, 0.1, 0.2. Variants alternate inside
one run (same data, same seed, each from a fresh model) and the first ``--warmup`` steps of each, while the
latency model calibrates, are left out. Reported per variant: median step time (rank 0's wall time from
batch start to batch end, which includes waiting for the other rank in FSDP's collectives), its ratio to
static, median measured imbalance of the attention calls, and mean exact recall (sampled rows) per rank.
The regime line gives the mean density and recall at the base budget (the regime: sharp attention keeps few
blocks at tau 0.9, near-uniform attention keeps about tau of them). ``--out`` gets the
summaries and every measured step's DST metrics as JSON. Timings on a shared CPU are noisy: read the
ratios, not the absolute times.

    python experiments/dst.py [--tokens 8192] [--short-docs 8] [--steps 8] [--warmup 3] [--rounds 1] [--init DIR]
        [--latency-table outputs/latency_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.callbacks.dst import DynamicSparsityTuning
from sparsebalance_pl.datamodules.packing import collate_packed
from sparsebalance_pl.model import ModelConfig
from sparsebalance_pl.module import OptimConfig, SparseCausalLM
from sparsebalance_pl.strategy import FSDP2Strategy

VARIANTS = [("static", 0.0)] + [(a, p) for p in (0.05, 0.1, 0.2) for a in ("min", "mean", "max", "adaptive")]


class StepRecorder(L.Callback):
    """Rank 0's wall time per step and the DST metrics logged in it."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("dst/")}
        self.rows.append({"step_s": time.perf_counter() - self._start, **row})


def workload(rank: int, tokens: int, short_docs: int, vocab: int) -> dict:
    """Rank 0: one document of ``tokens``; rank 1: ``short_docs`` documents of the same total."""
    generator = torch.Generator().manual_seed(rank)
    lengths = [tokens] if rank == 0 else [tokens // short_docs] * short_docs
    return collate_packed([{"tokens": torch.randint(vocab, (n,), generator=generator).numpy()} for n in lengths])


def run_variant(anchor: str, p: float, args: argparse.Namespace) -> list[dict[str, float]]:
    torch.manual_seed(0)
    module = SparseCausalLM(
        model=ModelConfig(preset="demo") if args.init == "none" else ModelConfig(pretrained_path=args.init),
        attention=AttentionConfig(tau=0.9, recall_rows=64),
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
        latency_table=args.latency_table,
        latency_profile=args.latency_table is not None,
    )
    recorder = StepRecorder()
    dst = DynamicSparsityTuning(anchor="mean" if anchor == "static" else anchor, p=p)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=args.steps, logger=False,
        callbacks=[dst, recorder], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False,
    )
    batch = workload(int(trainer.global_rank), args.tokens, args.short_docs, module.dims.vocab_size)
    trainer.fit(module, DataLoader([batch] * args.steps, batch_size=None))
    return recorder.rows[args.warmup:]


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    return {
        "step_s": median("step_s"),
        "measured_imbalance": median("dst/measured_imbalance"),
        **{f"{what}{r}": mean(f"dst/rank{r}/{what}") for r in (0, 1) for what in ("recall", "density", "tau")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--short-docs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--init", default="none",
        help="Hugging Face directory to start from (the sharp regime, e.g. `main.py export` of a trained demo "
        "checkpoint), or 'none' for random initialisation (the near-uniform regime)",
    )
    parser.add_argument("--only", nargs="*", help="variants as anchor:p, e.g. static:0 mean:0.1")
    parser.add_argument(
        "--latency-table", default=None,
        help="latency table JSON for this machine and the demo model, profiled first if missing (about a "
        "minute); default: the analytic prior, whose non-attention terms DST cannot calibrate (it times only "
        "the attention calls), so its budget moves may be too small or too large",
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_dst.json"))
    args = parser.parse_args()
    variants = [(a, float(p)) for a, p in (v.split(":") for v in args.only)] if args.only else VARIANTS
    rows: dict[str, list] = {f"{a} p={p:g}": [] for a, p in variants}
    for _ in range(args.rounds):
        for anchor, p in variants:
            rows[f"{anchor} p={p:g}"] += run_variant(anchor, p, args)
    if torch.distributed.get_rank() != 0:
        return
    results = {name: summarise(r) for name, r in rows.items()}
    static = results.get("static p=0")
    if static:
        print(f"regime ({'random initialisation' if args.init == 'none' else args.init}; static, base budget tau=0.9): mean density rank0 {static['density0']:.3f} rank1 "
              f"{static['density1']:.3f}; exact recall rank0 {static['recall0']:.3f} rank1 {static['recall1']:.3f}")
    print(f"{'variant':<16}{'step s':>8}{'static/x':>9}{'imbal':>7}{'tau0':>6}{'tau1':>6}{'rec0':>7}{'rec1':>7}"
          f"{'tok-w rec':>10}")
    for name, s in results.items():
        ratio = static["step_s"] / s["step_s"] if static else float("nan")
        print(f"{name:<16}{s['step_s']:8.3f}{ratio:9.2f}{s['measured_imbalance']:7.2f}{s['tau0']:6.2f}"
              f"{s['tau1']:6.2f}{s['recall0']:7.3f}{s['recall1']:7.3f}{(s['recall0'] + s['recall1']) / 2:10.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "steps": rows}
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
