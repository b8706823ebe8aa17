"""Command line: ``python main.py {fit,validate,test,profile,export,convert} --config configs/<name>.yaml``.

All are subcommands of one LightningCLI and read the same ``model``, ``data`` and ``trainer`` sections, so
``--config`` files stack (later ones win) and dotted overrides (``--model.attention.block_size=32``) work alike.
Every setting is checked when the configuration is parsed and the classes are built, in the launching process
and before any process group starts (``sparsebalance_pl.preflight`` for what Lightning would find only later);
a bad one ends the run with a single line naming the setting and what is allowed (exit code 2), not a
traceback. So do the parser's errors, what Lightning's Trainer and fit loop raise about their settings, and
the errors of ours that only the ranks can find, damaged data or checkpoints (``_named_cause``).

``fit``, ``validate`` and ``test`` run the Trainer; under SLURM, ``fit`` checkpoints and requeues the job on
SLURM's warning signal (``SlurmRequeue``). ``profile`` (this device's latency table), ``export`` (a checkpoint
as a Hugging Face directory) and ``convert`` (a GGUF model as a Hugging Face directory of its own family) are the
functions
of ``COMMANDS``, whose signatures give their settings.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from sparsebalance_pl.cost.profiler import profile_hardware, training_dtype
from sparsebalance_pl.context_parallel import context_parallel_groups
from sparsebalance_pl.convert import convert
from sparsebalance_pl.datamodules.datamodule import LongContextDataModule
from sparsebalance_pl.distributed import leave_process_group
from sparsebalance_pl.errors import ConfigError, DataError, TrainingError
from sparsebalance_pl.export import export_checkpoint
from sparsebalance_pl.module import SparseCausalLM
from sparsebalance_pl.preflight import check_accelerator, check_ckpt_path, check_kernel_backend, picked_by_lightning
from sparsebalance_pl.slurm import SlurmRequeue
from sparsebalance_pl.strategy import FSDP2Strategy


class SparseBalanceCLI(LightningCLI):
    """LightningCLI with the checks that need both the model and the data module, and our own subcommands."""

    result: Path | None = None
    """What the command of ``COMMANDS`` that ran returned."""

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        """Lightning's subcommands (Trainer methods), then ours (``COMMANDS``), described by their docstrings."""
        super()._add_subcommands(parser, **kwargs)
        for name, command in COMMANDS.items():
            description = inspect.getdoc(command).splitlines()[0]
            command_parser = self.init_parser(description=description)
            command_parser.add_function_arguments(command, skip=_SECTIONS)
            self._add_arguments(command_parser)
            self._subcommand_parsers[name] = command_parser
            parser._subcommands_action.add_subcommand(name, command_parser, help=description)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Lightning's, without its warning that ``args`` came while ``sys.argv`` holds arguments: ``main(args)`` is
        how the benchmarks and tests run a command from scripts with command lines of their own, and only ``args``
        is parsed then."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """``export`` reads its checkpoint itself; Lightning's would parse the model's settings out of it."""
        if self.config.get("subcommand") not in COMMANDS:
            super()._parse_ckpt_path()

    def instantiate_classes(self) -> None:
        """Our commands get no Trainer, and the model and data module only when they take a section: ``export``
        builds nothing from a configuration (its checkpoint holds the model)."""
        if self.subcommand not in COMMANDS:
            return super().instantiate_classes()
        takes = inspect.signature(COMMANDS[self.subcommand]).parameters.keys()
        self.config_init = self.parser.instantiate_classes(self.config) if takes & _SECTIONS else self.config

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's call a Trainer method; ours get their settings and the sections they name."""
        if subcommand not in COMMANDS:
            return super()._run_subcommand(subcommand)
        command = COMMANDS[subcommand]
        settings = self.config_init[subcommand]
        self.result = command(**{name: settings[name] for name in inspect.signature(command).parameters})

    def before_instantiate_classes(self) -> None:
        """Check the Trainer's settings that need nothing built, before anything is."""
        if self._runs_trainer():
            settings = self.config[self.subcommand]
            check_accelerator(settings.trainer.accelerator, settings.get("config") or ())
            check_kernel_backend(self.subcommand, settings.model.get("attention"), settings.trainer.accelerator)
            check_ckpt_path(settings.ckpt_path)

    def after_instantiate_classes(self) -> None:
        """Tell the strategy whether the checkpoint it will load was named by the user or picked by Lightning."""
        if self._runs_trainer() and isinstance(self.trainer.strategy, FSDP2Strategy):
            self.trainer.strategy.fall_back_to_intact = picked_by_lightning(self.config[self.subcommand].ckpt_path)

    def _runs_trainer(self) -> bool:
        """Whether the command is one of the Trainer's (``fit``, ``validate``, ``test``); none is with ``run=False``."""
        return self.subcommand is not None and self.subcommand not in COMMANDS

    def _check_model_and_data(self) -> None:
        vocab = self.model.dims.vocab_size
        if self.datamodule.vocab_size > vocab:
            raise ConfigError(
                f"data.corpus.tokenizer has {self.datamodule.vocab_size} tokens but model vocab_size is {vocab}; "
                "use a model with a vocabulary at least as large"
            )
        longest = self.model.dims.max_position_embeddings
        if self.datamodule.corpus.max_doc_tokens > longest:
            raise ConfigError(
                f"data.corpus.max_doc_tokens={self.datamodule.corpus.max_doc_tokens} exceeds the model's "
                f"max_position_embeddings={longest}"
            )
        data = self.datamodule
        if data.longbench and data.longbench_max_tokens + data.evaluation.max_new_tokens > longest:
            raise ConfigError(
                f"data.evaluation.longbench_max_tokens={data.longbench_max_tokens} plus data.evaluation.max_new_tokens="
                f"{data.evaluation.max_new_tokens} exceeds the model's max_position_embeddings={longest}"
            )
        group_size = getattr(self.trainer.strategy, "context_parallel_size", 1)
        context_parallel_groups(self.trainer.world_size, group_size, self.trainer.num_devices)
        data.slot_batching(group_size)
        if self.trainer.world_size > 1 and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ConfigError(
                "trainer.use_distributed_sampler must be false: the data module shards its own batch plan"
            )

    def _connect(self) -> None:
        """Hand the cost model of the module's sparse attention to the data module: one object, one owner (DST
        reads it from the module)."""
        self.datamodule.connect(self.model.sparse_attention.cost_model)

    def before_fit(self) -> None:
        self._check_model_and_data()
        self._connect()
        if self.datamodule.batching.micro_batches != self.trainer.accumulate_grad_batches:
            raise ConfigError(
                f"data.batching.micro_batches={self.datamodule.batching.micro_batches} must equal "
                f"trainer.accumulate_grad_batches="
                f"{self.trainer.accumulate_grad_batches}: the plan balances each optimiser step's micro-batches"
            )
        if SLURMEnvironment.detect() and not any(isinstance(c, SlurmRequeue) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(SlurmRequeue())

    def before_validate(self) -> None:
        self._check_model_and_data()

    def before_test(self) -> None:
        self._check_model_and_data()
        self.model.evaluations = self.datamodule.evaluations()


def profile(
    model: SparseCausalLM,
    data: LongContextDataModule,
    trainer: Namespace,
    output: str | None = None,
    full: bool = False,
    device: str | None = None,
) -> Path:
    """Measure this device's latency table for the configuration's model and kernels.

    Args:
        output: where to write the table (default: the configuration's model.latency_table)
        full: the finer full grid instead of the quick one (several times longer)
        device: the device to measure, e.g. cuda or cpu (default: the one trainer.accelerator trains on)
    """
    output = output or model.latency_table
    if output is None:
        raise ConfigError("main.py profile needs --output or model.latency_table in the configuration")
    device = device or _device_of(trainer.accelerator)
    attention = model.sparse_attention.config
    profile_hardware(
        model.model_config.hf_config(),
        device=device,
        dtype=training_dtype(trainer.precision, device),
        block_size=attention.block_size,
        stride=attention.stride,
        selection=attention.selection_options(),
        quick=not full,
        max_length=data.batching.max_tokens,
        output=output,
    )
    print(f"latency table written to {output}")
    return Path(output)


def _device_of(accelerator: object) -> str:
    """The device ``trainer.accelerator`` trains on, whose latencies the run's plans need."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    if accelerator in ("cpu", "auto"):
        return "cpu"
    raise ConfigError(f"main.py profile cannot tell the device of trainer.accelerator={accelerator!r}; pass --device")


def export(ckpt_path: str, out_dir: str) -> Path:
    """Write a training checkpoint as a Hugging Face model directory (for model.model.pretrained_path).

    Args:
        ckpt_path: a checkpoint file, or FSDP2's distributed-checkpoint folder
        out_dir: the Hugging Face model directory to write
    """
    out = export_checkpoint(ckpt_path, out_dir)
    print(f"model written to {out} (use it with model.model.pretrained_path={out})")
    return out


COMMANDS: dict[str, Callable[..., Path]] = {"profile": profile, "export": export, "convert": convert}
"""Subcommands besides Lightning's, by name; a new one is one more entry. A parameter named after a configuration
section (``_SECTIONS``) receives it, built; the others are the command's settings (``--name``), documented in its
docstring, whose first line is the command's help."""

_SECTIONS = {"model", "data", "trainer"}


def main(args: list[str] | None = None, run: bool = True) -> SparseBalanceCLI | Path:
    """The command line; ``run=False`` parses and builds the configuration's classes and runs nothing (no
    subcommand in ``args`` then)."""
    try:
        cli = SparseBalanceCLI(
            SparseCausalLM,
            LongContextDataModule,
            trainer_defaults={"use_distributed_sampler": False},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"exit_on_error": False},  # a parse error is raised, and said in one line below
            args=args,
            run=run,
        )
    except Exception as err:
        cause = _named_cause(err)
        if cause is None:
            raise
        # One write per line: the ranks share stderr, and print's separate newline let two ranks' lines run together.
        sys.stderr.write(f"error: {_one_line(cause)}\n")
        if leave_process_group():
            # A rank of a launched run skips the interpreter's teardown: torch's and gloo's threads still alive
            # then can abort it ("terminate called without an active exception", exit code -6 instead of 2).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        sys.exit(2)
    return cli.result if cli.subcommand in COMMANDS else cli


