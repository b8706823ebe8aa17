"""The training variants a comparison runs side by side, and the ``NAME:key=value,...`` specs that name them.

A comparison holds everything but the method fixed (model, data, seed, steps) and changes only how the
documents are batched and whether DST moves the budgets, so that the static baseline and SparseBalance differ in
nothing else. A spec may also carry settings of its own (``sparsebalance:anchor=adaptive``), so that several
settings compare in one run, on the same machine state. The benchmarks build on these, whether their variants run
as ``main.py fit`` processes, as emulated ranks (``sparsebalance_pl.comparison``) or in the simulation
(``sparsebalance_pl.simulation``).
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import yaml

from sparsebalance_pl.attention import AttentionConfig
from sparsebalance_pl.dst import check_settings
from sparsebalance_pl.errors import ConfigError

#: name: (attention backend, batching, DST p: 0 measures only, None tunes with the comparison's p)
VARIANTS = {
    "dense": ("dense", "first_fit", 0.0),
    "static": ("sparse", "first_fit", 0.0),
    "sab": ("sparse", "sab", 0.0),
    "dst": ("sparse", "first_fit", None),
    "sparsebalance": ("sparse", "sab", None),
}
#: What every speed-up is measured against: static sparse attention with token first-fit packing.
BASELINE = "static"
#: The DST settings a tuning variant may set for itself in its spec.
VARIANT_SETTINGS = ("anchor", "p", "recall_tolerance")

T = TypeVar("T")


def attempt(name: str, failed: dict[str, str], run: Callable[..., T], *args) -> T | None:
    """``run(*args)``, or None with why it failed under ``failed[name]`` (``one_line``; the traceback goes to
    stderr): a variant that cannot run here (out of memory, a kernel that does not compile for this GPU) loses its
    own row of a comparison, not the others'. An error of the device itself, which may leave it unusable for
    every later variant, ends the comparison."""
    try:
        return run(*args)
    except torch.AcceleratorError:
        raise
    except Exception as error:  # noqa: BLE001 - any other failure is reported in the variant's row
        failed[name] = one_line(error)
        traceback.print_exc()
    if torch.cuda.is_available():  # outside the handler, whose traceback still holds the failed run's tensors
        torch.cuda.empty_cache()
    return None


def one_line(error: BaseException) -> str:
    """An error as one short line for a table: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"


def parse_variant(spec: str, option: str) -> tuple[str, dict[str, int | float | bool | str]]:
    """The spec's name and its settings (integers, floats and true/false parsed, other values kept as strings);
    a malformed item raises ``ConfigError`` naming ``option`` (the command-line option it came from) and the spec."""
    name, _, items = spec.partition(":")
    settings: dict[str, int | float | bool | str] = {}
    for item in filter(None, items.split(",")):
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"{option} {spec!r}: {item!r} is not field=value")
        settings[key] = _value(text)
    return name, settings


def _value(text: str) -> int | float | bool | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def attention_variant(spec: str, option: str = "--attention") -> tuple[str, AttentionConfig]:
    """``NAME:field=value,...`` as a named sparse ``AttentionConfig``, checked as a run's would be, so that a
    selection setting's cost is measured beside the default's."""
    name, settings = parse_variant(spec, option)
    try:
        return name, AttentionConfig(**settings)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{option} {spec!r}: {err}") from None


def variant_kind(spec: str) -> str:
    """Which of ``VARIANTS`` a spec runs (``sparsebalance`` for ``sparsebalance:anchor=adaptive``)."""
    return spec.partition(":")[0]


def dst_settings(spec: str, anchor: str, p: float, recall_tolerance: float) -> dict:
    """The DST callback's settings for ``spec``: its own (``VARIANT_SETTINGS``), else the given ones; p = 0 for
    the variants that only measure. A spec that cannot run raises ``ConfigError`` naming it."""
    kind = variant_kind(spec)
    if kind not in VARIANTS:
        raise ConfigError(f"--variants {spec!r}: unknown variant {kind!r}; allowed: {', '.join(VARIANTS)}")
    _, own = parse_variant(spec, "--variants")
    fixed_p = VARIANTS[kind][2]
    if own and fixed_p is not None:
        raise ConfigError(f"--variants {spec!r}: {kind} does not tune, so it takes no settings")
    unknown = set(own) - set(VARIANT_SETTINGS)
    if unknown:
        raise ConfigError(f"--variants {spec!r}: unknown setting {sorted(unknown)[0]!r}; allowed: "
                          f"{', '.join(VARIANT_SETTINGS)}")
    settings = {"anchor": anchor, "p": p, "recall_tolerance": recall_tolerance, **own}
    if fixed_p is not None:
        settings["p"] = fixed_p
    check_settings(f"--variants {spec!r}: DST", settings["anchor"], float(settings["p"]), 0.0,
                   float(settings["recall_tolerance"]))
    return settings


