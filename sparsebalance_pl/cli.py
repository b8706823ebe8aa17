"""Command line: ``python main.py {fit,validate,test} --config configs/<name>.yaml`` through LightningCLI.

Every setting is checked when the configuration is parsed and the classes are built, in the launching
process and before any process group starts; a bad one ends the run with a single line naming the setting
and what is allowed (exit code 2), not a traceback.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from sparsebalance_pl.datamodules.datamodule import LongContextDataModule
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.module import SparseQwen


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
        if self.trainer.world_size > 1 and self.trainer._accelerator_connector.use_distributed_sampler:
            raise ConfigError(
                "trainer.use_distributed_sampler must be false: the data module shards its own batch plan"
            )

    def before_fit(self) -> None:
        self._check_model_and_data()

    def before_validate(self) -> None:
        self._check_model_and_data()

    def before_test(self) -> None:
        self._check_model_and_data()


def main(args: list[str] | None = None) -> SparseBalanceCLI | None:
    try:
        return SparseBalanceCLI(
            SparseQwen,
            LongContextDataModule,
            trainer_defaults={"use_distributed_sampler": False},
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
