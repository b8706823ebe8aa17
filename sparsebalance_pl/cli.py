"""Command line: ``python main.py {fit,validate,test,profile,export,convert} --config configs/<name>.yaml``.

A table of plain functions (``COMMANDS``), each a subcommand of one jsonargparse parser built with public calls.
Every command reads the same ``model``, ``data`` and ``trainer`` sections, so ``--config`` files stack (later
ones win) and dotted overrides (``--model.attention.block_size=32``) work alike; a command's own settings come
from its signature, those of ``fit``, ``validate`` and ``test`` from the Trainer method of that name. Every
setting is checked when the configuration is parsed and the classes are built, in the launching process and
before any process group starts (``sparsebalance_pl.preflight`` for what Lightning would find only later); a
bad one ends the run with a single line naming the setting and what is allowed (exit code 2), not a traceback.
So do the parser's errors, what Lightning's Trainer and fit loop raise about their settings, and the errors of
ours that only the ranks can find, damaged data or checkpoints (``_named_cause``).

``fit``, ``validate`` and ``test`` run the Trainer on the model and data module that ``SparseBalanceCLI``
builds; under SLURM, ``fit`` checkpoints and requeues the job on SLURM's warning signal (``SlurmRequeue``).
``profile`` (this device's latency table), ``export`` (a checkpoint as a Hugging Face directory) and ``convert``
(a GGUF model as a Hugging Face directory of its own family) build only the sections they take.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from sparsebalance_pl.context_parallel import context_parallel_groups
from sparsebalance_pl.convert import convert
from sparsebalance_pl.cost.profiler import KernelSettings, profile_hardware, training_dtype
from sparsebalance_pl.datamodules.datamodule import LongContextDataModule
from sparsebalance_pl.distributed import end_process
from sparsebalance_pl.errors import ConfigError, DataError, TrainingError
from sparsebalance_pl.export import export_checkpoint
from sparsebalance_pl.module import SparseCausalLM
from sparsebalance_pl.preflight import check_accelerator, check_ckpt_path, check_kernel_backend, picked_by_lightning
from sparsebalance_pl.slurm import SlurmRequeue
from sparsebalance_pl.strategy import FSDP2Strategy


class SparseBalanceCLI(LightningCLI):
    """The model, data module and Trainer of a configuration parsed by the command line, built by LightningCLI
    without running anything: seeded by ``seed_everything``, the configuration saved beside the run's logs, and
    the model's hyperparameters recorded as the configuration gave them, so ``load_from_checkpoint`` can rebuild
    it. Its ``model``, ``datamodule``, ``trainer`` and ``config`` are what ``fit``, ``validate`` and ``test`` run.
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace) -> None:
        self.command_parser = parser
        super().__init__(
            SparseCausalLM, LongContextDataModule, save_config_kwargs={"overwrite": True}, args=config, run=False,
            auto_configure_optimizers=False,  # the module configures its own optimiser and schedule
        )

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        """The command's own parser: the configuration was parsed with it, and it saves it."""
        self.parser = self.command_parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Namespace) -> None:
        """The configuration as the command line parsed it, not parsed again."""
        self.config = args

    def before_instantiate_classes(self) -> None:
        """Check the Trainer's settings that need nothing built, before anything is."""
        check_accelerator(self.config.trainer.accelerator, self.config.get("config") or ())
        check_ckpt_path(self.config.get("ckpt_path"))

    def after_instantiate_classes(self) -> None:
        """Tell the strategy whether the checkpoint it will load was named by the user or picked by Lightning."""
        if isinstance(self.trainer.strategy, FSDP2Strategy):
            self.trainer.strategy.fall_back_to_intact = picked_by_lightning(self.config.get("ckpt_path"))


def check_model_and_data(cli: SparseBalanceCLI) -> None:
    """The settings that only the model, the data module and the Trainer together can check."""
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    vocab = model.dims.vocab_size
    if data.vocab_size > vocab:
        raise ConfigError(
            f"data.corpus.tokenizer has {data.vocab_size} tokens but model vocab_size is {vocab}; "
            "use a model with a vocabulary at least as large"
        )
    longest = model.dims.max_position_embeddings
    if data.corpus.max_doc_tokens > longest:
        raise ConfigError(
            f"data.corpus.max_doc_tokens={data.corpus.max_doc_tokens} exceeds the model's "
            f"max_position_embeddings={longest}"
        )
    if data.longbench and data.longbench_max_tokens + data.evaluation.max_new_tokens > longest:
        raise ConfigError(
            f"data.evaluation.longbench_max_tokens={data.longbench_max_tokens} plus data.evaluation.max_new_tokens="
            f"{data.evaluation.max_new_tokens} exceeds the model's max_position_embeddings={longest}"
        )
    group_size = getattr(trainer.strategy, "context_parallel_size", 1)
    context_parallel_groups(trainer.world_size, group_size, trainer.num_devices)
    data.slot_batching(group_size)
    if trainer.world_size > 1 and cli.config.trainer.use_distributed_sampler:
        raise ConfigError("trainer.use_distributed_sampler must be false: the data module shards its own batch plan")


def fit(cli: SparseBalanceCLI, **settings) -> None:
    """Train the configuration's model on its data module (under SLURM, requeued on SLURM's warning signal).

    The data module plans with the cost model of the module's sparse attention: one object, one owner (DST
    reads it from the module).
    """
    check_model_and_data(cli)
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    data.connect(model.sparse_attention.cost_model)
    if data.batching.micro_batches != trainer.accumulate_grad_batches:
        raise ConfigError(
            f"data.batching.micro_batches={data.batching.micro_batches} must equal trainer.accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}: the plan balances each optimiser step's micro-batches"
        )
    if SLURMEnvironment.detect() and not any(isinstance(c, SlurmRequeue) for c in trainer.callbacks):
        trainer.callbacks.append(SlurmRequeue())
    trainer.fit(cli.model, datamodule=data, **settings)