@dataclass(frozen=True)
class ComparisonSettings:
    """What the variants of one comparison share, kept with its results so that a later analysis (the
    simulation's check, a replayed step) sets each variant up again exactly as it ran. The fields mirror
    ``benchmarks/end_to_end.py``'s options, and a setting that cannot run raises ``ConfigError`` naming the option.

    Args:
        configs: configuration files, stacked in order as ``main.py fit --config a --config b`` does.
        variants: the variant specs, each of ``VARIANTS`` with optional settings of its own.
        out: the folder that holds one folder per variant and round (``run_folder``).
        init: a Hugging Face model directory every variant starts from, or ``"none"`` for random weights.
        steps: optimiser steps of each variant (unless ``epoch_documents``).
        epoch_documents: instead of ``steps``, one epoch over a corpus of this many documents (files of a
            real-text corpus, which splits a long one), so every variant trains on the same documents.
        max_tokens: longest document and micro-batch (None: the configuration's); the corpus gets its own folder.
        warmup: first steps left out of step-time medians.
        p, anchor, recall_tolerance: DST's settings for the tuning variants that do not set their own.
        recall_rows: query rows sampled per layer to measure exact recall (sparse variants).
        devices, accelerator: the Trainer's (None: the configuration's).
        ranks: emulate this many data-parallel ranks in one process (None: real ``main.py fit`` processes).
        calibrate_steps: emulated steps of another epoch run first without updates, so the cost model and DST
            start the measured epoch calibrated, as in the middle of a long run.
        frozen: emulated steps leave the weights as they are, so every variant attends with the same model.
        repeats: time each emulated rank as the median of this many runs (the extra runs' gradients dropped).
        bandwidth_gbps: per-rank link bandwidth of the emulation's all-reduce estimate.
    """

    configs: tuple[str, ...]
    variants: tuple[str, ...]
    out: str
    init: str = "none"
    steps: int = 60
    epoch_documents: int | None = None
    max_tokens: int | None = None
    warmup: int = 5
    p: float = 0.1
    anchor: str = "mean"
    recall_tolerance: float = 0.02
    recall_rows: int = 64
    devices: int | None = None
    accelerator: str | None = None
    ranks: int | None = None
    calibrate_steps: int = 0
    frozen: bool = False
    repeats: int = 1
    bandwidth_gbps: float = 50.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "configs", tuple(str(c) for c in self.configs))
        object.__setattr__(self, "variants", tuple(self.variants))
        object.__setattr__(self, "out", str(self.out))
        emulated = self.ranks is not None
        problems = [
            (emulated and self.ranks < 1, f"--ranks {self.ranks} must be at least 1"),
            (self.frozen and not emulated, "--frozen needs --ranks"),
            (self.repeats < 1 or (self.repeats > 1 and not emulated),
             f"--repeats {self.repeats} needs --ranks and must be at least 1"),
            (self.calibrate_steps < 0 or (self.calibrate_steps > 0 and not emulated),
             f"--calibrate-steps {self.calibrate_steps} needs --ranks and must be >= 0"),
            (self.epoch_documents is None and self.steps <= self.warmup,
             f"--steps {self.steps} leaves no step after --warmup {self.warmup}"),
            (len(set(self.variants)) != len(self.variants),
             f"--variants {' '.join(self.variants)} names a variant twice"),
        ]
        for bad, message in problems:
            if bad:
                raise ConfigError(message)
        for spec in self.variants:
            self.dst(spec)

    def dst(self, spec: str) -> dict:
        """The DST callback's settings of variant ``spec`` (``dst_settings``)."""
        return dst_settings(spec, self.anchor, self.p, self.recall_tolerance)


def merged_configs(paths) -> dict:
    """The configuration files stacked in order, as ``--config a --config b`` does (mappings merge, the rest is
    replaced)."""
    def merge(into: dict, update: dict) -> dict:
        for key, value in update.items():
            into[key] = merge(dict(into.get(key) or {}), value) if isinstance(value, dict) else value
        return into

    merged: dict = {}
    for path in paths:
        merged = merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return merged


def run_folder(out: str | Path, spec: str, round_index: int) -> Path:
    """Where a variant's run of one round keeps its configuration, logs and calibrated state, under ``out``; a
    spec's settings become part of a plain folder name."""
    return (Path(out) / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', spec)}-round{round_index}").resolve()


def variant_config(base: dict, spec: str, settings: ComparisonSettings, run_dir: Path) -> dict:
    """The configuration ``base`` changed only where the variant differs, plus per-step logging into
    ``run_dir``: every variant of a comparison then trains the same model on the same data."""
    backend, batching, _ = VARIANTS[variant_kind(spec)]
    cfg = json.loads(json.dumps(base))  # deep copy
    trainer = cfg["trainer"]
    trainer.update(
        max_steps=settings.steps, log_every_n_steps=1, val_check_interval=settings.steps, enable_checkpointing=False,
        enable_progress_bar=False, default_root_dir=str(run_dir),
    )
    if settings.max_tokens is not None:
        corpus = cfg["data"]["corpus"]
        corpus.update(max_doc_tokens=settings.max_tokens, data_dir=f"{corpus['data_dir']}_{settings.max_tokens}")
        cfg["data"]["batching"]["max_tokens"] = settings.max_tokens
    if settings.epoch_documents is not None:
        trainer.update(max_steps=-1, max_epochs=1, val_check_interval=1.0)
        corpus, k = cfg["data"]["corpus"], settings.epoch_documents
        installed = corpus.get("source") == "installed"  # a real-text corpus: K of its files, a long one split
        folder = f"data/e2e_installed_{k}" if installed else f"data/e2e_{k}"
        corpus.update({"max_files" if installed else "num_documents": k,
                       "data_dir": folder + (f"_{settings.max_tokens}" if settings.max_tokens else "")})
    if settings.devices is not None:
        trainer["devices"] = settings.devices
    if settings.accelerator is not None:
        trainer["accelerator"] = settings.accelerator
    trainer["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(run_dir), "name": "logs", "version": 0},
    }
    dst = {"class_path": "sparsebalance_pl.callbacks.DynamicSparsityTuning", "init_args": settings.dst(spec)}
    trainer["callbacks"] = [{"class_path": "sparsebalance_pl.callbacks.DensityCalibration"}, dst]
    model = cfg["model"]
    model["attention"]["backend"] = backend
    model["attention"]["recall_rows"] = settings.recall_rows if backend == "sparse" else 0
    if settings.init != "none":
        model["model"] = {"pretrained_path": str(Path(settings.init).resolve())}
    cfg["data"]["batching"]["method"] = batching
    return cfg