def _one_line(err: BaseException) -> str:
    """The message in one line: where a DataLoader worker raised it, its last line (torch re-raises it in the
    main process with the worker's traceback in the message, ending with the original ``Type: message`` line);
    the parser's as ``_parser_message`` shortens it."""
    message = str(err)
    if message.startswith("Caught ") and "Original Traceback" in message:
        return message.rstrip().splitlines()[-1].split(": ", 1)[-1]
    if isinstance(err, ArgumentError):
        return f"{_parser_message(message)} (--help lists every setting)"
    return message


def _parser_message(message: str) -> str:
    """jsonargparse's message in one line: the keys it nests (``Parser key "trainer.strategy":`` around
    ``Parser key "timeout":``), then what the innermost one expected and the value given to it, leaving out the
    type names it lists on the way."""
    lines = [line.strip().removeprefix("- ") for line in message.splitlines() if line.strip()]
    keys = [(i, match) for i, line in enumerate(lines) if (match := re.match(r'Parser key "([^"]+)":\s*(.*)', line))]
    if not keys:
        return " ".join(lines)
    innermost, match = keys[-1]
    reasons = [match.group(2)] if match.group(2) else []
    given = False
    for line in lines[innermost + 1:]:
        if line.startswith(_PARSER_JARGON) or (given and line.startswith("Given value:")):
            continue
        given = given or line.startswith("Given value:")
        reasons.append(line)
    return f"{' / '.join(m.group(1) for _, m in keys)}: {'; '.join(reasons)}"