def validate(cli: SparseBalanceCLI, **settings) -> None:
    """Compute the validation loss of the configuration's model, or of the checkpoint at --ckpt_path."""
    check_model_and_data(cli)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, **settings)


def test(cli: SparseBalanceCLI, **settings) -> None:
    """Score the configuration's model, or the checkpoint at --ckpt_path, on the data module's test suites."""
    check_model_and_data(cli)
    cli.model.evaluations = cli.datamodule.evaluations()
    cli.trainer.test(cli.model, datamodule=cli.datamodule, **settings)


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
    kernels = KernelSettings.of(model.sparse_attention.config, device, training_dtype(trainer.precision, device))
    profile_hardware(
        model.model_config.hf_config(), kernels, quick=not full, max_length=data.batching.max_tokens, output=output
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


COMMANDS: dict[str, Callable] = {
    "fit": fit, "validate": validate, "test": test, "profile": profile, "export": export, "convert": convert,
}
"""The subcommands, by name; a new one is one more entry. The first line of a command's docstring is its help.
``TRAINER_COMMANDS`` get the built ``SparseBalanceCLI`` and their Trainer method's settings; the others get
their own settings (``--name``, documented in their docstrings) and, built, the configuration sections their
parameters are named after (``SECTIONS``)."""

TRAINER_COMMANDS = ("fit", "validate", "test")
SECTIONS = ("model", "data", "trainer")


@dataclass(frozen=True)
class Subcommand:
    """A command of ``COMMANDS`` as the command line knows it: its parser, and its own settings beside the
    shared sections."""

    parser: LightningArgumentParser
    settings: tuple[str, ...]


def subcommand(name: str) -> Subcommand:
    """The parser of command ``name``: a configuration file option, the seed and the three sections, the same
    for every command so that one configuration serves them all, then the command's own settings."""
    command = COMMANDS[name]
    parser = LightningArgumentParser(
        description=_summary(command), exit_on_error=False,  # a parse error is raised, and said in one line
        dump_header=[f"lightning.pytorch=={L.__version__}"],
    )
    parser.add_argument("-c", "--config", action=ActionConfigFile,
                        help="a configuration file in yaml or json; later ones override earlier ones")
    parser.add_argument("--seed_everything", type=bool | int, default=True,
                        help="the seed fit, validate and test set before building the classes (true: a random one)")
    parser.add_lightning_class_args(SparseCausalLM, "model")
    parser.add_lightning_class_args(LongContextDataModule, "data")
    parser.add_lightning_class_args(L.Trainer, "trainer")
    parser.set_defaults({"trainer.use_distributed_sampler": False})
    if name in TRAINER_COMMANDS:
        settings = parser.add_method_arguments(L.Trainer, name, skip=LightningCLI.subcommands()[name])
    else:
        settings = parser.add_function_arguments(command, skip=set(SECTIONS))
    return Subcommand(parser, tuple(settings))


def command_line() -> tuple[ArgumentParser, dict[str, Subcommand]]:
    """The parser of the whole command line, whose subcommands are ``COMMANDS``, and each one's ``Subcommand``."""
    subcommands = {name: subcommand(name) for name in COMMANDS}
    parser = ArgumentParser(description="SparseBalance: load-balanced long-context training with dynamic sparse "
                            "attention", exit_on_error=False)
    choices = parser.add_subcommands(dest="subcommand")
    for name, known in subcommands.items():
        choices.add_subcommand(name, known.parser, help=_summary(COMMANDS[name]))
    return parser, subcommands


def run_command(name: str, command: Subcommand, config: Namespace) -> SparseBalanceCLI | Path:
    """Run command ``name`` on its parsed ``config``; returns what ``fit``, ``validate`` and ``test`` ran on, or
    what another command returned."""
    settings = {key: config[key] for key in command.settings}
    if name == "fit":
        check_kernel_backend(config.model.get("attention"), config.trainer.accelerator)
    if name in TRAINER_COMMANDS:
        cli = SparseBalanceCLI(command.parser, config)
        COMMANDS[name](cli, **settings)
        return cli
    takes = [section for section in SECTIONS if section in inspect.signature(COMMANDS[name]).parameters]
    built = command.parser.instantiate(config) if takes else config  # export and convert build nothing
    return COMMANDS[name](**settings, **{section: built[section] for section in takes})


def main(args: list[str] | None = None, run: bool = True) -> SparseBalanceCLI | Path:
    """The command line (``args``, default ``sys.argv[1:]``); ``run=False`` parses ``args`` as ``fit``'s
    settings (no command named in them) and returns the model, data module and Trainer built from them,
    running nothing. Only ``args`` is parsed when given, so scripts with command lines of their own call it."""
    try:
        if not run:
            fit_command = subcommand("fit")
            return SparseBalanceCLI(fit_command.parser, fit_command.parser.parse_args(args))
        parser, subcommands = command_line()
        config = parser.parse_args(args)
        return run_command(config.subcommand, subcommands[config.subcommand], config[config.subcommand])
    except Exception as err:
        cause = _named_cause(err)
        if cause is None:
            raise
        # One write per line: the ranks share stderr, and print's separate newline let two ranks' lines run together.
        sys.stderr.write(f"error: {_one_line(cause)}\n")
        end_process(2)


def _summary(command: Callable) -> str:
    """A command's help: the first line of its docstring."""
    return inspect.getdoc(command).splitlines()[0]


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
