"""The LightningDataModule: a litdata corpus (built on first use) served as packed, planned micro-batches."""

from __future__ import annotations

import itertools
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
from torch.utils.data import DataLoader, Dataset

from sparsebalance_pl.datamodules.builder import (
    FolderSource,
    InstalledTextSource,
    SyntheticSource,
    build_splits,
    default_real_text_roots,
    load_lengths,
)
from sparsebalance_pl.datamodules.eval_tasks import TASKS, EvalConfig, make_eval_samples
from sparsebalance_pl.datamodules.longbench import cell_names, collate_prompts, make_prompts, read_longbench
from sparsebalance_pl.datamodules.packing import collate_answers, collate_packed, first_fit
from sparsebalance_pl.datamodules.sampler import (
    BatchingConfig,
    PaddingItem,
    PlannedBatchSampler,
    SharedStream,
    SparsityAwareSampler,
    first_fit_plan,
    group_plan,
)
from sparsebalance_pl.datamodules.synthetic import LengthPrior
from sparsebalance_pl.datamodules.tokenizer import load_tokenizer
from sparsebalance_pl.cost import CostModel
from sparsebalance_pl.distributed import check_ranks_agree
from sparsebalance_pl.errors import ConfigError, DataError
from sparsebalance_pl.evaluation import Evaluation, LongBenchEvaluation, RetrievalEvaluation


class PlanItems(Dataset):
    """A map-style view indexed by plan items: a document index, a ``PaddingItem`` (that document, bearing
    no loss), or a ``SharedStream`` (a marker ``collate_packed`` turns into the batch's ``shared_stream``).

    ``base`` is anything indexable by global document index: a litdata StreamingDataset (an IterableDataset
    whose own ``len`` is the current rank's shard, hence ``size``) or a list of samples.
    """

    def __init__(self, base, size: int, vocab_size: int | None = None, source: Path | None = None) -> None:
        self.base = base
        self.size = size
        self.vocab_size = vocab_size
        self.source = source

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: int | PaddingItem | SharedStream) -> dict:
        if isinstance(key, SharedStream):
            return {"shared_stream": key.size}
        index = key.index if isinstance(key, PaddingItem) else key
        sample = self.base[index]
        if self.vocab_size is not None:
            self._check_tokens(index, sample["tokens"])
        return {**sample, "bears_loss": False} if isinstance(key, PaddingItem) else sample

    def _check_tokens(self, index: int, tokens) -> None:
        """Damaged chunk contents can still parse: an id outside the vocabulary would end the run in the
        embedding lookup (on GPU as a device-side assert), far from its cause."""
        ids = np.asarray(tokens)
        if not ids.size:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise DataError(
                f"{self.source}: sample {index} holds token id {bad}, outside the tokenizer's vocabulary "
                f"[0, {self.vocab_size}): the dataset is corrupt or was built with another data.corpus.tokenizer; "
                f"delete {self.source.parent} so prepare_data rebuilds it"
            )


class SequentialLoaders:
    """Loaders read one after the other as one test loader: Lightning prints one results table per loader and
    would repeat the epoch-level scores in each."""

    def __init__(self, loaders: list[DataLoader]) -> None:
        self.loaders = loaders

    def __iter__(self):
        return itertools.chain.from_iterable(self.loaders)

    def __len__(self) -> int:
        return sum(len(loader) for loader in self.loaders)


