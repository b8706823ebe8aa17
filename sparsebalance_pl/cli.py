"""Command line: ``python main.py {fit,validate,test,profile} --config configs/<name>.yaml`` and ``python main.py
export --ckpt_path <checkpoint> --out_dir <dir>``.

``fit``, ``validate`` and ``test`` go through LightningCLI. Every setting is checked when the configuration is
parsed and the classes are built, in the launching process and before any process group starts; a bad one
ends the run with a single line naming the setting and what is allowed (exit code 2), not a traceback.
Under SLURM, ``fit`` checkpoints and requeues the job on SLURM's warning signal (``SlurmRequeue``).

``profile`` measures the latency table of this device for the configuration's model and kernels and writes
it where the configuration's ``model.latency_table`` points (or ``--output``).

``export`` writes a training checkpoint (a file, or FSDP2's sharded folder) as a Hugging Face model directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.cli import LightningCLI

from sparsebalance_pl import export
from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.model import ModelConfig

from sparsebalance_pl.callbacks import DynamicSparsityTuning
from sparsebalance_pl.datamodules.datamodule import LongContextDataModule
from sparsebalance_pl.errors import ConfigError, DataError, TrainingError
from sparsebalance_pl.module import SparseQwen
from sparsebalance_pl.slurm import SlurmRequeue


class SparseBalanceCLI(LightningCLI):
    """LightningCLI with the checks that need both the model and the data module."""

    def _check_model_and_data(self) -> None:
        vocab = self.model.dims.vocab_size
        if self.datamodule.vocab_size > vocab:
            raise ConfigError(
                f"data.tokenizer has {self.datamodule.vocab_size} tokens but model vocab_size is {vocab}; "
                "use a model with a vocabulary at least as large"
            )
        longest = self.model.dims.max_position_embeddings
        if self.datamodule.max_doc_tokens > longest:
            raise ConfigError(
                f"data.max_doc_tokens={self.datamodule.max_doc_tokens} exceeds the model's "
                f"max_position_embeddings={longest}"
            )
        data = self.datamodule
        if data.longbench and data.eval_longbench_max_tokens + data.eval_max_new_tokens > longest:
            raise ConfigError(
                f"data.eval_longbench_max_tokens={data.eval_longbench_max_tokens} plus data.eval_max_new_tokens="
                f"{data.eval_max_new_tokens} exceeds the model's max_position_embeddings={longest}"
            )
        if self.trainer.world_size > 1 and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ConfigError(
                "trainer.use_distributed_sampler must be false: the data module shards its own batch plan"
            )

    def _connect(self) -> None:
        """Hand the module's cost model to the data module and the DST callbacks: one object, one owner."""
        cost_model = self.model.cost_model
        self.datamodule.connect(cost_model)
        for callback in self.trainer.callbacks:
            if isinstance(callback, DynamicSparsityTuning):
                callback.connect(cost_model)

    def before_fit(self) -> None:
        self._check_model_and_data()
        self._connect()
        if self.datamodule.micro_batches != self.trainer.accumulate_grad_batches:
            raise ConfigError(
                f"data.micro_batches={self.datamodule.micro_batches} must equal trainer.accumulate_grad_batches="
                f"{self.trainer.accumulate_grad_batches}: the plan balances each optimiser step's micro-batches"
            )
        if SLURMEnvironment.detect() and not any(isinstance(c, SlurmRequeue) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(SlurmRequeue())

    def before_validate(self) -> None:
        self._check_model_and_data()

    def before_test(self) -> None:
        self._check_model_and_data()
        self.model.evaluations = self.datamodule.evaluations()


def profile(argv: list[str]) -> Path:
    """``main.py profile``: the latency table of this device for a configuration's model and kernels."""
    parser = argparse.ArgumentParser(prog="main.py profile", description=profile.__doc__)
    parser.add_argument("--config", required=True, help="a fit configuration (its model and data sections)")
    parser.add_argument("--output", help="table path (default: the configuration's model.latency_table)")
    parser.add_argument("--full", action="store_true",
                        help="the finer full grid instead of the quick one (several times longer)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parsed = parser.parse_args(argv)
    from sparsebalance_pl.cost.profiler import profile_hardware

    config = yaml.safe_load(Path(parsed.config).read_text())
    module_cfg = config.get("model", {})
    output = parsed.output or module_cfg.get("latency_table")
    if output is None:
        raise ConfigError("main.py profile needs --output or model.latency_table in the configuration")
    attention = AttentionConfig(**module_cfg.get("attention", {}))
    device = parsed.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = str(config.get("trainer", {}).get("precision", "32")).startswith("bf16") and device != "cpu"
    profile_hardware(
        ModelConfig(**module_cfg.get("model", {})).dims(),
        device=device,
        dtype=torch.bfloat16 if bf16 else torch.float32,
        block_size=attention.block_size,
        stride=attention.stride,
        quick=not parsed.full,
        max_length=int(config.get("data", {}).get("max_tokens", 8192)),
        output=output,
    )
    print(f"latency table written to {output}")
    return Path(output)


def main(args: list[str] | None = None) -> SparseBalanceCLI | Path | None:
    argv = sys.argv[1:] if args is None else args
    try:
        if argv[:1] == ["profile"]:
            return profile(argv[1:])
        if argv[:1] == ["export"]:
            return export.main(argv[1:])
        return SparseBalanceCLI(
            SparseQwen,
            LongContextDataModule,
            trainer_defaults={"use_distributed_sampler": False},
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except Exception as err:
        cause = _named_cause(err)
        if cause is None:
            raise
        print(f"error: {_last_line(cause)}", file=sys.stderr)
        sys.exit(2)


def _last_line(err: BaseException) -> str:
    """The message itself, also where a DataLoader worker raised it (torch re-raises it in the main process
    with the worker's traceback in the message, ending with the original ``Type: message`` line)."""
    message = str(err)
    if message.startswith("Caught ") and "Original Traceback" in message:
        return message.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return message


def _named_cause(err: BaseException | None) -> BaseException | None:
    """Our own error, also where the configuration parser re-raised it as the cause of its own (a callback's
    settings are checked while jsonargparse builds the callback list)."""
    while err is not None:
        if isinstance(err, (ConfigError, DataError, TrainingError)):
            return err
        err = err.__cause__
    return None