_PARSER_JARGON = ("Does not validate", "Subtypes:", "Errors:", "Given value type:", "Expected a <class 'NoneType'>")


def _named_cause(err: BaseException | None) -> BaseException | None:
    """The error that a user's input caused, to be said in one line; None for any other (a bug, whose traceback
    is wanted). Our own errors come first, also where the configuration parser re-raised one as the cause of its
    own (a callback's settings are checked while jsonargparse builds the callback list); then the parser's own,
    and Lightning's about its settings (``_raised_by_lightning``)."""
    chain = []
    while err is not None:
        chain.append(err)
        err = err.__cause__
    ours = [e for e in chain if isinstance(e, (ConfigError, DataError, TrainingError))]
    theirs = [e for e in chain if isinstance(e, ArgumentError) or _raised_by_lightning(e)]
    return (ours + theirs + [None])[0]


def _raised_by_lightning(err: BaseException) -> bool:
    """Whether Lightning itself raised ``err`` to refuse a setting: a ``MisconfigurationException``, or a
    ``ValueError``, ``TypeError`` or ``ImportError`` raised in Lightning's own code (the Trainer's checks of its
    arguments, the fit loop's of its intervals, a missing requirement of the accelerator asked for)."""
    if not isinstance(err, (MisconfigurationException, ValueError, TypeError, ImportError)):
        return False
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_globals.get("__name__", "").startswith("lightning.")