@dataclass
class CorpusConfig:
    """Which documents, and how their litdata dataset is built (``prepare_data``).

    Args:
        data_dir: where the litdata dataset lives (built there when missing or built from other settings).
        source: ``synthetic`` (the built-in corpus), ``folder`` (``text_dir``) or ``installed`` (real text found on
            this machine below ``roots``).
        text_dir: the folder of ``.txt``/``.jsonl`` files for ``source: folder``.
        roots: for ``source: installed``, folders (or files) whose ``.py``, ``.md``, ``.rst``, ``.txt`` and
            suffix-less text files are documents, one per file (default: this Python's site-packages and
            ``/usr/share/common-licenses``).
        max_files: for ``source: installed``, how many files with distinct contents to take (a seeded choice).
        tokenizer: ``byte``, ``qwen-tiktoken`` or a local Hugging Face tokenizer directory.
        num_documents: size of the synthetic corpus (train and validation together).
        length_distribution: ``wlbllm``, ``prolong`` or a JSON file of lengths (synthetic corpus).
        max_doc_tokens: longest document; longer ones are split into pieces of this length or rejected.
        oversize: ``split`` or ``reject`` documents longer than ``max_doc_tokens`` (each reported).
        val_fraction: fraction of documents (or files) held out for validation.
        build_workers: processes used to build the litdata dataset.
    """

    data_dir: str = "data/demo"
    source: Literal["synthetic", "folder", "installed"] = "synthetic"
    text_dir: str | None = None
    roots: list[str] | None = None
    max_files: int = 2000
    tokenizer: str = "byte"
    num_documents: int = 4000
    length_distribution: str = "wlbllm"
    max_doc_tokens: int = 4096
    oversize: Literal["split", "reject"] = "split"
    val_fraction: float = 0.02
    build_workers: int = 1

    def __post_init__(self) -> None:
        if self.oversize not in ("split", "reject"):
            raise ConfigError(f"data.corpus.oversize={self.oversize!r} is unknown; allowed: 'split', 'reject'")
        if self.source not in ("synthetic", "folder", "installed"):
            raise ConfigError(
                f"data.corpus.source={self.source!r} is unknown; allowed: 'synthetic', 'folder', 'installed'"
            )
        if self.source == "installed" and self.max_files < 2:
            raise ConfigError(f"data.corpus.max_files={self.max_files} must be at least 2")
        if self.max_doc_tokens < 2:
            raise ConfigError(f"data.corpus.max_doc_tokens={self.max_doc_tokens} must be at least 2")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.corpus.val_fraction={self.val_fraction} must lie in [0, 1)")
        if self.source == "synthetic" and self.num_documents < 2:
            raise ConfigError(f"data.corpus.num_documents={self.num_documents} must be at least 2")


@dataclass
class EvaluationConfig:
    """What ``test`` scores (``sparsebalance_pl.evaluation``).

    Args:
        tasks: synthetic retrieval tasks (``passkey``, ``multikey_niah``, ``kv_retrieval``), scored by exact
            match per task and context length.
        lengths: their context lengths in tokens (default: 512, 1024, ... up to ``corpus.max_doc_tokens``).
        samples_per_cell: samples per task and length.
        longbench: a LongBench-format ``.jsonl`` file, or a folder of them: answers generated greedily and
            scored by QA F1 and exact match per dataset and length bucket (read at start, so a missing path or a
            file without a valid line stops the run before it starts).
        longbench_max_tokens: longest LongBench prompt in tokens; longer ones are cut in the middle (default:
            ``batching.max_tokens - max_new_tokens``).
        max_new_tokens: most tokens generated per LongBench answer; each costs a forward of the whole packed
            micro-batch (no KV cache).
    """

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] | None = None
    samples_per_cell: int = 16
    longbench: str | None = None
    longbench_max_tokens: int | None = None
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"data.evaluation.max_new_tokens={self.max_new_tokens} must be at least 1")


class LongContextDataModule(L.LightningDataModule):
    """Variable-length documents packed into per-rank micro-batches of at most ``batching.max_tokens`` tokens.

    ``prepare_data`` builds ``corpus.data_dir/{train,val}`` as litdata datasets when they are missing or were
    built from another configuration. The StreamingDatasets are opened in the dataloader hooks, after the
    processes have started, as litdata requires. Lightning's distributed sampler must be off
    (``trainer.use_distributed_sampler: false``): the batch sampler shards the plan.

    Costs for ``sab`` come from the run's ``CostModel`` once ``connect`` handed it over (``main.py`` hands the
    module's): predicted seconds of each document at its estimated density. Without one, from token counts.

    Args:
        corpus: the documents (``CorpusConfig``).
        batching: how they are packed and balanced (``BatchingConfig``).
        evaluation: what ``test`` scores (``EvaluationConfig``).
        seed: seed of the corpus and of the per-epoch shuffling.
    """

    def __init__(
        self,
        corpus: CorpusConfig = CorpusConfig(),
        batching: BatchingConfig = BatchingConfig(),
        evaluation: EvaluationConfig = EvaluationConfig(),
        seed: int = 0,
    ) -> None:
        super().__init__()
        # The splits are built once, by global rank 0, in data_dir on the filesystem every node shares (as the
        # checkpoints and the latency table are): one builder per node would write the same folder at once.
        self.prepare_data_per_node = False
        if batching.rank_budget > batching.max_tokens:
            raise ConfigError(
                f"data.batching.tokens_per_rank={batching.rank_budget} must not exceed data.batching.max_tokens="
                f"{batching.max_tokens}"
            )
        self.corpus, self.batching, self.evaluation, self.seed = corpus, batching, evaluation, seed
        if corpus.source == "folder":
            self.source = FolderSource.scan(corpus.text_dir)
        elif corpus.source == "installed":
            roots = corpus.roots or default_real_text_roots()
            self.source = InstalledTextSource.scan(roots, corpus.max_files, seed)
        else:
            self.source = SyntheticSource(
                num_documents=corpus.num_documents, length_distribution=corpus.length_distribution, seed=seed
            )
        if corpus.source == "synthetic":
            LengthPrior.load(corpus.length_distribution)  # fail now, not in prepare_data, on a bad distribution
        self.tokenizer = load_tokenizer(corpus.tokenizer)
        self.data_dir = Path(corpus.data_dir)
        default_lengths = [n for n in (512, 1024, 2048, 4096, 8192, 16384, 32768) if n <= corpus.max_doc_tokens]
        self.eval_config = EvalConfig(
            tasks=tuple(evaluation.tasks),
            lengths=tuple(evaluation.lengths or default_lengths or [corpus.max_doc_tokens]),
            samples_per_cell=evaluation.samples_per_cell,
            seed=seed + 1,
        )
        room = batching.max_tokens - evaluation.max_new_tokens
        self.longbench_max_tokens = room if evaluation.longbench_max_tokens is None else evaluation.longbench_max_tokens
        if evaluation.longbench and not 1 <= self.longbench_max_tokens <= room:
            raise ConfigError(
                f"data.evaluation.longbench_max_tokens={self.longbench_max_tokens} must lie between 1 and "
                f"data.batching.max_tokens - data.evaluation.max_new_tokens = {room}: a prompt and its answer must fit "
                "in one micro-batch"
            )
        self.longbench = read_longbench(evaluation.longbench) if evaluation.longbench else []
        self.longbench_cells = cell_names(self.longbench)[0] if self.longbench else []
        self.train_sampler: SparsityAwareSampler | None = None
        self._resume: dict | None = None
        self.cost_model: CostModel | None = None

    def connect(self, cost_model: CostModel) -> None:
        """The run's cost model, whose document costs sparsity-aware batching balances."""
        self.cost_model = cost_model

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def prepare_data(self) -> None:
        build_splits(
            str(self.data_dir),
            self.source,
            tokenizer_spec=self.corpus.tokenizer,
            max_doc_tokens=self.corpus.max_doc_tokens,
            val_fraction=self.corpus.val_fraction,
            num_workers=self.corpus.build_workers,
            oversize=self.corpus.oversize,
        )

    def lengths(self, split: str) -> np.ndarray:
        return load_lengths(self.data_dir / split)

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def slot_batching(self, context_parallel_size: int | None = None) -> BatchingConfig:
        """The batching of one slot of the training and validation plans: a context-parallel group of W ranks
        (``context_parallel_size``, default the trainer's strategy's) is planned as one slot of W times a rank's
        ``max_tokens`` and budget; the longest allowed document and evaluation sample must fit in a slot (one
        line naming the settings otherwise; ``main.py`` checks this before any process starts)."""
        b = self.batching
        size = self._context_parallel_size() if context_parallel_size is None else context_parallel_size
        slot = b.for_group(size)
        across = f" x context_parallel_size={size}" if size > 1 else ""
        if slot.max_tokens < self.corpus.max_doc_tokens:
            raise ConfigError(
                f"data.batching.max_tokens={b.max_tokens}{across} is below data.corpus.max_doc_tokens="
                f"{self.corpus.max_doc_tokens}: the longest allowed document must fit in one micro-batch; raise "
                "max_tokens (or the context-parallel size) or lower max_doc_tokens"
            )
        if max(self.eval_config.lengths) > slot.max_tokens:
            raise ConfigError(
                f"data.evaluation.lengths={list(self.eval_config.lengths)} exceed data.batching.max_tokens="
                f"{b.max_tokens}{across}"
            )
        if slot.rank_budget < self.corpus.max_doc_tokens:
            raise ConfigError(
                f"data.batching.tokens_per_rank={b.rank_budget}{across} must lie between data.corpus.max_doc_tokens="
                f"{self.corpus.max_doc_tokens} and data.batching.max_tokens={b.max_tokens}{across}"
            )
        return slot

    def _context_parallel_size(self) -> int:
        return getattr(self.trainer.strategy, "context_parallel_size", 1) if self.trainer is not None else 1

    def _check_ranks_agree(self, lengths: np.ndarray) -> None:
        """Stop when ranks would plan from different data or settings: their plans would diverge and the
        collectives hang."""
        b = self.batching
        settings = (self.seed, b.method, b.max_tokens, b.rank_budget, b.defer_window, b.micro_batches)
        check_ranks_agree(
            np.ascontiguousarray(lengths, dtype=np.int64).tobytes() + repr(settings).encode(),
            f"the training data or plan settings: every rank must see the same {self.data_dir} and data settings",
        )

    def items(self, split: str) -> PlanItems:
        """The documents of ``split`` (``train`` or ``val``) by plan item, checked against the vocabulary."""
        import litdata  # heavy to import; only what reads the data needs it

        directory = self.data_dir / split
        return PlanItems(litdata.StreamingDataset(str(directory)), len(self.lengths(split)), self.vocab_size, directory)

    def train_plan(self, num_ranks: int, rank: int, epoch: int = 0) -> SparsityAwareSampler:
        """The training batch sampler of ``rank`` among ``num_ranks`` at ``epoch``, planned for context-parallel
        groups when the strategy has them (``slot_batching``); its ``plan()`` holds every rank's micro-batches,
        which an emulation of many ranks in one process runs itself."""
        self.slot_batching()  # checks that the documents fit
        sampler = SparsityAwareSampler(self.lengths("train"), self.batching, cost_model=self.cost_model,
                                       seed=self.seed, num_replicas=num_ranks, rank=rank,
                                       context_parallel_size=self._context_parallel_size())
        sampler.set_epoch(epoch)
        return sampler

    def _loader(self, split: str, train: bool) -> DataLoader:
        lengths = self.lengths(split)
        num_ranks, rank = self._ranks()
        if train:
            self._check_ranks_agree(lengths)
            sampler = self.train_plan(num_ranks, rank)
            if self._resume:
                sampler.load_state_dict(self._resume)
            self._resume = None
            self.train_sampler = sampler
        else:
            size = self._context_parallel_size()
            slots = first_fit_plan(
                lengths, lengths, max_tokens=self.slot_batching().max_tokens, num_ranks=num_ranks // size,
                seed=self.seed, epoch=0, shuffle=False,
            )
            plan = group_plan(slots, lengths, lengths, group_size=size, rank_tokens=self.batching.max_tokens)
            sampler = PlannedBatchSampler(lambda epoch: plan, rank=rank)
        return DataLoader(
            self.items(split),
            batch_sampler=sampler,
            collate_fn=collate_packed,
            num_workers=self.batching.num_workers,
            persistent_workers=self.batching.num_workers > 0,
        )

    def calibration_batches(self, min_length: int = 1, per_bin: int = 2) -> list[dict]:
        """Packed micro-batches of training documents across the length range, identical on every rank: up to
        ``per_bin`` documents of each half-octave of length from ``min_length`` up, for the model to measure
        its attention density by length before the first epoch is planned (``SparseCausalLM.calibrate_density``).
        Only documents one rank holds (``max_tokens``): each rank runs its batches whole, also under context
        parallelism; longer ones keep the estimator's prior until training measures them."""
        lengths = self.lengths("train")
        order = np.random.default_rng(self.seed).permutation(len(lengths))
        order = order[(lengths[order] >= min_length) & (lengths[order] <= self.batching.max_tokens)]
        bins = np.floor(2 * np.log2(lengths[order])).astype(np.int64)
        picked = np.concatenate([order[bins == b][:per_bin] for b in np.unique(bins)] or [order])
        items = self.items("train")
        packed = first_fit(lengths, picked[np.argsort(-lengths[picked], kind="stable")], self.batching.max_tokens)
        return [collate_packed([items[int(i)] for i in batch]) for batch in packed]

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader("val", train=False) if self.corpus.val_fraction > 0 else []

    def evaluations(self) -> list[Evaluation]:
        """The test suites, in the order of ``test_dataloader``'s loaders: the synthetic retrieval tasks
        (``eval_tasks`` at ``eval_lengths``), then the LongBench prompts (``eval_longbench``)."""
        suites: list[Evaluation] = []
        if self.eval_config.tasks:
            suites.append(RetrievalEvaluation(self.eval_config.cells))
        if self.longbench:
            suites.append(LongBenchEvaluation(self.longbench_cells, self.tokenizer, self.evaluation.max_new_tokens))
        return suites

    def test_dataloader(self) -> SequentialLoaders:
        """One loader per suite of ``evaluations``, read one after the other; each batch carries its suite's
        index (``suite``). Samples are generated in memory, each packed with room for its answer."""
        loaders = []
        for suite in self.evaluations():
            index = len(loaders)
            if isinstance(suite, RetrievalEvaluation):
                samples = make_eval_samples(self.eval_config, self.tokenizer)
                lengths = [len(s["tokens"]) for s in samples]
                collate = collate_answers
            else:
                samples = make_prompts(self.longbench, self.tokenizer, self.longbench_max_tokens)
                lengths = [len(s["tokens"]) + self.evaluation.max_new_tokens for s in samples]
                collate = collate_prompts
            loaders.append(self._eval_loader(samples, lengths, partial(_tagged, collate, index)))
        return SequentialLoaders(loaders)

    def _eval_loader(self, samples: list[dict], lengths: list[int], collate) -> DataLoader:
        """In-memory samples in stream order, packed first-fit by ``lengths``, every rank in step. Each rank
        scores whole streams of up to a slot's tokens, also under context parallelism (no backward there)."""
        lengths = np.array(lengths)
        num_ranks, rank = self._ranks()
        plan = first_fit_plan(
            lengths, lengths, max_tokens=self.slot_batching().max_tokens, num_ranks=num_ranks, seed=self.seed,
            epoch=0, shuffle=False,
        )
        return DataLoader(
            PlanItems(samples, len(samples)),
            batch_sampler=PlannedBatchSampler(lambda epoch: plan, rank=rank),
            collate_fn=collate,
        )

    def state_dict(self) -> dict:
        """Where the training stream stands: the training sampler's state (the epoch and what its plan was made
        with) and the micro-batches this rank has consumed in that epoch.

        Counted from the fit loop's processed batches, not from the sampler, which runs ahead of training
        when batches are prefetched. (Processed, not completed: a checkpoint saved in ``on_train_batch_end``
        is taken after the batch was trained on but before the loop counts it as completed.)
        """
        trainer, sampler = self.trainer, self.train_sampler
        if trainer is None or sampler is None:
            return {}
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {**sampler.state_dict(), "batches_consumed": consumed}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state) if state else None


def _tagged(collate, suite: int, samples: list[dict]) -> dict:
    """``collate(samples)`` with the index of the evaluation suite the batch belongs to."""
    return {**collate(samples), "suite": suite}
